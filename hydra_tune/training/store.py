"""Host-side state of one task between units: boundary carries, RNG snapshots, gradients in flight.

    store = HostStore()
    store.carries[1] = host_carry            # input of shard 1, written by F0, read by F1 and B1
    store.add_grad(param, g); store.flush_grads()   # param.grad gets what autograd would have given it

Parameters, their ``.grad`` and the optimizer state live in the task's own model and optimizer (in host memory,
or on a device while the task is resident there: resident.py); this store only holds what one minibatch needs
while its units run (its gradients too: on the device for a resident shard), and what its forwards changed
besides (buffers, Python state) as it was before them, so that a retried minibatch starts from there.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten  # torch's own pytree walk: there is no public one

from ..errors import rule_error
from .build import sparse_gradient


def put_buffer(host: torch.Tensor, value: torch.Tensor) -> None:
    """``host`` (a model's buffer, kept as the same tensor) takes ``value``'s values, and its shape where a forward
    changed that (a quantization observer's running min/max, made per channel at its first forward)."""
    if host.shape != value.shape:
        host.resize_(value.shape)
    host.copy_(value)


def tree_bytes(tree: Any) -> int:
    """Bytes the tensors of a pytree occupy once copied to a device (a view counts its own elements, not its
    base's storage; the same tensor twice counts once)."""
    seen: dict[int, int] = {}
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor):
            seen[id(leaf)] = leaf.numel() * leaf.element_size()
    return sum(seen.values())


class HostStore:
    """Everything one in-flight minibatch keeps in host memory between its units."""

    def __init__(self) -> None:
        self.batch: Any = None
        self.carries: dict[int, Any] = {}            # shard index -> its input carry
        self.rng: dict[int, Any] = {}                # shard index -> RNG snapshot taken before its forward
        self.buffers: dict[int, dict[int, torch.Tensor]] = {}   # shard -> buffers as its forward saw them
        self.out_grads: dict[int, list[torch.Tensor | None]] = {}  # shard -> grads of its output leaves
        self.kept: dict[int, Any] = {}               # shard -> residency.Kept: its forward's graph, on its device
        self.loss_scale: torch.Tensor | None = None  # fp16: the task's GradScaler scale for this minibatch
        self.undo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # host buffer -> its value before the batch
        self.states: dict[int, Any] = {}             # shard -> pystate.ModuleState its F unit started from
        self.host_rng: dict[int, Any] = {}           # shard -> Python's and numpy's RNG its F unit drew from
        self.needs: dict[int, tuple[bool, ...]] = {}  # shard -> which input carry tensors require a gradient
        self._state_undo: list[Any] = []             # ModuleStates before the units that changed Python state
        self._lost: list[str] = []                   # tensor attributes changed in place (a retry cannot undo)
        self._pending: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
        self._landed = False                         # the light path's gradients are in .grad (grads_landed)

    def add_grad(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """One shard's gradient contribution for ``param`` in this minibatch (shared params get several)."""
        if grad.layout is not torch.strided:  # (a functional sparse embedding: sparse=True modules are refused)
            raise sparse_gradient(grad, shape=tuple(param.shape))
        key = id(param)
        if key in self._pending:
            self._pending[key][1].add_(grad)
        else:
            self._pending[key] = (param, grad)

    def move_pending(self, move: Callable[[torch.Tensor], torch.Tensor], only: set[int] | None = None) -> None:
        """Replace every gradient in flight (``only``: of the parameters with these ids) by ``move(grad)`` (the
        task's state, or one shard's, moves between host and device)."""
        self._pending = {key: (param, move(grad) if only is None or key in only else grad)
                         for key, (param, grad) in self._pending.items()}

    def has_grads(self) -> bool:
        """Whether gradients of the minibatch are in flight (not yet added into ``.grad``), or went into ``.grad``
        at once (``grads_landed``): either way the task's flush and step are due."""
        return bool(self._pending) or self._landed

    def grads_landed(self) -> None:
        """A unit's gradients went straight into ``.grad`` (the light path, direct.py): until ``flush_grads`` the
        minibatch counts as having gradients in flight (evictions wait for its step, state_cache.py)."""
        self._landed = True

    def flush_grads(self) -> None:
        """Accumulate this minibatch's summed contributions into ``.grad``, as AccumulateGrad does."""
        for param, grad in self._pending.values():
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)
        self._pending.clear()
        self._landed = False

    def note_state(self, before: Any) -> None:
        """``before`` (a pystate.ModuleState) was taken ahead of a unit that changed Python state: a retry puts it
        back."""
        self._state_undo.append(before)
        self._lost += before.inplace()

    def reset_attempt(self) -> None:
        """Forget what a failed attempt at the minibatch left (kept graphs, carries past the first, gradients in
        flight) and put changed host buffers and Python state back; the batch, its prepared input and loss scale
        stay. Raises when a forward changed a tensor attribute in place: the retry would change it twice."""
        if self._lost:
            raise rule_error(
                "a minibatch retried after a device out-of-memory starts from the state it began with, so its "
                "forwards change no tensor attribute in place (its old value is gone)", "register such a tensor "
                "as a buffer (self.register_buffer(name, t): buffers are restored exactly), or assign a new "
                "tensor (self.t = self.t + x) instead of changing it in place", attributes=sorted(set(self._lost)))
        for before in reversed(self._state_undo):  # the earliest snapshot of a module is put back last
            before.restore()
        for host, old in self.undo.values():
            put_buffer(host, old)
        first = self.carries.get(0)
        batch, scale = self.batch, self.loss_scale
        self.clear()
        self.batch, self.loss_scale = batch, scale
        self.carries[0] = first

    def clear(self) -> None:
        self.batch = None
        self._landed = False
        self.undo.clear()
        self.states.clear()
        self.host_rng.clear()
        self._state_undo.clear()
        self._lost.clear()
        self.carries.clear()
        self.rng.clear()
        self.buffers.clear()
        self.out_grads.clear()
        self.kept.clear()  # frees kept device memory of an abandoned minibatch (failure, cancel)
        self._pending.clear()

    def nbytes(self) -> int:
        """Host bytes held for the minibatch in flight (carries, incoming gradients, pending gradients)."""
        return (tree_bytes(list(self.carries.values())) + tree_bytes(list(self.out_grads.values()))
                + sum(g.untyped_storage().nbytes() for _, g in self._pending.values()))
