"""Run one unit of one shard on one device: copy state in, compute, copy results out to host memory.

    ex = ShardExec(index=1, stages=cut.stages[2:4])
    ex.forward(device, store, rng)                       # F: store.carries[1] -> store.carries[2]
    ex.backward(device, store, rng)                      # B: recompute from store.carries[1], backward

Device copies of the shard's parameters and buffers are made for each unit and dropped after it; the host
model's own tensors are never touched by device code. Parameters shared by several stages get one copy per unit.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_map

from ._dispatch import paused_accounting
from .devices import Device, TaskRNG
from .stages import Stage
from .store import HostStore

LossFn = Callable[[Any, Any], torch.Tensor]


def _is_float(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def check_loss(loss: object, where: str) -> torch.Tensor:
    """The loss a unit backpropagates must be a real scalar tensor: say so clearly when it is not."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"the loss is a scalar tensor, but got (loss={type(loss).__name__}) from {where}. Fix: "
                        "return a tensor from `loss(outputs, batch)`, or give the model labels so outputs.loss "
                        "is set.")
    if loss.numel() != 1 or not loss.is_floating_point():
        raise ValueError(f"the loss is a floating-point scalar (numel == 1), but got (shape={tuple(loss.shape)}, "
                         f"dtype={loss.dtype}) from {where}. Fix: reduce it, e.g. `.mean()`.")
    return loss


def model_loss(loss_fn: LossFn | None, outputs: Any, batch: Any) -> torch.Tensor:
    if loss_fn is not None:
        return check_loss(loss_fn(outputs, batch), "the task's `loss`")
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, dict):
        loss = outputs.get("loss")
    if loss is None:
        raise ValueError(f"`loss` is given or the model's outputs carry `.loss`, but got (loss=None, "
                         f"outputs={type(outputs).__name__}). Fix: pass ModelTask(loss=lambda outputs, batch: ...) "
                         "or include labels in the batch.")
    return check_loss(loss, "the model's `outputs.loss`")


class ShardExec:
    """The executable form of one shard: its stages, their distinct parameters and buffers."""

    def __init__(self, index: int, stages: Sequence[Stage]) -> None:
        self.index = index
        self.stages = tuple(stages)
        self.names = tuple(s.name for s in stages)
        tensors: dict[int, torch.Tensor] = {}
        self._bindings: list[list[tuple[str, int]]] = []
        for stage in self.stages:
            named = list(stage.module.named_parameters(remove_duplicate=False))
            named += list(stage.module.named_buffers(remove_duplicate=False))
            self._bindings.append([(name, id(t)) for name, t in named])
            for _, t in named:
                tensors[id(t)] = t
        self.tensors = tensors
        self.params = [t for t in tensors.values() if isinstance(t, nn.Parameter)]
        self.buffers = {k: t for k, t in tensors.items() if not isinstance(t, nn.Parameter)}

    # -- copies ---------------------------------------------------------------------------------------------
    def load(self, device: Device, grad: bool, buffers: dict[int, torch.Tensor] | None = None
              ) -> dict[int, torch.Tensor]:
        copies = {}
        for key, t in self.tensors.items():
            src = buffers.get(key, t) if buffers else t
            c = device.copier.to_device(src)
            if grad and isinstance(t, nn.Parameter) and t.requires_grad:
                c.requires_grad_(True)
            copies[key] = c
        return copies

    def run(self, carry: Any, copies: dict[int, torch.Tensor]) -> Any:
        for stage, binding in zip(self.stages, self._bindings):
            state = {name: copies[key] for name, key in binding}
            carry = functional_call(stage.module, state, (carry,), tie_weights=False, strict=False)
        return carry

    def _write_back_buffers(self, copies: dict[int, torch.Tensor], device: Device, store: HostStore | None,
                            mode: Any) -> None:
        """Buffers the forward changed in place (BatchNorm statistics) go back to the host model."""
        if not self.buffers:
            return
        with paused_accounting(mode):
            # Compare values: kernels that update an argument in place (batch_norm's running stats) do not
            # always bump its version counter.
            back = {k: device.copier.to_host(copies[k]) for k in self.buffers}
            changed = [k for k, t in back.items() if not torch.equal(t, self.buffers[k])]
            if store is not None and changed:
                store.buffers[self.index] = {k: self.buffers[k].clone() for k in changed}
            for k in changed:
                self.buffers[k].copy_(back[k])

    # -- units ----------------------------------------------------------------------------------------------
    def forward(self, device: Device, store: HostStore, rng: TaskRNG, train: bool = True) -> None:
        """F: no autograd; the output carry becomes the next shard's input in host memory."""
        if train:
            store.rng[self.index] = rng.snapshot()
        with device.unit_scope(rng) as mode, torch.no_grad():
            copies = self.load(device, grad=False)
            carry = self.to_device(device, store.carries[self.index])
            out = self.run(carry, copies)
            if train:
                self._write_back_buffers(copies, device, store, mode)
            with paused_accounting(mode):
                store.carries[self.index + 1] = tree_map(
                    lambda t: device.copier.to_host(t) if isinstance(t, torch.Tensor) else t, out)
            del copies, carry, out

    def evaluate(self, device: Device, store: HostStore, rng: TaskRNG, loss_fn: LossFn | None) -> float:
        """The last shard in eval: forward and loss, no autograd; returns the loss value."""
        with device.unit_scope(rng), torch.no_grad():
            copies = self.load(device, grad=False)
            carry = self.to_device(device, store.carries[self.index])
            out = self.run(carry, copies)
            return float(model_loss(loss_fn, out, self.to_device(device, store.batch)).item())

    def last(self, device: Device, store: HostStore, rng: TaskRNG, loss_fn: LossFn | None, scale: int) -> float:
        """L: the last shard's forward + loss + backward, run once; returns the unscaled loss."""
        with device.unit_scope(rng) as mode:
            copies = self.load(device, grad=True)
            carry, leaves = self.grad_inputs(device, store.carries[self.index])
            out = self.run(carry, copies)
            loss = model_loss(loss_fn, out, self.to_device(device, store.batch))
            (loss / scale if scale != 1 else loss).backward()
            self._write_back_buffers(copies, device, None, mode)
            self._grads_out(device, store, copies, leaves, mode)
            return float(loss.detach().item())

    def backward(self, device: Device, store: HostStore, rng: TaskRNG) -> None:
        """B: recompute the forward from the saved input with the saved RNG state, then backward."""
        replay = rng.fork()
        replay.restore(store.rng.pop(self.index))
        with device.unit_scope(replay) as mode:
            copies = self.load(device, grad=True, buffers=store.buffers.pop(self.index, None))
            carry, leaves = self.grad_inputs(device, store.carries[self.index])
            out = self.run(carry, copies)
            grads = store.out_grads.pop(self.index)
            pairs = [(o, g) for o, g in zip(tree_flatten(out)[0], grads)
                     if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
            if pairs:
                g_dev = [device.copier.to_device(g) for _, g in pairs]
                torch.autograd.backward([o for o, _ in pairs], g_dev)
            self._grads_out(device, store, copies, leaves, mode)

    # -- copies and inputs (also used by profile.py) -----------------------------------------------------
    @staticmethod
    def to_device(device: Device, tree: Any) -> Any:
        return tree_map(lambda t: device.copier.to_device(t) if isinstance(t, torch.Tensor) else t, tree)

    def grad_inputs(self, device: Device, host_carry: Any) -> tuple[Any, list[Any]]:
        """Device copy of the input carry whose floating tensors are leaves that collect input gradients."""
        carry = self.to_device(device, host_carry)
        leaves = tree_flatten(carry)[0]
        if self.index > 0:
            for t in leaves:
                if _is_float(t):
                    t.requires_grad_(True)
        return carry, leaves

    def _grads_out(self, device: Device, store: HostStore, copies: dict[int, torch.Tensor], leaves: list[Any],
                   mode: Any) -> None:
        with paused_accounting(mode):
            for p in self.params:
                g = copies[id(p)].grad
                if g is not None:
                    store.add_grad(p, device.copier.to_host(g))
            if self.index > 0:
                store.out_grads[self.index - 1] = [
                    device.copier.to_host(t.grad) if _is_float(t) and t.grad is not None else None for t in leaves]
        store.carries.pop(self.index, None)
