"""Run one unit of one shard on one device: copy state in, compute, copy results out to host memory.

    ex = ShardExec(index=1, stages=cut.stages[2:4])
    ex.forward(device, store, rng)                       # F: store.carries[1] -> store.carries[2]
    ex.backward(device, store, rng)                      # B: recompute from store.carries[1], backward
    last.forward_loss_backward(device, store, rng, loss_fn, scale=1)   # L: the last shard, returns the loss

Device copies of the shard's parameters and buffers live in the device's ShardCache (residency.py: made ahead by
the copy thread, or left by the previous unit) and are used only while the host tensors are unchanged; the host
model's own tensors are never touched by device code. Parameters shared by several stages get one copy per
shard. While the task's state is resident on the device (resident.py), the parameters' device tensors are used
themselves (a unit's leaves are new leaves over their storage) and their gradients stay there, in the store's
pending gradients; only buffers are copied. A kept forward (``keep=True``) leaves its graph on the device so its
backward needs no recompute; an offloading one (``offload=True``) sends its saved activations to host memory
until its backward.

Rules for what a forward changes besides its output, so that each change happens once per forward as in the plain
loop: buffers changed in place (BatchNorm's statistics) or assigned a new tensor (``self.ema = 0.9 * self.ema +
...``) are written back to the host model after every forward unit (F, L, E), the values they had before kept
for a recomputing B unit and for a retry (``HostStore.reset_attempt``); an assigned buffer keeps its shape and
dtype. Python state (pystate.py: attributes, hook closures) is taken before every unit: a recomputing B unit
replays its forward from the state the F unit saw, must change the same attributes, and puts back the state after
F; a retry undoes it; tensors a unit binds to attributes move to host memory. Refused (an error naming the
attributes): a recomputed forward that changes a tensor attribute in place, or whose state updates depend on
autograd being on.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten  # torch's own pytree walk: there is no public one

from ..device.devices import Device
from ..device.dispatch import bookkeeping, paused_accounting, plain_call
from ..device.fastpath import fast_path_modules, native_scope
from ..device.rng import TaskRNG
from ..errors import rule_error
from ..stages import Stage
from . import host_rng
from .bind import Bound
from .carry import output_needs
from .direct import DirectPath, backward_outputs
from .loss import LossFn, model_loss
from .names import shared_name
from .pystate_inert import inert_modules
from .pystate_layout import Snapshots
from .residency import Kept, ShardCache, offloading
from .shard_io import ShardInputs
from .shard_state import ShardPythonState
from .store import HostStore, put_buffer
from .trees import map_tensors


_NULL = contextlib.nullcontext()  # (reusable: one object, not one per unit)


class ShardExec(ShardPythonState, ShardInputs):
    """The executable form of one shard: its stages, their distinct parameters and buffers."""

    def __init__(self, index: int, stages: Sequence[Stage], autocast: torch.dtype | None = None,
                 home: Any = None) -> None:
        self.index = index
        self.home = home  # the task's StateHome (resident.py): where its state is; None: always host memory
        self.stages = tuple(stages)
        self.autocast = autocast  # bf16/fp16 mixed precision: forwards (and the loss) run under torch.autocast
        self.names = tuple(s.name for s in stages)
        tensors: dict[int, torch.Tensor] = {}
        keys: dict[int, int] = {}  # one int object per tensor's id, which the records below share (they stay)
        self._bound: list[Bound] = []
        for stage in self.stages:
            named = list(stage.module.named_parameters(remove_duplicate=False))
            named += list(stage.module.named_buffers(remove_duplicate=False))
            binding = []
            for name, t in named:
                key = keys.setdefault(id(t), id(t))
                binding.append((shared_name(name), key))
                tensors[key] = t
            self._bound.append(Bound(stage.module, binding))
        self.tensors = tensors
        self.params = [t for t in tensors.values() if isinstance(t, nn.Parameter)]
        # frozen parameters are no part of a resident task's state (no gradient, no optimizer state): they are
        # copied in like buffers, from the runtime's shared pool when pooled (shared_frozen.py)
        self.frozen = {k: t for k, t in tensors.items() if isinstance(t, nn.Parameter) and not t.requires_grad}
        self.pool: Any = None                  # the runtime's SharedFrozen, for the keys in ``pooled``
        self.pooled: Any = set()  # (a set of ids, or the frozen dict's keys)
        self.buffers = {k: t for k, t in tensors.items() if not isinstance(t, nn.Parameter)}
        self.modules = list({id(m): m for s in self.stages for m in s.module.modules()}.values())
        self.fast = tuple(fast_path_modules(s.module) for s in self.stages)  # each stage's (fastpath.py)
        self._inert = inert_modules(self.modules)
        self._snapshots = Snapshots(self.modules)  # their Python state before a unit (when not all inert)
        self.plain_tensors = all(type(t) in (torch.Tensor, nn.Parameter) for t in tensors.values())
        self.direct = DirectPath(self)  # the light path of a resident only shard (direct.py)
        # B units through their forward's kept (or offloaded) graph: no recompute; of them, with no refill either
        self.kept_backwards = self.loaded_backwards = 0

    # -- copies ---------------------------------------------------------------------------------------------
    def resident(self, device: Device) -> bool:
        """Whether the shard's parameters, gradients and optimizer state are on ``device`` (resident.py)."""
        return self.home is not None and self.home.where(self.index) is device

    def use_pool(self, pool: Any, keys: set[int]) -> None:
        """Copy the parameters with these ids in from ``pool`` (a SharedFrozen: one device copy for all tasks)."""
        # (all of them, the common case: the frozen dict's keys, not a second table of the same ids)
        frozen = self.frozen.keys()
        self.pool, self.pooled = pool, frozen if frozen <= keys else {k for k in keys if k in self.frozen}

    def moving(self, device: Device) -> dict[int, torch.Tensor]:
        """What a unit on ``device`` copies in: the parameters and buffers; when resident, the buffers and the
        frozen parameters."""
        return {**self.buffers, **self.frozen} if self.resident(device) else self.tensors

    def versions(self, device: Device) -> tuple[tuple[int, int], ...]:
        """Identity and version of every host tensor a unit on ``device`` copies in: a device copy made at equal
        versions is still exact."""
        # ``_version`` is torch's in-place counter of a tensor: there is no public accessor
        return tuple((t.data_ptr(), t._version) for t in self.moving(device).values())

    def copy_in(self, device: Device) -> dict[int, torch.Tensor]:
        """Fresh device copies of what a unit copies in (``moving``), no autograd flags."""
        out = {}
        for key, t in self.moving(device).items():
            shared = self.pool.device_copy(t, device) if key in self.pooled else None
            out[key] = shared if shared is not None else \
                device.copier.to_device(t, "buffers" if key in self.buffers else "state")
        return out

    @bookkeeping
    def load(self, device: Device, grad: bool, buffers: dict[int, torch.Tensor] | None = None,
             cache: bool = True) -> dict[int, torch.Tensor]:
        """The shard's state on ``device``: the resident copies when they are still exact, else fresh copies
        (left resident for the next unit of this shard); a resident shard's parameters are their device tensors
        themselves. With ``grad``, trainable parameters are new leaves over the same storage, so their ``.grad``
        starts empty."""
        cached: ShardCache | None = device.resident if cache and not buffers else None
        if buffers and device.resident is not None:
            # (a recompute from the buffers before its forward: the copy that forward left is stale, and held beside
            # the fresh one it would be a second copy of the shard, which the plan does not count)
            device.resident.drop(self)
        copies = cached.take(self, device) if cached is not None else None
        if copies is None:
            copies = self.copy_in(device)
            if buffers:
                for key, value in buffers.items():
                    copies[key] = device.copier.to_device(value, "buffers")
            elif cached is not None:
                cached.put(self, device, dict(copies))  # ``run`` rebinds buffers a forward assigns in ``copies``
        if self.resident(device):  # the trainable ones as planned: one frozen for a while (peft's
            # disable_adapter()) is still the state's, on the device; ``grad`` below follows its flag now
            copies.update({id(p): p.detach() for p in self.params if id(p) not in self.frozen})
        if grad:
            copies = {key: c.detach().requires_grad_(True)
                      if isinstance(self.tensors[key], nn.Parameter) and self.tensors[key].requires_grad else c
                      for key, c in copies.items()}
        return copies

    def precision(self, device: Device) -> Any:
        """The autocast region a forward (and its loss) runs in, as in the plain mixed-precision loop."""
        if self.autocast is None:
            return _NULL
        return torch.autocast(device.torch_device.type, dtype=self.autocast)

    def run(self, carry: Any, copies: dict[int, torch.Tensor], device: Device) -> Any:
        """The shard's forward over ``copies`` (bind.py); a buffer the forward assigns a new tensor replaces its
        copy in ``copies``, for the next stage and the write-back."""
        with self.precision(device):
            for stage, bound, fast in zip(self.stages, self._bound, self.fast):
                # a quiet unit routes the stages that draw (quiet.py); torch's fast paths see no mode of ours
                with device.stage_scope(stage.name), native_scope(fast, device, stage.name):
                    carry, after = bound.call(carry, copies)
                for name, key in bound.binding:  # (two names of one slot: the first replaces, the second is it)
                    if after[name] is not copies[key]:
                        copies[key] = self._assigned(stage.name, name, self.tensors[key], after[name])
        return carry

    @staticmethod
    def _assigned(stage: str, name: str, host: torch.Tensor, new: Any) -> torch.Tensor:
        """A buffer's new tensor, checked: written back in place, it must have the buffer's shape and dtype."""
        if isinstance(new, torch.Tensor) and new.shape == host.shape and new.dtype == host.dtype:
            return new
        got = f"{type(new).__name__}" if not isinstance(new, torch.Tensor) else f"{new.dtype} {tuple(new.shape)}"
        raise rule_error("a buffer that forward assigns a new tensor keeps its shape and dtype (hydra_tune writes "
                         "it back into the model's own buffer)", "assign a tensor of the buffer's shape and dtype "
                         "(cast with .to(buffer.dtype)), or keep such state in a plain attribute (not a buffer)",
                         buffer=name, stage=stage, was=f"{host.dtype} {tuple(host.shape)}", assigned=got)

    def loss(self, device: Device, loss_fn: LossFn | None, out: Any, batch: Any) -> torch.Tensor:
        with self.precision(device):
            return model_loss(loss_fn, out, self.to_device(device, batch, "batches"))

    def _write_back_buffers(self, copies: dict[int, torch.Tensor], device: Device, store: HostStore,
                            mode: Any, recompute: bool = False) -> None:
        """Buffers the forward changed (in place, like BatchNorm's statistics, or assigned a new tensor) go back
        into the host model's own buffers; their values before the minibatch stay in ``store.undo`` (a retried
        segment starts from them), and with ``recompute`` the values this forward saw stay for its B unit's
        recompute."""
        if not self.buffers:
            return
        with paused_accounting(mode):
            # Compare values: kernels that update an argument in place (batch_norm's running stats) do not
            # always bump its version counter.
            back = {k: device.copier.to_host(copies[k], what="buffers") for k in self.buffers}
            changed = [k for k, t in back.items() if not torch.equal(t, self.buffers[k])]
            if recompute and changed:
                store.buffers[self.index] = {k: self.buffers[k].clone() for k in changed}
            for k in changed:
                if k not in store.undo:
                    store.undo[k] = (self.buffers[k], store.buffers[self.index][k] if recompute else
                                     self.buffers[k].clone())
            for k in changed:
                put_buffer(self.buffers[k], back[k])

    # -- units ----------------------------------------------------------------------------------------------
    def forward(self, device: Device, store: HostStore, rng: TaskRNG, train: bool = True, keep: bool = False,
                offload: bool = False, droppable: bool = False, light: bool = False) -> None:
        """F: the output carry becomes the next shard's input in host memory. Plain: its graph is let go at the
        unit's end (B recomputes).
        ``keep``: the graph stays on the device, parameter bytes released until B refills them; ``droppable``:
        what a recompute needs is saved too, so the graph may be dropped before B, and its parameter bytes stay
        until another task runs there (residency.Kept ``loaded``: B, next, needs no refill). ``offload``:
        as ``keep``, but the saved activations are moved to host memory as they are made (B brings them back).
        ``train=False``: an eval forward (E). ``light``: the task's only shard, whose output is the model's: a
        prepared loop's droppable F or its E takes the light path when it applies (direct.py)."""
        if train:
            store.rng[self.index] = rng.snapshot()
        with self.python_state(device, store, replay=train and (droppable or not (keep or offload))):
            if light and (droppable or not train) and self.direct.applies(device, train=False):
                self.direct.forward(device, store, rng, keep=train)
                return
            if keep or offload:
                self._forward_keep(device, store, rng, offload, droppable)
                return
            # a training forward runs with autograd, as in the plain loop: some kernels compute otherwise without
            # it (the CPU's LSTM; CUDA's attention backends); its graph goes at the unit's end (B recomputes)
            with device.unit_scope(rng) as mode, _NULL if train else torch.no_grad():
                copies = self.load(device, grad=train)
                if train:
                    carry, _ = self.grad_inputs(device, store.carries[self.index], store.needs.get(self.index))
                else:
                    carry = self.to_device(device, store.carries[self.index], self.carry_kind)
                out = self.run(carry, copies, device)
                if train:
                    store.needs[self.index + 1] = output_needs(out)
                self._write_back_buffers(copies, device, store, mode, recompute=train)
                with paused_accounting(mode):
                    store.carries[self.index + 1] = map_tensors(device.copier.to_host, out)
                del copies, carry, out

    def _forward_keep(self, device: Device, store: HostStore, rng: TaskRNG, offload: bool,
                      droppable: bool = False) -> None:
        with device.unit_scope(rng) as mode:
            copies = self.load(device, grad=True)
            resident = self.resident(device)
            if device.resident is not None:
                device.resident.drop(self)  # their storage is released below: no longer a valid resident copy
            carry, leaves = self.grad_inputs(device, store.carries[self.index], store.needs.get(self.index))
            if offload:
                with offloading(device, copies, mode) as hooks:
                    out = self.run(carry, copies, device)
            else:
                out = self.run(carry, copies, device)
            self._write_back_buffers(copies, device, store, mode, recompute=droppable)
            store.needs[self.index + 1] = output_needs(out)
            with paused_accounting(mode):
                store.carries[self.index + 1] = map_tensors(lambda t: device.copier.to_host(t.detach()), out)
            # a resident shard's parameter bytes are its state: they stay; a pooled copy is other tasks' too
            own = [] if resident else [copies[id(p)] for p in self.params if id(p) not in self.pooled]
            if not droppable:  # (a droppable graph's copies stay filled for its backward: Kept ``loaded``)
                for t in own:
                    device.copier.release(t)
            if offload:
                # Every activation the backward reads is on the host now (but those the hooks left in place, e.g.
                # tiny ones): the output and input tensors are only the graph's ends, so their bytes go too.
                for t in {id(t): t for t in tree_flatten(out)[0] + leaves if isinstance(t, torch.Tensor)
                          and t.untyped_storage().nbytes() > 0 and not hooks.references(t)}.values():
                    device.copier.release(t)
        store.kept[self.index] = Kept(out, leaves, copies, filled=resident or droppable, device=device,
                                      droppable=droppable, loaded=own if droppable else [])

    def refill(self, device: Device, kept: Kept) -> int:
        """Give a kept forward's released parameter copies their values back (the prefetch of a kept B); returns
        the bytes copied."""
        if kept.filled:
            return 0
        with device.refill_scope(), device.copier.deferred():
            for p in self.params:
                if id(p) not in self.pooled:
                    device.copier.refill(kept.copies[id(p)], p)
            device.copier.finish_copies()
        kept.filled = True
        return sum(p.numel() * p.element_size() for p in self.params)

    def evaluate(self, device: Device, store: HostStore, rng: TaskRNG, loss_fn: LossFn | None,
                 measure: Callable[[Any, Any], None] | None = None) -> float:
        """The last shard in eval: forward and loss, no autograd; returns the loss value. ``measure(outputs,
        batch)`` (the task's metrics, training/metrics.py) then runs here, on the device's outputs and batch. The
        only shard of a task takes the light path when it applies (direct.py)."""
        if self.direct.applies(device, train=False):
            return self.direct.evaluate(device, store, rng, loss_fn, measure)
        with self.python_state(device, store), device.unit_scope(rng) as mode, torch.no_grad():
            copies = self.load(device, grad=False)
            carry = self.to_device(device, store.carries[self.index], self.carry_kind)
            out = self.run(carry, copies, device)
            self._write_back_buffers(copies, device, store, mode)
            batch = self.to_device(device, store.batch, "batches")
            return self.eval_value(device, loss_fn, out, batch, measure)

    def eval_value(self, device: Device, loss_fn: LossFn | None, out: Any, batch: Any,
                   measure: Callable[[Any, Any], None] | None) -> float:
        """An eval unit's end, inside it: the loss's value, then ``measure(outputs, batch)`` on the device."""
        with self.precision(device):
            loss = model_loss(loss_fn, out, batch)
        value = plain_call(device.copier.read, loss)
        if measure is not None:
            measure(out, batch)
        return value

    def forward_loss_backward(self, device: Device, store: HostStore, rng: TaskRNG, loss_fn: LossFn | None,
                              scale: int) -> float:
        """L: the last shard's forward + loss + backward, run once; returns the unscaled loss."""
        if self.direct.applies(device):  # the only shard of a task, when the light path applies (direct.py)
            return self.direct.forward_loss_backward(device, store, rng, loss_fn, scale)
        with self.python_state(device, store), device.unit_scope(rng) as mode:
            copies = self.load(device, grad=True)
            carry, leaves = self.grad_inputs(device, store.carries[self.index], store.needs.get(self.index))
            out = self.run(carry, copies, device)
            loss = self.loss(device, loss_fn, out, store.batch)
            del out  # e.g. the logits: free them before the backward, as the profile measured it
            scaled = loss / scale if scale != 1 else loss
            if store.loss_scale is not None:  # fp16: GradScaler.scale(), the same multiply
                scaled = scaled * store.loss_scale.to(device=scaled.device, non_blocking=True)
            scaled.backward()
            self._write_back_buffers(copies, device, store, mode)
            self._grads_out(device, store, copies, leaves, mode)
            return plain_call(device.copier.read, loss)

    def backward(self, device: Device, store: HostStore, rng: TaskRNG) -> None:
        """B: backward through the kept graph, or recompute the forward from the saved input with the saved RNG
        state, buffers and Python state (as its F unit ran it), then backward."""
        kept = store.kept.pop(self.index, None)
        if kept is not None and kept.droppable and kept.device is not device:
            kept = None  # its graph is on another device: dropped, recomputed here (its F saved what that needs)
        if kept is not None and kept.direct and not self.direct.applies(device):
            kept = None  # over the model's own parameters, but gradients are there already or the state moved
        snap = store.rng.pop(self.index)
        with self.python_state(device, store):  # backward hooks may keep state too
            if kept is not None:
                self.kept_backwards += 1
                self.loaded_backwards += bool(kept.loaded)  # its parameter copies still in (residency.Kept)
                store.buffers.pop(self.index, None)  # (a droppable one's recompute inputs: not needed now)
                store.states.pop(self.index, None)
                if kept.direct:
                    self.direct.backward(device, store, rng, kept.out)
                    return
                with device.unit_scope(rng) as mode:
                    self.refill(device, kept)
                    self._backward_from(device, store, kept.out, kept.copies, kept.leaves, mode)
                return
            replay = rng.fork()
            replay.restore(snap)
            with device.unit_scope(replay) as mode:
                copies = self.load(device, grad=True, buffers=store.buffers.pop(self.index, None))
                carry, leaves = self.grad_inputs(device, store.carries[self.index], store.needs.get(self.index))
                with self._replaying(store.states.pop(self.index, None)), \
                        host_rng.replay(store.host_rng.pop(self.index, None)):
                    out = self.run(carry, copies, device)
                self._backward_from(device, store, out, copies, leaves, mode)

    def _backward_from(self, device: Device, store: HostStore, out: Any, copies: dict[int, torch.Tensor],
                       leaves: list[Any], mode: Any) -> None:
        backward_outputs(device, out, store.out_grads.pop(self.index))
        self._grads_out(device, store, copies, leaves, mode)

    def prefetch(self, device: Device, store: HostStore, kind: str) -> int:
        """Prepare this shard on ``device`` ahead of its ``kind`` unit (run by the device's copy thread); returns
        the bytes copied (0 when it was already resident, or its state is on another device: the segment's start
        brings it back first, and a copy made now would read the other device's tensors)."""
        kept = store.kept.get(self.index) if kind == "B" else None
        if kept is not None and (kept.device is device or not kept.droppable):
            return self.refill(device, kept)
        # not while an update it reads is pending, its entry moves in at its unit, or its state is elsewhere
        blocked = self.home is not None and not self.home.prefetchable(self.index, device)
        if device.resident is not None and not blocked and not (kind == "B" and self.index in store.buffers):
            return device.resident.prefetch(self, device)
        return 0
