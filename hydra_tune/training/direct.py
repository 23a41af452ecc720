"""The light path of a task cut into one shard whose state is resident on the device: its L and E units run the
stages over the model's own parameters, and gradients accumulate into ``.grad`` as in the plain loop.

    path = DirectPath(ex)                              # ShardExec makes one for itself, and its L and E units
    if path.applies(device):                           # ask it first, every time
        value = path.forward_loss_backward(device, store, rng, loss_fn, scale)
    path.forward(device, store, rng, keep=True)        # a prepared loop's F: the graph kept for its B
    path.backward(device, store, rng, kept.out)        # its B, when ``applies(device)`` holds then too

Why: while a shard's state is resident, its parameters' device tensors are the model's own; the general path
still binds new leaves over them into every stage (``Bound``), collects each leaf's gradient into the store and
adds it into ``.grad`` after the segment. For a small model that bookkeeping is a sizeable part of a unit, and the
devices pay it under one GIL. Here the stages run as the plain loop runs them: the same parameters and ops, so the
same values. The batch is copied to the device once per unit, for the forward and the loss alike, as the plain
loop's forward and loss read one ``x`` (the general path copies it for each).

Rules (what keeps it exact; otherwise the general path runs): the shard is the task's only one (no carry in or
out), resident on this device, fp32 (mixed precision runs its forwards under autocast on the general path), with
no buffers and no frozen parameters (nothing to copy in) and plain tensors only; no trainable parameter holds a
gradient yet (the first minibatch of a step), so a unit that fails half way (out of memory, the rerun of an
unrouted draw) is undone by setting them back to None, as the general path adds nothing then; the segment is not
one the device measures op by op. A forward that replaces a parameter slot (``self.weight = ...``) is refused (the
model's own parameter would not train); parameters with gradient hooks are refused at submit (training/build.py).

A prepared loop (prepare/driver.py) calls the forward and the backward separately: its F unit keeps the graph
over the model's own parameters (``forward``, ``Kept.direct``), saving what a recompute needs as the general
path's droppable F does, and its B unit backpropagates through it into ``.grad`` (``backward``) when the rules
above hold then (the shard still resident there, no gradient yet: the loop zeroed them since the last step).
Otherwise (gradients accumulated over minibatches, the state moved, the graph dropped for room) B recomputes on
the general path from what F saved: exact either way.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Any

import torch

from ..device.devices import Device
from ..device.dispatch import paused_accounting, plain_call
from ..device.fastpath import native_scope
from ..device.rng import TaskRNG
from ..errors import rule_error
from .loss import LossFn, model_loss
from .residency import Kept
from .store import HostStore
from .trees import map_tensors, tensor_leaves

if TYPE_CHECKING:
    from .shard import ShardExec


_NULL = contextlib.nullcontext()


def backward_outputs(device: Device, out: Any, grads: list[Any]) -> None:
    """Backpropagate the host gradients ``grads`` (None: that output is unused) from the outputs ``out`` on
    ``device``: the B unit's backward, here and on the general path (shard.py)."""
    pairs = [(o, g) for o, g in zip(tensor_leaves(out), grads)
             if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [plain_call(device.copier.to_device, g) for _, g in pairs])


class DirectPath:
    """The light path of one ShardExec (see the module docstring)."""

    def __init__(self, ex: ShardExec) -> None:
        # held weakly: the ShardExec holds this path, and a cycle between them would keep an ended task's model
        # (its stages) alive until Python's collector runs
        self._ex = weakref.ref(ex)
        self.units = 0  # units that took this path (stats()["tasks"][name]["light_units"])
        # L and E units run on the last shard: the first being the last, it is the only one. (Mixed precision takes
        # the general path: its forwards run under autocast there.)
        self._eligible = (ex.index == 0 and ex.plain_tensors and not ex.buffers and not ex.frozen
                          and ex.autocast is None)
        # (owner's parameter dict, attribute, parameter) for every slot: a forward must leave each as it found it.
        # Only a path that may run keeps them (a LoRA shard never does: its frozen base is copied in)
        self._slots = [(owner._parameters, attr, p) for stage in ex.stages
                       for owner in stage.module.modules() for attr, p in owner._parameters.items()
                       if p is not None] if self._eligible else []
        self._trainable = [p for p in ex.params if p.requires_grad] if self._eligible else []

    @property
    def ex(self) -> ShardExec:
        ex = self._ex()
        if ex is None:  # (its ShardExec holds it: a bug of ours if this is ever reached)
            raise RuntimeError("hydra_tune: a light path outlived its shard; please report this as a bug")
        return ex

    def applies(self, device: Device, train: bool = True) -> bool:
        """Whether this L (``train``) or E unit on ``device`` takes the light path; an L unit's trainable parameters
        must hold no gradient yet."""
        if not self._eligible or device.measuring or not self.ex.resident(device):
            return False
        if train:
            for p in self._trainable:
                if p.grad is not None:
                    return False
        return True

    def forward_loss_backward(self, device: Device, store: HostStore, rng: TaskRNG, loss_fn: LossFn | None,
                              scale: int) -> float:
        """L: forward, loss and backward over the model's own parameters; returns the unscaled loss."""
        ex = self.ex
        self.units += 1
        try:
            with ex.python_state(device, store), device.unit_scope(rng):
                carry, batch = self._inputs(device, store)
                out = self._run(ex, device, carry)
                with ex.precision(device):
                    loss = model_loss(loss_fn, out, batch)
                del out, carry, batch
                scaled = loss / scale if scale != 1 else loss
                if store.loss_scale is not None:  # fp16: GradScaler.scale(), the same multiply
                    scaled = scaled * store.loss_scale.to(device=scaled.device, non_blocking=True)
                scaled.backward()
                value = plain_call(device.copier.read, loss)
        except BaseException:
            for p in self._trainable:  # an attempt that failed adds nothing (the general path's rule)
                p.grad = None
            raise
        store.grads_landed()  # its flush and step are due: evictions wait for them (state_cache.py)
        return value

    def undo(self) -> None:
        """Forget the gradients an L unit of this path gave (a light run that gives its minibatch back,
        light_run.py): the trainable parameters' ``.grad`` back to None, as before it."""
        for p in self._trainable:
            p.grad = None

    def forward(self, device: Device, store: HostStore, rng: TaskRNG, keep: bool) -> None:
        """A prepared loop's F (``keep``: the graph stays on the device for B) or E (no autograd) of the only shard
        (``applies(device, train=False)``; for F the caller took the RNG and Python state a recompute needs): the
        output to host memory."""
        ex = self.ex
        self.units += 1
        with device.unit_scope(rng) as mode, _NULL if keep else torch.no_grad():  # (units run with grad mode on)
            carry = ex.to_device(device, store.carries[0], "batches")
            out = self._run(ex, device, carry)
            with paused_accounting(mode):
                store.carries[1] = map_tensors(lambda t: device.copier.to_host(t.detach()), out)
        if keep:
            store.kept[0] = Kept(out, [], {}, filled=True, device=device, droppable=True, direct=True)

    def backward(self, device: Device, store: HostStore, rng: TaskRNG, out: Any) -> None:
        """B through a graph ``forward`` kept (``applies(device)`` holds): the output's gradients into the
        parameters' ``.grad``, which were None."""
        ex = self.ex
        self.units += 1
        grads = store.out_grads.pop(ex.index)
        try:
            with device.unit_scope(rng):
                backward_outputs(device, out, grads)
        except BaseException:
            for p in self._trainable:  # an attempt that failed adds nothing (its retry runs the forward again)
                p.grad = None
            raise
        store.grads_landed()

    def evaluate(self, device: Device, store: HostStore, rng: TaskRNG, loss_fn: LossFn | None,
                 measure: Any = None) -> float:
        """E of the only shard: forward and loss without autograd; ``measure(outputs, batch)`` as ShardExec's."""
        ex = self.ex
        self.units += 1
        with ex.python_state(device, store), device.unit_scope(rng), torch.no_grad():
            carry, batch = self._inputs(device, store)
            return ex.eval_value(device, loss_fn, self._run(ex, device, carry), batch, measure)

    @staticmethod
    def _inputs(device: Device, store: HostStore) -> tuple[Any, Any]:
        """Device copies of the input carry and of the batch the loss reads, each host tensor copied once (the
        carry holds the batch's own tensors: the plain loop's forward and loss read the same ``x``)."""
        memo: dict[int, torch.Tensor] = {}

        def copy(t: torch.Tensor) -> torch.Tensor:
            out = memo.get(id(t))
            if out is None:
                out = memo[id(t)] = plain_call(device.copier.to_device, t, "batches")
            return out
        return map_tensors(copy, store.carries[0]), map_tensors(copy, store.batch)

    def _run(self, ex: ShardExec, device: Device, carry: Any) -> Any:
        """The stages in order on ``carry``, each in its stage scope (quiet units route the stages that draw)."""
        scoped = device.scoped_stages()  # most stages: nothing to enter (a quiet unit routes those that draw)
        try:
            for stage, fast in zip(ex.stages, ex.fast):
                if fast:  # torch's inference fast paths see no function mode of ours (fastpath.py)
                    with device.stage_scope(stage.name), native_scope(fast, device, stage.name):
                        carry = stage.module(carry)
                elif scoped is not None and stage.name not in scoped:
                    carry = stage.module(carry)
                else:
                    with device.stage_scope(stage.name):
                        carry = stage.module(carry)
        finally:
            replaced = [attr for slots, attr, p in self._slots if slots.get(attr) is not p]
            if replaced:
                for slots, attr, p in self._slots:
                    slots[attr] = p
        if replaced:
            raise rule_error("a forward leaves its module's parameters in their slots (hydra_tune trains the "
                             "model's own parameters)", "compute with a local tensor (w = self.weight * s) instead "
                             "of assigning a new one to a parameter's attribute", replaced=replaced,
                             shard=list(ex.names))
        return carry

