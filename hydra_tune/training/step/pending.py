"""One task's lazy per-shard optimizer step: step t's update of each shard, applied just before the shard is used
again.

    pending = PendingStep(optimizer, shards=[ex.params for ex in execs], params=list(model.parameters()),
                          scaler=scaler, max_norm=task.grad_clip_norm)
    # the minibatch that ends step t has run (all gradients of step t exist), in place of the plain loop's
    # clip / scaler.step / optimizer.step / scaler.update:
    pending.begin()                    # snapshot step t's hyper-parameters, unscale, norms, found-inf, scaler.update()
    scheduler.step()                   # after begin(): the snapshot keeps step t's lr/momentum/betas
    # no optimizer.zero_grad() here: each shard's gradients are dropped when its update is applied
    ...
    pending.apply(i)                   # before shard i's first unit of step t+1: clip, step, grads -> None
    pending.flush()                    # before eval, a checkpoint, model(), a re-plan, the task's end

A loop that zeroes its gradients itself (hydra_tune.prepare: the user's loop) calls ``keep_grads()`` once: ``apply``
then leaves ``.grad`` as the loop left it, and the loop's ``optimizer.zero_grad()`` while updates are pending is
``hold_grads()``: the gradients the updates need leave ``.grad`` (it reads None, as in the plain loop) and wait in
the step's keeping until each update is applied.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...errors import rule_error
from .clip import clip_coefficient, clip_shard, shard_norms, total_norm
from .scaler import ScalerStep
from .snapshot import StepSnapshot, step_shard

# The key under which a held gradient waits in its parameter's optimizer state (hold_grads): it then moves with the
# parameter's state wherever the task's state cache moves that (every tensor of optimizer.state[p] but a host-side
# step counter moves with p, training/resident.py), so the update finds it on the parameter's device.
HELD = "hydra_tune.held_grad"


class PendingStep:
    """The pending-update record of one task (the lazy per-shard step), exact against the plain loop's step.

    Lifecycle (who calls what, when):

    1. Built once per task and plan: ``shards`` lists each shard's parameters in forward order (a parameter listed
       by several shards, such as tied embeddings, belongs to the first: its update is applied before that shard,
       its first user); ``params`` is ``list(model.parameters())``, the order ``clip_grad_norm_`` sees. Every
       parameter of ``params`` and of the optimizer lies in some shard. A re-plan: ``flush()``, then a new object.
    2. Optionally ``prepare(i)`` as soon as shard i's gradients of step t are final (after its last backward of the
       step's last minibatch): its per-shard pieces (unscale and inf check, gradient norms) run where its gradients
       are. Shards not prepared are prepared by ``begin``.
    3. ``begin()`` after the minibatch that ends step t, where the plain loop calls clip / ``scaler.step`` /
       ``optimizer.step`` / ``scaler.update``, and BEFORE ``scheduler.step()``: snapshots step t's hyper-parameters,
       combines the found-inf flags (any shard overflowed: every shard skips step t) and the norms (in parameter
       order: the total and the clip coefficient), and runs ``scaler.update()`` so the next minibatch's loss is
       scaled as in the plain loop. Every shard is then pending. It returns None, or the reason this step cannot be
       split: then call ``flush()`` now (one whole step over every shard, exact).
    4. ``scheduler.step()`` as in the plain loop. No ``optimizer.zero_grad()``: each shard's gradients are kept
       until its update is applied (its next forward comes first, so no new gradient reaches it before).
    5. ``apply(i)`` before shard i's first unit of step t+1 (an F, L or E unit; a no-op returning False when shard
       i has nothing pending): multiplies its gradients by the clip coefficient, steps its optimizer parameters with
       step t's hyper-parameters (unless step t overflowed), then sets their ``.grad`` to None, which is what the
       plain loop's ``optimizer.zero_grad()`` (``set_to_none=True``) does to them (after ``keep_grads()``: leaves
       them as the loop left them, a gradient ``hold_grads`` took used for the update). Model parameters the optimizer
       does not hold keep their (clipped) gradients, as in the plain loop.
    6. ``flush()`` applies every pending shard: before an evaluation, a checkpoint or snapshot (which then see the
       parameters, optimizer state, scaler and ``.grad`` exactly as the plain loop leaves them after step t's
       ``zero_grad``), ``model()``, a re-plan, and the task's end. ``pending_shards()`` lists what is left.

    Rules: one thread calls all of it (the one owning the task's tensors: ``apply`` swaps
    ``optimizer.param_groups`` for its call); "before shard i's first unit" means before anything reads or copies
    shard i's parameters for step t+1, a prefetch included; the update runs where each parameter, its ``.grad``
    and its ``optimizer.state`` are (they must be on one device). Exact: parameters, gradients, optimizer state,
    scaler and scheduler state equal the plain loop's bit for bit once flushed, ``optimizer.state``'s order (what
    ``state_dict()`` lists) included.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, shards: Sequence[Sequence[torch.Tensor]],
                 params: Sequence[torch.Tensor], *, scaler: Any = None, max_norm: float | None = None,
                 norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None) -> None:
        self.optimizer = optimizer
        self.max_norm, self.norm_type = max_norm, float(norm_type)
        self.error_if_nonfinite, self.foreach = error_if_nonfinite, foreach
        self.amp = ScalerStep(scaler, optimizer, clipping=max_norm is not None)
        # model-parameter order, for the norms: only a clipping step reads it (a task keeps this for its life)
        self._position = {id(p): i for i, p in enumerate(params)} if max_norm is not None else {}
        self._owned, self._stepped = self._partition(optimizer, shards, params)
        self._snap: StepSnapshot | None = None
        self._flags: dict[int, list[torch.Tensor]] = {}
        self._norms: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self._left: set[int] = set()
        self._coef: torch.Tensor | None = None
        self._found: torch.Tensor | None = None
        self._grad_scale: torch.Tensor | None = None
        self._skip = False
        self._whole: str | None = None
        self._states_before = 0  # len(optimizer.state) at begin(): entries made after it are this step's
        self._zero_after = True  # apply() sets the gradients to None (the runtime's loop); keep_grads(): the user's

    @staticmethod
    def _partition(optimizer: torch.optim.Optimizer, shards: Sequence[Sequence[torch.Tensor]],
                   params: Sequence[torch.Tensor]) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
        """Each shard's own parameters (first shard listing one owns it) and, of those, the optimizer's."""
        owner: dict[int, int] = {}
        owned: list[list[torch.Tensor]] = [[] for _ in shards]
        for i, shard in enumerate(shards):
            for p in shard:
                if id(p) not in owner:
                    owner[id(p)] = i
                    owned[i].append(p)
        in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
        model = {id(p) for p in params}
        if set(owner) != model | in_opt:
            raise rule_error("the shards hold every parameter of the model and of the optimizer, and no other",
                             "pass each shard's parameters (ShardExec.params), one more shard with the model's "
                             "parameters no stage holds, and list(model.parameters())",
                             shards=len(shards), in_shards=len(owner), model_params=len(model),
                             optimizer_params=len(in_opt), not_in_shards=len((model | in_opt) - set(owner)),
                             foreign=len(set(owner) - model - in_opt))
        pos = {id(p): i for i, p in enumerate(params)}
        owned = [sorted(s, key=lambda p: pos.get(id(p), len(pos))) for s in owned]
        return owned, [[p for p in s if id(p) in in_opt] for s in owned]

    # -- per shard, step t's pieces --------------------------------------------------------------------------
    def prepare(self, shard: int) -> None:
        """Shard ``shard``'s gradients of the coming step are final: unscale/check them and take their norms."""
        if shard in self._left:
            raise RuntimeError(f"shard {shard} still has the previous step's update pending: apply({shard}) "
                               "before its next units")
        if shard in self._flags:
            raise RuntimeError(f"shard {shard} was already prepared for this step")
        opt_grads = [p.grad for p in self._stepped[shard] if p.grad is not None]
        self._flags[shard] = self.amp.unscale(opt_grads)
        if self.max_norm is not None:
            with_grad = [p for p in self._owned[shard] if p.grad is not None]
            norms = shard_norms([p.grad for p in with_grad], self.norm_type, self.foreach)
            self._norms[shard] = [(self._position[id(p)], n) for p, n in zip(with_grad, norms)]

    def begin(self) -> str | None:
        """Step t is due (see the class docstring, 3.): returns None, or why it must be applied whole now."""
        if self._left:
            raise RuntimeError(f"the previous step is still pending for shards {sorted(self._left)}: apply or "
                               "flush them before the next step begins")
        self._snap = StepSnapshot.take(self.optimizer)
        for i in range(len(self._owned)):
            if i not in self._flags:
                self.prepare(i)
        flags = [f for i in sorted(self._flags) for f in self._flags[i]]
        self._flags.clear()
        self._coef = None
        if self.max_norm is not None:
            norms = [n for i in self._norms for n in self._norms[i]]
            self._norms.clear()
            total = total_norm([n for _, n in sorted(norms, key=lambda x: x[0])], self.norm_type,
                               self.error_if_nonfinite)
            self._coef = clip_coefficient(total, self.max_norm)
        self._found = self.amp.found(flags) if self.amp.active else None
        self._grad_scale = self.amp.grad_scale()
        self._skip = self._found is not None and self.amp.skips(self._found)
        if self._found is not None:
            self.amp.update(self._found)
        if not self._skip:
            _note_step_called(self.optimizer)
        self._whole = None if self._skip else _unsplittable(self.optimizer)
        self._states_before = len(self.optimizer.state)
        self._left = set(range(len(self._owned)))
        return self._whole

    def apply(self, shard: int) -> bool:
        """Apply step t's update to ``shard`` if it is pending (else nothing; returns whether it applied). A step
        ``begin`` could not split is applied whole, for every shard, by the first apply or flush."""
        if shard not in self._left:
            return False
        if self._whole is not None:
            self._apply(sorted(self._left))
        else:
            self._apply([shard])
        return True

    def flush(self) -> None:
        """Apply every pending shard's update (before eval, checkpoints, model(), a re-plan, the end)."""
        if self._left:
            self._apply(sorted(self._left))

    def pending_shards(self) -> list[int]:
        """Shards whose update of the last begun step is not applied yet."""
        return sorted(self._left)

    def keep_grads(self) -> None:
        """The loop zeroes the gradients itself: ``apply`` leaves ``.grad`` as the loop left it (see hold_grads)."""
        self._zero_after = False

    def stepped(self, shard: int) -> list[torch.Tensor]:
        """Shard ``shard``'s parameters that its update steps (the optimizer's, each listed by one shard only)."""
        return list(self._stepped[shard])

    def hold_grads(self) -> None:
        """``optimizer.zero_grad()`` (set_to_none) while updates are pending: each pending parameter's gradient
        moves into its optimizer state (``HELD``: it moves with the parameter's state) and ``.grad`` becomes None,
        as the plain loop's zero_grad leaves it; ``apply`` steps with the held gradient. A gradient assigned after
        an earlier hold is dropped (zero_grad's None), the held one kept."""
        state = self.optimizer.state
        for i in self._left:
            for p in self._stepped[i]:
                if p.grad is None:
                    continue
                if HELD not in state.get(p, ()):
                    state[p][HELD] = p.grad
                p.grad = None

    def _take_held(self, stepped: list[torch.Tensor]) -> dict[int, torch.Tensor | None]:
        """Held gradients back into ``.grad`` for the update; returns what ``.grad`` held meanwhile, by id."""
        state, now = self.optimizer.state, {}
        for p in stepped:
            mine = state.get(p)
            if mine is None or HELD not in mine:
                continue
            held = mine.pop(HELD)
            if not mine:  # a state the hold made (first step): the update makes its own, as the plain step does
                del state[p]
            now[id(p)] = p.grad
            p.grad = None  # (CUDA: a gradient must be on its parameter's device when assigned)
            p.grad = held
        return now

    def _apply(self, shards: list[int]) -> None:
        owned = [p for i in shards for p in self._owned[i]]
        stepped = [p for i in shards for p in self._stepped[i]]
        loop_grads = self._take_held(stepped)
        if self._coef is not None:
            clip_shard([p.grad for p in owned if p.grad is not None], self._coef, self.foreach)
        if not self._skip and self._snap is not None:  # begin() took the snapshot when it made shards pending
            found = self._found if self.amp.fused else None
            step_shard(self.optimizer, stepped, self._snap, grad_scale=self._grad_scale, found_inf=found)
        for p in stepped:
            if self._zero_after:
                p.grad = None  # optimizer.zero_grad(set_to_none=True), for this shard's parameters
            elif id(p) in loop_grads:
                p.grad = loop_grads[id(p)]  # the loop zeroed it (held): None, or what it assigned since
        self._left.difference_update(shards)
        if not self._left:
            self._snap = self._coef = self._found = self._grad_scale = None
            _order_new_state(self.optimizer, self._states_before)


def _note_step_called(optimizer: torch.optim.Optimizer) -> None:
    """The plain loop calls ``optimizer.step()`` before ``scheduler.step()``; an LR scheduler's wrapper of
    ``optimizer.step`` notes that in ``_opt_called`` and warns at its first step when it is missing. The lazy step
    runs later, so note it now, as the wrapper would (only where a scheduler wrapped the step)."""
    if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        optimizer._opt_called = True  # type: ignore[attr-defined]


def _order_new_state(optimizer: torch.optim.Optimizer, before: int) -> None:
    """Put the ``optimizer.state`` entries this step made in the order the whole step makes them (param-group
    order; ``state_dict()`` lists them so), not the order the shards were applied in."""
    state = optimizer.state
    if len(state) == before:
        return
    made = {id(p) for p in list(state)[before:]}
    for p in [p for g in optimizer.param_groups for p in g["params"] if id(p) in made]:
        state[p] = state.pop(p)


def _unsplittable(optimizer: torch.optim.Optimizer) -> str | None:
    """Why this step's update depends on the set of parameters stepped together, or None. SGD with momentum in
    its foreach or fused code decides per param group whether all momentum buffers exist (fused: 'first step');
    a group where some parameters with gradients have a buffer and others not (a parameter's first gradient came
    later) takes another path as a whole than a shard's part of it would."""
    if type(optimizer) is not torch.optim.SGD:
        return None
    for i, group in enumerate(optimizer.param_groups):
        if group["momentum"] == 0 or group.get("foreach") is False and not group.get("fused"):
            continue
        has = {"momentum_buffer" in optimizer.state.get(p, {}) for p in group["params"] if p.grad is not None}
        if len(has) > 1:
            return (f"SGD param group {i}: some parameters have momentum buffers and others get their first "
                    "gradient now (foreach/fused SGD treats the group as a whole)")
    return None
