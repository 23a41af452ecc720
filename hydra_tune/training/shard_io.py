"""What crosses into and out of a shard's unit (ShardExec's, shard.py): its input carry copied to the device, with
the leaves that collect the input gradients, and its gradients copied back to host memory.

    carry, leaves = ex.grad_inputs(device, store.carries[i], store.needs.get(i))  # a unit's input, on the device
    ex._grads_out(device, store, copies, leaves, mode)     # after its backward: parameter and input gradients out

The rules are shard.py's (its module docstring); profile.py uses ``to_device`` and ``grad_inputs`` too. A resident
shard's parameter gradients stay on the device, in the store's pending gradients; every copy out is issued first
and waited for once.
"""
from __future__ import annotations

from typing import Any

import torch

from ..device.devices import Device
from ..device.dispatch import bookkeeping, paused_accounting, plain_call
from .carry import CarryLeaves
from .store import HostStore
from .trees import map_tensors, tensor_leaves


class ShardInputs:
    """ShardExec's copies in and out (see the module docstring): it reads the shard's ``index``, ``params`` and
    ``resident(device)``."""

    @staticmethod
    def to_device(device: Device, tree: Any, what: str = "activations") -> Any:
        return map_tensors(lambda t: plain_call(device.copier.to_device, t, what), tree)

    @property
    def carry_kind(self) -> str:
        """What the input carry is, for the copy counters: the first shard's is the batch."""
        return "batches" if self.index == 0 else "activations"

    def grad_inputs(self, device: Device, host_carry: Any,
                    needs: tuple[bool, ...] | None = None) -> tuple[Any, CarryLeaves]:
        """Device copy of the input carry whose floating tensors are leaves that collect input gradients: those
        that required one in the plain loop (``needs``, from the shard before's output: ``output_needs``; None:
        every floating one). A carry the plain loop computed from frozen weights alone needs none: autograd
        makes none for it, and kernels that choose by ``requires_grad`` (the attention fast paths) choose the same."""
        carry = self.to_device(device, host_carry, self.carry_kind)
        leaves = CarryLeaves(tensor_leaves(carry))
        if self.index > 0:
            leaves.collect(needs)
        return carry, leaves

    @bookkeeping
    def _grads_out(self, device: Device, store: HostStore, copies: dict[int, torch.Tensor], leaves: list[Any],
                   mode: Any) -> None:
        resident = self.resident(device)
        # Every copy out is issued first and waited for once (one event per shard, not a synchronise per
        # parameter); only then are they read (add_grad sums a shared parameter's contributions in place). A
        # resident shard's gradients stay on the device, in the pending gradients.
        with paused_accounting(mode):
            copier = device.copier
            grads = [(p, g if resident else copier.to_host(g, wait=False, what="state")) for p in self.params
                     if (g := copies[id(p)].grad) is not None]
            if self.index > 0:
                store.out_grads[self.index - 1] = [None if g is None else copier.to_host(g, wait=False)
                                                   for g in leaves.grads]
            if self.index > 0 or (grads and not resident):  # something was copied out
                copier.wait_copies_out()
            for p, g in grads:
                store.add_grad(p, g)
        if self.index:  # the first carry (the prepared batch) stays to the segment's end: a rerun starts from it
            store.carries.pop(self.index, None)
