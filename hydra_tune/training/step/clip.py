"""Global gradient-norm clipping cut into shards: per-shard norms, one total, per-shard scaling.

    norms = shard_norms([p.grad for p in shard_params if p.grad is not None])     # on the shard's device
    total = total_norm(norms_of_all_shards_in_model_parameter_order)               # once all shards have theirs
    coef = clip_coefficient(total, max_norm)
    clip_shard(shard_grads, coef)                                                  # per shard, any time before its step

Together bit-identical to ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type,
error_if_nonfinite, foreach)`` on one device (torch 2.13's arithmetic, read from torch/nn/utils/clip_grad.py):
each gradient's norm by ``torch._foreach_norm`` (or ``linalg.vector_norm`` where foreach is off), the total as
the ``norm_type`` norm of those norms stacked in the order torch stacks them (model-parameter order, grouped by
dtype the way torch groups them), the coefficient as ``max_norm / (total + 1e-6)`` clamped to 1 (the same Python
expression: ``float / tensor`` is ``reciprocal() * float`` in torch, not a division), and every gradient multiplied
by it. The total lives on the device of the first gradient's norm, as torch's on the first gradient's device.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils._foreach_utils import (  # the rule clip_grad_norm_ itself applies: no public equivalent
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)

NONFINITE_MESSAGE = ("The total norm of order {} for gradients from `parameters` is non-finite, so it cannot be "
                     "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                     "`error_if_nonfinite=False`")


def _use_foreach(tensors: list[torch.Tensor], device: torch.device, foreach: bool | None) -> bool:
    if (foreach is None and _has_foreach_support(tensors, device)) or (foreach and _device_has_foreach_support(device)):
        return True
    if foreach:
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return False


@torch.no_grad()
def shard_norms(grads: Sequence[torch.Tensor], norm_type: float = 2.0,
                foreach: bool | None = None) -> list[torch.Tensor]:
    """Each gradient's ``norm_type`` norm, in the order given, computed as ``clip_grad_norm_`` computes it."""
    grads = list(grads)
    if not grads:
        return []
    out: list[torch.Tensor] = [grads[0]] * len(grads)
    grouped = _group_tensors_by_device_and_dtype([grads], with_indices=True)  # type: ignore[list-item]
    for (device, _), ([device_grads], indices) in grouped.items():
        if _use_foreach(device_grads, device, foreach):
            norms = list(torch._foreach_norm(device_grads, float(norm_type)))
        else:
            norms = [torch.linalg.vector_norm(g, float(norm_type)) for g in device_grads]
        for i, n in zip(indices, norms):
            out[i] = n
    return out


def _torch_order(norms: list[torch.Tensor], device: torch.device) -> list[int]:
    """The order in which clip_grad_norm_ stacks the norms of gradients with these dtypes on one device: its
    grouping by (device, dtype), whose group order is torch's own (not first appearance)."""
    if len({n.dtype for n in norms}) == 1:
        return list(range(len(norms)))
    marks = [torch.empty(0, dtype=n.dtype, device=device) for n in norms]
    grouped = _group_tensors_by_device_and_dtype([marks], with_indices=True)  # type: ignore[list-item]
    return [i for _, indices in grouped.values() for i in indices]


@torch.no_grad()
def total_norm(norms: Sequence[torch.Tensor], norm_type: float = 2.0,
               error_if_nonfinite: bool = False) -> torch.Tensor:
    """The total norm from every gradient's norm in model-parameter order (``shard_norms`` of each shard,
    concatenated in that order). ``error_if_nonfinite`` raises torch's own RuntimeError (reads the value)."""
    norms = list(norms)
    norm_type = float(norm_type)
    if not norms:
        return torch.tensor(0.0)
    first_device = norms[0].device
    stacked = torch.stack([norms[i].to(first_device) for i in _torch_order(norms, first_device)])
    total = torch.linalg.vector_norm(stacked, norm_type)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(NONFINITE_MESSAGE.format(norm_type))
    return total


@torch.no_grad()
def clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``clamp(max_norm / (total + 1e-6), max=1)``, written as clip_grad_norm_ writes it."""
    max_norm = float(max_norm)
    clip_coef = max_norm / (total + 1e-6)
    return torch.clamp(clip_coef, max=1.0)


@torch.no_grad()
def clip_shard(grads: Sequence[torch.Tensor], coef: torch.Tensor, foreach: bool | None = None) -> None:
    """Multiply one shard's gradients by the clip coefficient in place (per device, as clip_grad_norm_ does)."""
    grads = list(grads)
    if not grads:
        return
    grouped = _group_tensors_by_device_and_dtype([grads])  # type: ignore[list-item]
    for (device, _), ([device_grads], _) in grouped.items():
        if _use_foreach(device_grads, device, foreach):
            torch._foreach_mul_(device_grads, coef.to(device))
        else:
            on_device = coef.to(device)
            for g in device_grads:
                g.mul_(on_device)
