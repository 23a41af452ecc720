"""fp16 loss scaling cut into shards: per-shard unscale and inf check, one global found-inf, the scaler's update.

    amp = ScalerStep(scaler, optimizer, clipping=True)      # which of GradScaler.step's paths the plain loop takes
    flags = amp.unscale(shard_opt_grads)                    # per shard, once its gradients of step t are final
    found = amp.found(all_flags)                            # 1.0 when any shard overflowed, else 0.0
    grad_scale = amp.grad_scale()                           # before update(): step t's scale, for fused kernels
    amp.update(found)                                       # scaler.update() as the plain loop's, exactly

Reproduces ``scaler.unscale_(opt)`` (when clipping), ``scaler.step(opt)``, ``scaler.update()`` (torch 2.13,
torch/amp/grad_scaler.py): gradients are unscaled in place by ``_amp_foreach_non_finite_check_and_unscale_`` with
``inv_scale = scale.double().reciprocal().float()``, which also raises a per-device found-inf flag; an optimizer that
unscales inside its fused kernel (``_step_supports_amp_scaling``) is only checked (``inv_scale`` 1.0) when nothing
unscaled before, and then gets ``grad_scale = scale * 1``. The flags of all shards combine into one 0/1 found-inf:
a step with an overflow anywhere is skipped for every shard (for a fused optimizer its kernel skips it, as in the
plain loop, where ``optimizer.step()`` still runs). ``update`` hands the scaler that found-inf through its public
``unscale_`` on a one-tensor stand-in optimizer, then calls ``scaler.update()``: the scale and growth tracker move as
in the plain loop, and no per-optimizer state is left behind.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class ScalerStep:
    """One task's GradScaler as per-shard pieces (see the module docstring); ``scaler`` None or disabled: no-op."""

    def __init__(self, scaler: Any, optimizer: torch.optim.Optimizer, clipping: bool) -> None:
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        # GradScaler.step's branch: the optimizer unscales in its own kernel (fused Adam/AdamW/SGD/Adagrad)
        self.fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        # unscale_ runs explicitly before clipping; otherwise step() unscales (or, fused, only checks)
        self.unscales = self.scaler is not None and (clipping or not self.fused)
        self._stand_in: torch.optim.Optimizer | None = None

    @property
    def active(self) -> bool:
        return self.scaler is not None

    def _scale(self) -> torch.Tensor:
        # The scale tensor itself, as GradScaler.step reads it (no public getter without a device sync)
        scale = self.scaler._get_scale_async()
        if scale is None:
            raise RuntimeError("the GradScaler has no scale yet: scale the loss (scaler.scale(loss)) before stepping")
        return scale

    @torch.no_grad()
    def unscale(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Unscale (or only check) one shard's gradients of the optimizer's parameters in place; returns one
        found-inf flag per device (0.0 or 1.0)."""
        if self.scaler is None:
            return []
        scale = self._scale()
        inv = scale.double().reciprocal().float() if self.unscales else torch.full((), 1.0, dtype=torch.float32,
                                                                                  device=scale.device)
        per_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
        for g in grads:
            if g.is_sparse:
                raise RuntimeError("the lazy per-shard step needs dense gradients (check_lazy(model=...) refuses "
                                   "sparse embeddings): use sparse=False or whole optimizer steps")
            if self.unscales and g.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")  # GradScaler.unscale_'s own error
            per_device.setdefault(g.device, {}).setdefault(g.dtype, []).append(g)
        flags = []
        for device, by_dtype in per_device.items():
            found = torch.full((), 0.0, dtype=torch.float32, device=device)
            inv_here = inv.to(device=device, copy=True)
            for same in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(same, found, inv_here)
            flags.append(found)
        return flags

    def found(self, flags: Sequence[torch.Tensor]) -> torch.Tensor:
        """The global found-inf (0.0 or 1.0, on the scale's device) from every shard's flags."""
        if not flags:
            raise AssertionError("No inf checks were recorded for this optimizer.")  # as GradScaler.step
        device = self._scale().device
        return torch.stack([f.to(device) for f in flags]).amax()

    def grad_scale(self) -> torch.Tensor | None:
        """What GradScaler.step hands a fused optimizer as ``grad_scale``: ``scale * 1`` (a copy) when nothing was
        unscaled before, else None. Take it before ``update``, which changes the scale in place."""
        if self.scaler is None or not self.fused or self.unscales:
            return None
        return self._scale() * 1

    def skips(self, found: torch.Tensor) -> bool:
        """Whether the plain loop skips ``optimizer.step()`` (reads ``found``: one sync, as GradScaler.step's)."""
        return self.scaler is not None and not self.fused and bool(found.item())

    @torch.no_grad()
    def update(self, found: torch.Tensor) -> None:
        """``scaler.update()`` as after the plain loop's ``scaler.step(optimizer)`` with this global found-inf."""
        if self.scaler is None:
            return
        if self._stand_in is None:
            self._stand_in = torch.optim.SGD([torch.nn.Parameter(torch.zeros((), device=found.device))], lr=0.0)
        holder = self._stand_in.param_groups[0]["params"][0]
        inf = torch.full((), float("inf"), dtype=torch.float32, device=holder.device)
        holder.grad = torch.where(found.to(holder.device) > 0, inf, torch.zeros_like(inf))
        try:
            self.scaler.unscale_(self._stand_in)  # records found-inf for update(), which combines all recorded
            self.scaler.update()
        finally:
            holder.grad = None
