"""Measure what each stage costs on a device by running it once on a sample batch (memory model inputs).

    costs = measure_costs(cut, sample_batch, loss_fn=None)      # list[StageCost], one per stage
    plan = partition(costs, budget)
    PROFILES.info()                                             # {"hits": ..., "misses": ...}: reused profiles

An architecture is measured once per process: a later call with an equal model, batch layout, loss and precision
gets the stored costs with its own parameters (profile_cache.py says what "equal" holds), after a check of its
batch (every stage's forward and the loss, without autograd, as below) where the batch's integer values lie
outside those measured or checked before.

Each stage runs on a private CPU stand-in device whose accounting counts every storage the stage creates: once
without autograd, once with autograd and backward. Errors in the model, the batch or the loss surface here, before
training.

Rules: profiling has no effect the user can see. The stages run as deep copies of their modules (Python
attributes, plain tensor attributes and hook objects copied; parameters and buffers shared with the model but
never written: every forward runs over device copies of them, as training does), the Python state the copies
share with the model (hook closures) is put back afterwards, random draws come from a scratch stream, and
modes and ``.grad`` stay as they were. A model that cannot be deep-copied is profiled itself, its Python state
put back, with a warning naming what could not be.
"""
from __future__ import annotations

import contextlib
import copy
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten  # torch's own pytree walk: there is no public one

from ..device.devices import CpuDevice, Device
from ..device.rng import TaskRNG
from ..errors import rule_error
from ..policy.partition import StageCost
from ..stages import ModelStages, Stage
from . import host_rng
from .carry import output_needs
from .profile_cache import PROFILES, Lookup
from .pystate import ModuleState
from .residency import offloading
from .shard import ShardExec
from .store import tree_bytes
from .trees import open_dataclasses, tensor_leaves


# one stage's run in a profile: (its cost or None, the next stage's input carry, which of its tensors need a gradient)
PerStage = Callable[..., tuple[StageCost | None, Any, Any]]


def _stage_cost(ex: ShardExec, dev: CpuDevice, carry: Any, batch: Any, loss_fn: Any, last: bool,
                rng: TaskRNG, needs: tuple[bool, ...] | None) -> tuple[StageCost, Any, tuple[bool, ...] | None]:
    acct = dev.account
    with dev.unit_scope(rng) as mode:
        with torch.no_grad():
            copies = ex.load(dev, grad=False)
            carry_dev = ex.to_device(dev, carry)
            versions = _versions(carry_dev) if ex.index == 0 else None
            weights = {id(p): copies[id(p)]._version for p in ex.params}
            base = acct.current
            acct.reset_peak()
            dev.sync()
            t0 = time.perf_counter()
            out = ex.run(carry_dev, copies, dev)
            dev.sync()
            fwd_seconds = time.perf_counter() - t0  # what recomputing it costs: the value of keeping it
            if versions is not None and _versions(carry_dev) != versions:
                raise _input_changed(ex)
            if any(copies[key]._version != v for key, v in weights.items()):
                raise _weights_changed(ex, [key for key, v in weights.items() if copies[key]._version != v])
            open_dataclasses(out)  # a dataclass output's tensors are moved and joined as a tuple's from now on
            fwd_peak = acct.peak - base
            del copies, carry_dev
        copies = ex.load(dev, grad=True)
        carry_dev, _ = ex.grad_inputs(dev, carry, needs)
        base = acct.current
        acct.reset_peak()
        try:
            out_g = ex.run(carry_dev, copies, dev)
        except RuntimeError as exc:
            if ex.index > 0 and "leaf Variable that requires grad is being used in an in-place" in str(exc):
                raise _input_changed(ex) from exc  # (its input is a leaf here, collecting the gradient to send back)
            raise
        needs_out = None if last else output_needs(out_g)
        if last:
            out_g = ex.loss(dev, loss_fn, out_g, batch)
        saved = acct.current - base
        grad_fwd_peak = acct.peak - base
        bwd_peak = _backward_peak(dev, out_g)
        del out_g
        off_fwd_peak, off_bwd_peak = (0, 0) if last else _offload_peaks(ex, dev, carry, mode, needs)
    params = tuple((id(p), p.numel() * p.element_size(), p.requires_grad) for p in ex.params)
    buffers = sum(b.numel() * b.element_size() for b in ex.buffers.values())
    cost = StageCost(ex.names[0], params, buffers, tree_bytes(carry), tree_bytes(out), fwd_peak, saved,
                     grad_fwd_peak, bwd_peak, fwd_seconds, off_fwd_peak, off_bwd_peak)
    return cost, out, needs_out


def _stage_check(ex: ShardExec, dev: CpuDevice, carry: Any, batch: Any, loss_fn: Any, last: bool,
                 rng: TaskRNG, needs: Any) -> tuple[None, Any, None]:
    """The stage's forward on ``carry`` without autograd (and the loss after the last one): what the batch's
    values make raise raises here (profile_cache.py ``needs_check``); nothing is measured."""
    with dev.unit_scope(rng), torch.no_grad():
        out = ex.run(ex.to_device(dev, carry), ex.load(dev, grad=False), dev)
        open_dataclasses(out)
        if last:
            ex.loss(dev, loss_fn, out, batch)
    return None, out, None


def _versions(tree: Any) -> list[int]:
    return [t._version for t in tensor_leaves(tree) if isinstance(t, torch.Tensor)]


def _input_changed(ex: ShardExec) -> Exception:
    """The first stage changed a tensor of its batch in place: the plain loop's batch tensors change with it (a
    list of batches reused every epoch then trains on changed data), while a unit changes its device copy. A later
    stage changed its input in place: a unit's input is a leaf of its own graph (the gradient to send back
    collects there), which autograd refuses to change in place."""
    if ex.index == 0:
        return rule_error("the model's forward changes no tensor of its input batch in place (a unit runs it on the "
                          "batch's device copy, so the batch would not change as it does in the plain loop, where a "
                          "batch reused by a later epoch arrives changed)", "change a copy (`x = x * 0.5` instead "
                          "of `x.mul_(0.5)`, or `x = x.clone()` first)", stage=ex.names[0])
    return rule_error("a stage after the first changes no tensor of its input in place (each stage's input is where "
                      "the gradient for the stage before it collects)", "make that change out of place (`x = x + 1` "
                      "instead of `x.add_(1)`), or declare stages so that the module doing it is in the stage before "
                      "(a module with `inplace=True` joins it by itself)", stage=ex.names[0])


def _weights_changed(ex: ShardExec, keys: list[int]) -> Exception:
    """A forward wrote into parameters (nn.Embedding's ``max_norm`` renormalizes the rows it looks up): units run
    on device copies and the step updates the task's own parameters, so the change would be lost."""
    names = {id(p): f"{stage.name}.{name}" for stage in ex.stages for name, p in stage.module.named_parameters()}
    return rule_error("the model's forward changes no parameter in place (units run it on device copies of the "
                      "parameters, and the optimizer steps the task's own)", "leave the parameters to the optimizer:"
                      " for nn.Embedding, pass max_norm=None (it renormalizes the rows it looks up in its forward)",
                      parameters=[names.get(k, "?") for k in keys])


def _offload_peaks(ex: ShardExec, dev: CpuDevice, carry: Any, mode: Any,
                   needs: tuple[bool, ...] | None) -> tuple[int, int]:
    """Peaks of the stage's forward with its saved activations sent to host memory, and of its backward
    bringing them back (each above what is held when it starts)."""
    acct = dev.account
    copies = ex.load(dev, grad=True)
    carry_dev, _ = ex.grad_inputs(dev, carry, needs)
    base = acct.current
    acct.reset_peak()
    with offloading(dev, copies, mode):
        out = ex.run(carry_dev, copies, dev)
    fwd = acct.peak - base
    return fwd, _backward_peak(dev, out)


def _backward_peak(dev: CpuDevice, out: Any) -> int:
    """Backward from ``out`` (ones as incoming gradients): its peak bytes above what is held when it starts."""
    acct = dev.account
    held = acct.current
    acct.reset_peak()
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    return acct.peak - held


def measure_costs(cut: ModelStages, batch: Any, loss_fn: Any = None, seed: int = 0,
                  autocast: torch.dtype | None = None, device: Device | None = None) -> list[StageCost]:
    """Per-stage StageCost for ``cut`` on ``batch`` (sizes scale with the batch shape: use a real batch); an
    equal architecture's when one was measured before (PROFILES).

    ``device``: the device the task will run on. Where it has a profile device of its own (a GPU:
    ``Device.profile_device``), the stages are measured there, since its kernels allocate otherwise than the
    CPU's (the CPU profile was 12% high on an H200, fused attention); a device profile that runs out of memory
    (the GPU is busy with other tasks' units) falls back to the CPU profile, with a warning."""
    on = device.profile_device() if device is not None else None
    if on is not None:
        found = PROFILES.find(cut, batch, loss_fn, (autocast, on.torch_device.type))
        try:
            return _costs(found, cut, batch, loss_fn, seed, autocast, on)
        except torch.OutOfMemoryError as exc:
            warnings.warn(f"hydra_tune could not measure the model's stages on {device.name} ({exc}); it plans "
                          "from the CPU profile, which may overestimate the GPU's memory by about 10%",
                          RuntimeWarning, stacklevel=2)
    return _costs(PROFILES.find(cut, batch, loss_fn, autocast), cut, batch, loss_fn, seed, autocast)


def _costs(found: Lookup, cut: ModelStages, batch: Any, loss_fn: Any, seed: int, autocast: torch.dtype | None,
           dev: CpuDevice | None = None) -> list[StageCost]:
    """The costs ``found`` holds; an equal architecture's once ``batch`` was checked (profile_cache.py); else
    measured now on ``dev`` (None: a CPU stand-in), and kept. A check runs on a CPU stand-in always: an id past
    the vocabulary raises an IndexError there, where a GPU's kernel would fail the whole device's context."""
    if found.costs is not None:
        return found.costs
    if found.needs_check:
        _measure(cut, batch, loss_fn, seed, autocast, None, _stage_check)
        return found.checked()
    return found.store(_measure(cut, batch, loss_fn, seed, autocast, dev))


def _measure(cut: ModelStages, batch: Any, loss_fn: Any, seed: int, autocast: torch.dtype | None,
             dev: CpuDevice | None = None, per_stage: PerStage | None = None) -> list[StageCost]:
    dev = dev or CpuDevice("profile", None)
    with _forked_rng(dev.torch_device), host_rng.kept():  # the plain loop never runs these forwards
        return _measure_on(dev, cut, batch, loss_fn, seed, autocast, per_stage or _stage_cost)


def _forked_rng(where: torch.device) -> contextlib.AbstractContextManager[Any]:
    """A GPU profile's draws come from the GPU's default generator (a CPU's from a scratch stream): put it back."""
    if where.type != "cuda":
        return contextlib.nullcontext()
    return torch.random.fork_rng(devices=[where.index or 0], device_type="cuda")


def _measure_on(dev: CpuDevice, cut: ModelStages, batch: Any, loss_fn: Any, seed: int,
                autocast: torch.dtype | None, per_stage: PerStage) -> list[StageCost]:
    """``per_stage`` (``_stage_cost``, or ``_stage_check``: no costs) over every stage of scratch copies of the
    cut, the model's state put back afterwards (the module docstring's rules)."""
    rng = TaskRNG(seed)
    open_dataclasses(batch)
    carry = cut.prepare(batch)
    stages = _scratch_stages(cut.stages)
    before = ModuleState.take(m for s in stages for m in s.module.modules())
    loss_state = ModuleState.of_callables([("loss", loss_fn)]) if loss_fn is not None else None
    shared = _SharedTensors(cut.stages)
    costs = []
    host = host_rng.states()
    try:
        needs = None  # which of a stage's input tensors require a gradient (the stage before's output)
        for k, stage in enumerate(stages):
            ex = ShardExec(k, [stage], autocast)
            cost, carry, needs = per_stage(ex, dev, carry, batch, loss_fn, k == len(stages) - 1, rng, needs)
            # (a task whose code draws from them has them rewound with its RNG by a retry: TaskRNG.host_draws)
            at_start, host = host, host_rng.states()
            if cost is not None:
                costs.append(replace(cost, draws_host=True) if host != at_start else cost)
    finally:
        lost = before.inplace()
        before.restore()
        shared.restore()
        if loss_state is not None:  # a loss counting its calls or keeping a history: the plain loop never ran this
            loss_state.restore()
    if lost and stages is cut.stages:
        warnings.warn(f"hydra_tune's cost profile changed tensor attributes of the model in place: {lost} (they "
                      "are not buffers, so it could not copy them). Register them as buffers or assign new tensors "
                      "in forward.", RuntimeWarning, stacklevel=4)
    return costs


class _SharedTensors:
    """The model's parameters' ``.grad`` and its buffers' values, put back after the profile. The scratch copies
    share these tensors, and a copy can still reach the model itself (a ``forward`` replaced by a closure over the
    model, a hook that calls it): a forward run that way, outside the profile's swapped-in copies, would leave
    gradients on the parameters or update buffers in place."""

    def __init__(self, stages: tuple[Stage, ...]) -> None:
        params = {id(p): p for s in stages for p in s.module.parameters()}
        buffers = {id(b): b for s in stages for b in s.module.buffers() if b.device.type != "meta"}  # no values
        self.grads = [(p, p.grad) for p in params.values()]
        self.buffers = [(b, b.detach().clone()) for b in buffers.values()]

    def restore(self) -> None:
        for p, grad in self.grads:
            p.grad = grad
        with torch.no_grad():
            for b, value in self.buffers:
                if b.shape == value.shape and not torch.equal(b, value):
                    b.copy_(value)


def _scratch_stages(stages: tuple[Stage, ...]) -> tuple[Stage, ...]:
    """Deep copies of ``stages`` (one copy: modules shared between stages stay shared) whose parameters and
    buffers are the model's own tensors; the stages themselves, with a warning, when they cannot be copied."""
    memo: dict[int, Any] = {}
    for stage in stages:
        for m in stage.module.modules():
            for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
                memo[id(t)] = t
            for v in m.__dict__.values():  # a weight computed by a hook (weight_norm) is not a graph leaf
                if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter) and not v.is_leaf:
                    memo[id(v)] = v.detach().clone()
    try:
        return tuple(Stage(s.name, m) for s, m in zip(stages, copy.deepcopy([s.module for s in stages], memo)))
    except Exception as exc:  # noqa: BLE001  (any object deepcopy refuses)
        warnings.warn(f"hydra_tune profiles the model's own modules: they cannot be deep-copied "
                      f"({type(exc).__name__}: {exc}); their Python attributes are put back afterwards (tensors "
                      "changed in place and objects nested deeper are not).", RuntimeWarning, stacklevel=4)
        return stages
