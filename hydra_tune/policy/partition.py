"""Memory model and partitioner: stages -> shards under a byte budget. Pure functions over plain numbers.

    costs = [StageCost("a", params=((0, 400, True),), input_bytes=64, output_bytes=64, fwd_peak=64,
                       saved_bytes=128, grad_fwd_peak=128, bwd_peak=528), ...]
    plan = partition(costs, budget=4096)            # fewest shards whose every unit fits, or PlanError
    [s.names for s in plan.shards]

Units of a shard i..j: an eval forward without autograd (E), a training forward with autograd whose graph goes
at its end (F: some kernels compute otherwise without autograd, so F runs as the plain loop's forward does), or
a forward with autograd followed by backward (B: recompute + backward; L: the last shard's forward + loss +
backward). Their peak device bytes:

    E = P + Bf + in_i + max_k (fwd_peak_k + [k > i] * in_k)
    F = P + Bf + in_i + max_k (sum_{m<k} saved_m + grad_fwd_peak_k)
    B = P + Bf + in_i + max( max_k (sum_{m<k} saved_m + grad_fwd_peak_k),
                             sum_k saved_k + max_k (G_{>k} + bwd_peak_k) )
    offloading F and B = P + Bf + in_i + max( max_k (off_fwd_peak_k + [k > i] * in_k),
                                              max_k (G_{>k} + off_bwd_peak_k) )

P: bytes of the distinct parameters (a parameter shared by two stages is one copy), G_{>k}: gradients of the
trainable parameters of the stages after k (made earlier in the backward), Bf: buffers, in_k: stage k's input
carry, and the per-stage measurements of StageCost.
With ``prefetch`` each unit must also leave room for the next shard's parameters and buffers (the second buffer
of double buffering), bounded by the plan's largest shard.

Keeping activations: a shard's forward may run with autograd and keep its graph on the device (its parameter
copies released, refilled for the backward) so its B unit needs no recompute. A minibatch runs on one device, so
the kept shards of one minibatch sit next to each of its units: ``sum(kept_bytes of kept shards) + peak <= budget``.
Which shards: the most measured forward seconds saved per kept byte (``choose_keep``). A shard that cannot stay
may *offload* instead: its saved activations go to host memory as they are made and come back during its
backward, when moving them (at the device's measured copy bandwidth) costs less than recomputing its forward
(``choose_offload``); it holds no device bytes in between. Every other shard recomputes.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import PlanError, format_bytes


@dataclass(frozen=True)
class StageCost:
    """What one stage costs on a device, measured on a sample batch (bytes)."""

    name: str
    params: tuple[tuple[int, int, bool], ...] = ()  # (parameter key, bytes, trainable)
    buffer_bytes: int = 0
    input_bytes: int = 0
    output_bytes: int = 0
    fwd_peak: int = 0        # above the input, while running without autograd (output included)
    saved_bytes: int = 0     # kept after a forward with autograd: saved tensors and the output
    grad_fwd_peak: int = 0   # above the input, at the peak of the forward with autograd
    bwd_peak: int = 0        # above everything kept, at the peak of its backward (all gradients it makes)
    fwd_seconds: float = 0.0  # measured time of its forward: what keeping its activations saves per minibatch
    off_fwd_peak: int = 0    # above the input, forward with saved activations sent to host (0: not measured)
    off_bwd_peak: int = 0    # above what that forward holds, its backward bringing them back
    draws_host: bool = False  # its forward (or the loss) drew from Python's or numpy's global generator


@dataclass(frozen=True)
class Shard:
    index: int
    start: int          # first stage index
    stop: int           # one past the last stage index
    names: tuple[str, ...]
    state_bytes: int    # parameters + buffers copied in for every unit
    forward_peak: int   # E unit (a forward without autograd)
    backward_peak: int  # B or L unit
    kept_bytes: int = 0       # a forward with autograd keeps this much on the device (input + saved tensors)
    fwd_seconds: float = 0.0  # measured: the recompute a kept forward saves
    input_bytes: int = 0
    output_bytes: int = 0
    off_forward_peak: int = 0   # F unit when its forward offloads (saved activations leave as they are made)
    off_backward_peak: int = 0  # its B unit (they come back one stage at a time)
    train_forward_peak: int = 0  # F unit: a forward with autograd, its graph let go at the end (<= backward_peak)

    @property
    def offload_peak(self) -> int:
        return max(self.off_forward_peak, self.off_backward_peak)

    def unit_peak(self, kind: str, mode: str = "recompute") -> int:
        """Predicted device bytes of its ``kind`` unit ("F", "L", "B", "E") run in ``mode`` ("recompute",
        "offload"; kept forwards hold their graph, counted by the plan's held bytes)."""
        if mode == "offload" and kind in ("F", "B"):
            return self.off_forward_peak if kind == "F" else self.off_backward_peak
        if kind == "F":
            return self.train_forward_peak or self.forward_peak
        return self.forward_peak if kind == "E" else self.backward_peak

    @property
    def offload_bytes(self) -> int:
        """Saved activations an offloading forward moves to host memory (and back for its backward)."""
        return max(self.kept_bytes - self.input_bytes - self.output_bytes, 0)

    @property
    def peak(self) -> int:
        return max(self.forward_peak, self.backward_peak)


@dataclass(frozen=True)
class Plan:
    shards: tuple[Shard, ...]
    budget: int | None
    prefetch_bytes: int  # room kept free on the device for the next unit's shard
    keep: tuple[bool, ...] = ()     # per shard: its training forward keeps activations (no recompute in B)
    offload: tuple[bool, ...] = ()  # per shard: its forward moves saved activations to host memory

    @functools.cached_property  # (a frozen plan: read at every segment)
    def peak(self) -> int:
        """The largest predicted device bytes of any unit, prefetch buffer and held activations included."""
        return max(self.unit_peak(s.index) for s in self.shards) + self.prefetch_bytes + self.held_bytes

    def unit_peak(self, shard: int) -> int:
        """The shard's largest unit in the mode the plan runs it in (the partition itself fits the recompute
        peaks, which bound every mode)."""
        sh = self.shards[shard]
        return sh.offload_peak if self.offloads(shard) and sh.offload_peak else sh.peak

    @property
    def held_bytes(self) -> int:
        """Device bytes a minibatch's kept and offloaded forwards hold until their backward."""
        return sum(s.kept_bytes for s in self.shards if self.keeps(s.index))

    def keeps(self, shard: int) -> bool:
        return bool(self.keep) and self.keep[shard]

    def may_keep(self) -> bool:
        """Whether this plan's devices may keep forwards' graphs at all (planned with ``keep``: ``keep`` is set)."""
        return bool(self.keep)

    def offloads(self, shard: int) -> bool:
        return bool(self.offload) and self.offload[shard]

    def extra_seconds(self, bandwidth: float | None) -> float:
        """Predicted seconds per minibatch beyond one forward and backward: recomputes and offload copies."""
        out = 0.0
        for sh in self.shards[:-1]:
            if self.offloads(sh.index):
                out += 2 * sh.offload_bytes / bandwidth if bandwidth else 0.0
            elif not self.keeps(sh.index):
                out += sh.fwd_seconds
        return out


def choose_offload(shards: Sequence[Shard], keep: Sequence[bool], bandwidth: float | None) -> tuple[bool, ...]:
    """Which of the shards that do not keep move their saved activations to host memory instead of
    recomputing: those whose two copies (out and back at ``bandwidth`` bytes/s) take less than their measured
    forward. Nothing of theirs stays on the device between their F and B but their parameters' (empty)
    tensors, so they need no room."""
    out = [False] * len(shards)
    for sh in shards[:-1]:
        if bandwidth and not keep[sh.index] and 2 * sh.offload_bytes / bandwidth < sh.fwd_seconds:
            out[sh.index] = True
    return tuple(out)


def choose_keep(shards: Sequence[Shard], room: int | None) -> tuple[bool, ...]:
    """Which shards' forwards keep their activations within ``room`` bytes (None: unlimited).

    The last shard never needs it (its forward and backward are one unit). Greedy by measured forward seconds
    saved per kept byte, later shards first among equals; a shard with no measured benefit is not kept.
    """
    keep = [False] * len(shards)
    order = sorted(range(len(shards) - 1),
                   key=lambda i: (-shards[i].fwd_seconds / max(shards[i].kept_bytes, 1), -i))
    left = room
    for i in order:
        sh = shards[i]
        if sh.fwd_seconds <= 0 or (left is not None and sh.kept_bytes > left):
            continue
        keep[i] = True
        if left is not None:
            left -= sh.kept_bytes
    return tuple(keep)


def _unique_params(costs: Sequence[StageCost]) -> dict[int, tuple[int, bool]]:
    seen: dict[int, tuple[int, bool]] = {}
    for c in costs:
        for key, nbytes, trainable in c.params:
            seen[key] = (nbytes, trainable)
    return seen


def shard_of(costs: Sequence[StageCost], start: int, stop: int, index: int = 0) -> Shard:
    """The shard made of stages ``start..stop-1`` with its predicted unit peaks."""
    part = costs[start:stop]
    params = _unique_params(part)
    p = sum(n for n, _ in params.values())
    state = p + sum(c.buffer_bytes for c in part)
    base = state + part[0].input_bytes
    fwd = base + max(c.fwd_peak + (c.input_bytes if k else 0) for k, c in enumerate(part))
    kept, grad_fwd = 0, 0
    for c in part:
        grad_fwd = max(grad_fwd, kept + c.grad_fwd_peak)
        kept += c.saved_bytes
    # Backward runs the stages in reverse; gradients of the later stages' parameters stay while stage k runs.
    later_grads, bwd_top, off_bwd = 0, 0, 0
    for k in range(len(part) - 1, -1, -1):
        bwd_top = max(bwd_top, later_grads + part[k].bwd_peak)
        c = part[k]
        off_bwd = max(off_bwd, later_grads + (c.off_bwd_peak or c.saved_bytes + c.bwd_peak))
        later_grads = sum(n for n, trainable in _unique_params(part[k:]).values() if trainable)
    bwd = base + max(grad_fwd, kept + bwd_top)
    off_fwd = base + max((c.off_fwd_peak or c.grad_fwd_peak) + (c.input_bytes if k else 0)
                         for k, c in enumerate(part))
    return Shard(index, start, stop, tuple(c.name for c in part), state, fwd, bwd,
                 kept_bytes=part[0].input_bytes + kept, fwd_seconds=sum(c.fwd_seconds for c in part),
                 input_bytes=part[0].input_bytes, output_bytes=part[-1].output_bytes,
                 off_forward_peak=off_fwd, off_backward_peak=base + off_bwd, train_forward_peak=base + grad_fwd)


def _greedy(costs: Sequence[StageCost], limit: int | None, state_cap: int | None = None) -> list[Shard] | int:
    """Fewest consecutive shards with every unit peak <= limit (and parameters+buffers <= state_cap); on failure
    the index of a stage that cannot fit alone."""
    def fits(sh: Shard) -> bool:
        return (limit is None or sh.peak <= limit) and (state_cap is None or sh.state_bytes <= state_cap)

    shards: list[Shard] = []
    start = 0
    while start < len(costs):
        best = shard_of(costs, start, start + 1, len(shards))
        if not fits(best):
            return start
        stop = start + 1
        while stop < len(costs):
            longer = shard_of(costs, start, stop + 1, len(shards))
            if not fits(longer):
                break
            best, stop = longer, stop + 1
        shards.append(best)
        start = stop
    return shards


def partition(costs: Sequence[StageCost], budget: int | None, *, prefetch: bool = True, keep: bool = True,
              bandwidth: float | None = None) -> Plan:
    """Cut ``costs`` into the fewest shards whose units fit ``budget`` (None: one shard of everything).

    With ``prefetch``, a plan of several shards keeps room for its largest shard's state next to every unit.
    The reserve depends on the plan, so candidate caps on shard state are tried (each stage's own state and the
    shards of the plan without a reserve), and the plan with the fewest shards wins. With ``keep``, the room left
    under the budget goes to kept activations (``choose_keep``), then to offloading ones (``choose_offload``,
    given the device's copy ``bandwidth`` in bytes/s); a plan with up to twice as many shards is taken instead
    when it predicts fewer extra seconds per minibatch (``Plan.extra_seconds``).
    """
    if not costs:
        raise PlanError("a model has at least one stage, but got (stages=0). Fix: give the model some layers.")
    plain = _greedy(costs, budget)
    if budget is None or (isinstance(plain, list) and (len(plain) == 1 or not prefetch)):
        return _with_held(tuple(plain), budget, 0, keep, bandwidth)  # type: ignore[arg-type]
    singles = [shard_of(costs, i, i + 1) for i in range(len(costs))]
    candidates = {sh.state_bytes for sh in singles}
    if isinstance(plain, list):
        candidates |= {sh.state_bytes for sh in plain}
    if any(not trainable for c in costs for _, _, trainable in c.params):
        candidates |= _window_states(costs, budget)  # frozen weights: shards may hold more (see there)
    plans: list[list[Shard]] = []
    for cap in sorted(candidates):
        result = _greedy(costs, budget - cap, cap)
        if isinstance(result, list):
            plans.append(result)
    if not plans:
        worst = max(range(len(costs)), key=lambda i: singles[i].peak + singles[i].state_bytes)
        raise _too_big(costs, worst, budget, singles[worst].state_bytes)
    fewest = min(len(p) for p in plans)
    best: Plan | None = None
    for shards in sorted(plans, key=len):
        if len(shards) > (2 * fewest if keep else fewest):
            break
        plan = _with_held(tuple(shards), budget, max(sh.state_bytes for sh in shards), keep, bandwidth)
        if best is None or plan.extra_seconds(bandwidth) < best.extra_seconds(bandwidth):
            best = plan
    return best  # type: ignore[return-value]


def _window_states(costs: Sequence[StageCost], budget: int, most: int = 48) -> set[int]:
    """More reserves to try for a model with frozen weights: the parameters+buffers of runs of consecutive
    stages that could hold a shard next to its own copy (at most ``most``, spread over their range). Frozen
    weights need no gradients, so a LoRA model's shards may hold several layers: the reserve of such a shard is
    a run's state, which neither one stage's nor a plan without reserve's need be. (Models without frozen
    weights keep the candidates they always had: their plans do not change.)"""
    states: set[int] = set()
    for i in range(len(costs)):
        seen: dict[int, int] = {}
        total = 0
        for c in costs[i:]:
            for key, nbytes, _ in c.params:
                if key not in seen:
                    seen[key] = nbytes
                    total += nbytes
            total += c.buffer_bytes
            if 2 * total > budget:
                break
            states.add(total)
    ordered = sorted(states)
    step = max(len(ordered) // most, 1)
    return set(ordered[::step])


def _with_held(shards: tuple[Shard, ...], budget: int | None, reserve: int, keep: bool,
               bandwidth: float | None) -> Plan:
    """The plan with kept and offloading shards chosen in the room the budget leaves."""
    if not keep:
        return Plan(shards, budget, reserve)
    room = None if budget is None else budget - reserve - max(sh.peak for sh in shards)
    kept = choose_keep(shards, room)
    return Plan(shards, budget, reserve, kept, choose_offload(shards, kept, bandwidth))


def resident_fits(peak: int, state_bytes: int, budget: int | None) -> bool:
    """Whether a task's state (``state_bytes``: parameters, gradients, optimizer state and the step's temporaries)
    may stay on a device beside its units (``peak``: its plan's peak) within ``budget`` (None: unlimited).
    Conservative: the peak counts the running shard's parameter copies, which a resident shard does not make."""
    return budget is None or peak + state_bytes <= budget


def entry_plan(costs: Sequence[StageCost], budget: int | None, need: Callable[[Plan], int], *,
               keep: bool = True, bandwidth: float | None = None, steps: int = 16) -> Plan | None:
    """A plan whose every shard's state entry fits next to the plan's peak within ``budget``: ``need(plan)``
    is the largest sum of entries one unit of ``plan`` reads (parameters, gradients, optimizer state and the
    step's temporaries: the caller knows them), and ``resident_fits(plan.peak, need(plan), budget)`` must hold.
    The units are planned for the budget less a reserve growing by ``budget / steps`` until it holds (more,
    smaller shards: the first that fits has the fewest); None when none does (no budget, or the units of a stage
    leave no room for its entry)."""
    if budget is None:
        return None
    for k in range(1, steps):
        try:
            plan = partition(costs, budget - k * budget // steps, keep=keep, bandwidth=bandwidth)
        except PlanError:
            return None  # smaller budgets fail too
        if resident_fits(plan.peak, need(plan), budget):
            return plan
    return None


def _too_big(costs: Sequence[StageCost], i: int, budget: int | None, reserve: int) -> PlanError:
    alone = shard_of(costs, i, i + 1)
    need = alone.peak + reserve
    return PlanError(
        f"`unit peak <= device_memory` must hold for every stage, but stage {costs[i].name!r} (#{i}) alone needs "
        f"{format_bytes(need)}: parameters+buffers {format_bytes(alone.state_bytes)}, activations and gradients "
        f"{format_bytes(alone.peak - alone.state_bytes)}, prefetch buffer {format_bytes(reserve)}; got "
        f"(peak={need}, device_memory={budget}), over by {format_bytes(need - (budget or 0))}. "
        f"Fix: raise device_memory to at least {need} bytes, use smaller batches or sequences, "
        f"or split that stage into smaller ones.")
