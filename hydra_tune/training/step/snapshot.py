"""Step t's hyper-parameters, and step t's update applied to a subset of the parameters by the optimizer itself.

    snap = StepSnapshot.take(optimizer)        # where the plain loop calls optimizer.step(), before scheduler.step()
    scheduler.step()                           # changes lr, momentum, betas: not the snapshot
    step_shard(optimizer, shard_params, snap)  # later: step t's update of shard_params, bit-identical to that part of
                                               # the whole optimizer.step() at step t

Rules: ``step_shard`` runs the optimizer's own ``step`` with ``optimizer.param_groups`` swapped for one call to new
group dicts, each the snapshot's hyper-parameters over the group's parameters that lie in the subset (group order
kept, groups left empty skipped); the user's group dicts are never written, and the swap is undone even on an error.
The per-parameter ``optimizer.state`` (``step`` counters included) is the optimizer's own, so each parameter's
update is exactly the one the whole step computes for it: only optimizers that update every parameter on its own
may be stepped so (allow.py). The groups' parameters must be those of the snapshot (no ``add_param_group`` between).
Tensor hyper-parameters (a tensor lr that a scheduler ``fill_``s in place) are cloned into the snapshot.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import rule_error
from .allow import hook_reason


def _frozen(value: Any) -> Any:
    """``value`` as it is now: tensors cloned (schedulers change a tensor lr in place), tuples and lists walked."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_frozen(v) for v in value)
    return value


@dataclass(frozen=True)
class StepSnapshot:
    """Every param group's hyper-parameters (all keys but ``params``) at one step, and the ids of its parameters.

        snap = StepSnapshot.take(optimizer)
        snap.hparams[0]["lr"], snap.hparams[0]["betas"]
    """

    hparams: tuple[dict[str, Any], ...]
    param_ids: tuple[tuple[int, ...], ...]

    @classmethod
    def take(cls, optimizer: torch.optim.Optimizer) -> StepSnapshot:
        """The hyper-parameters ``optimizer.step()`` would read now (call before ``scheduler.step()``)."""
        hparams = tuple({k: _frozen(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups)
        ids = tuple(tuple(id(p) for p in g["params"]) for g in optimizer.param_groups)
        return cls(hparams, ids)

    def groups_over(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
        """New param-group dicts: this snapshot's hyper-parameters over the parameters of ``params`` in each group
        (group order), empty groups left out. Raises when the optimizer's groups changed since the snapshot or a
        parameter is not the optimizer's."""
        now = tuple(tuple(id(p) for p in g["params"]) for g in optimizer.param_groups)
        if now != self.param_ids:
            raise rule_error("the optimizer's param groups hold the parameters they held at the step's snapshot",
                             "do not add or change param groups while a lazy step is pending (flush() first)",
                             kind=RuntimeError, groups_then=len(self.param_ids), groups_now=len(now))
        wanted = {id(p) for p in params}
        groups = []
        for group, hparams in zip(optimizer.param_groups, self.hparams):
            sub = [p for p in group["params"] if id(p) in wanted]
            if sub:
                groups.append({"params": sub, **hparams})
        found = sum(len(g["params"]) for g in groups)
        if found != len(wanted):
            raise rule_error("every parameter stepped per shard is a parameter of the optimizer",
                             "pass only the optimizer's parameters (and each once)", params=len(params),
                             distinct=len(wanted), in_optimizer=found)
        return groups


def step_shard(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], snap: StepSnapshot, *,
               grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> None:
    """Apply step ``snap``'s update to ``params`` only, through ``optimizer.step()``.

        step_shard(opt, shard_params, snap)                                  # plain step, restricted
        step_shard(opt, shard_params, snap, grad_scale=s, found_inf=f)      # a fused optimizer under a GradScaler

    ``grad_scale``/``found_inf`` are set on the optimizer for the call, as ``GradScaler.step`` sets them for an
    optimizer that unscales inside its fused kernel (``_step_supports_amp_scaling``), and removed after."""
    reason = hook_reason(optimizer)
    if reason is not None:
        raise rule_error("the optimizer has no step hook while it is stepped per shard", "remove the hook, or take "
                         "whole optimizer steps (check_lazy says no for a hooked optimizer)", kind=RuntimeError,
                         hook=reason)
    groups = snap.groups_over(optimizer, params)
    if not groups:
        return
    scaled = grad_scale is not None or found_inf is not None
    if scaled and (hasattr(optimizer, "grad_scale") or hasattr(optimizer, "found_inf")):
        raise rule_error("the optimizer carries no grad_scale/found_inf of its own", "let the GradScaler pass "
                         "them", kind=RuntimeError, grad_scale=getattr(optimizer, "grad_scale", None))
    saved = optimizer.param_groups
    optimizer.param_groups = groups
    if scaled:
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]  # read by fused kernels, as GradScaler sets
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        optimizer.param_groups = saved
        if scaled:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
