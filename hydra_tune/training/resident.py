"""A task's state kept on a device: its parameters, their gradients and its optimizer state, stepped there.

    home = StateHome("trial-3", optimizer, store, grad_accumulation=1); home.reshard(execs)  # TaskState.home
    cache.begin(home, peak=plan.peak)   # state_cache.py, one per device: room made, the task's state moved in
    with home.stepping() as device: optimizer.step()   # home_steps.py: over device tensors if all resident
    home.use(shard, device)             # before a unit: its entries move in, its pending update is applied
    home.where(shard)                   # the device holding that shard's state; None: host memory
    with home.on_host(): capture(...)   # checkpoints and snapshots read host tensors
    home.release()                      # written back to host memory, device bytes freed (end, cancel, re-plan)

Mechanism: while a task is resident, the model's own ``nn.Parameter`` objects point at device storage (``p.data``),
their ``.grad`` is there, and so are the tensors of ``optimizer.state[p]`` (all but the ``step`` counters of an
optimizer that is neither capturable nor fused: torch keeps those in host memory, as ``load_state_dict`` places
them). The user's own clipping, optimizer, GradScaler and LR scheduler then run over device tensors, as in the
user's GPU loop: on CUDA from the task's host thread, on the device's default stream like its units. The host
tensors the state came from stay as its "home" (page-locked on CUDA): writing back allocates nothing for the
parameters, and the host footprint admission charged (parameters, gradients, optimizer state) is unchanged.

Rules:
* Entries: each shard's state (the trainable parameters it owns: a tied one belongs to the first shard holding
  it, their gradients and optimizer state; frozen ones are copied in like buffers) is one entry; ``entry_bytes``
  predicts its device bytes (parameters, gradients (twice with grad_accumulation > 1: a minibatch's next to the
  accumulated ones), its share of the optimizer state, and the step's temporaries: one more copy of its trainable
  parameters); ``state_bytes`` is their sum.
  A unit reads the entries of every parameter its shard holds (``needs``); ``where(i)`` names the device only
  when all of them are there.
* A task whose whole state fits next to its plan's peak (state_cache.py ``begin``) moves in whole and stays: after
  its first step no state bytes move. Otherwise, when its optimizer takes the lazy per-shard step (lazy.py), its
  shards are entries that move in for their units (``use``, from the device's compute thread) and are written back
  only when evicted (``release(shards=...)``), per entry; the rest keep the host path (copied in per unit,
  gradients out, updated in host memory). Any other task stays whole: all of its state or none of it.
* Units of a resident shard use the state itself: the parameter's device tensor is the unit's leaf (a new leaf
  over the same storage), and the gradients go into the minibatch's pending gradients on the device; the task's
  host thread adds them into ``.grad`` after the segment (HostStore.flush_grads), so a failed attempt (out of
  memory) adds nothing, as before. Buffers are no part of an entry: they keep the copy-in / write-back path (a
  retried or recomputed unit needs their values from before the minibatch); unchanged ones stay in the device's
  ShardCache.
* Every move, flush, step and update holds ``lock`` (an RLock): eviction never overlaps the task's host thread's
  flush, step or checkpoint, nor a pending update being applied; pending gradients move with their entries.
* The master copy of an entry is the host tensor it came from (the model's own), so writing back allocates
  nothing for the parameters and the host footprint admission charged is unchanged (not page-locked: a moving
  entry on CUDA copies in from pageable memory).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from ..device.counts import CopyCounts
from ..device.devices import Device
from .home_steps import HomeSteps, moves_with_param

if TYPE_CHECKING:
    from .lazy import LazySteps
    from .shard import ShardExec
    from .state_cache import StateCache
    from .store import HostStore


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()



def entry_sizes(shards: Sequence[Sequence[nn.Parameter]], groups: dict[int, Any], optimizer_bytes: int | None,
                grad_accumulation: int) -> list[int]:
    """Predicted device bytes of each shard's entry (``shards``: each one's own parameters; ``groups``: the
    optimizer's parameters by id): parameters, gradients (twice with grad_accumulation > 1: a minibatch's next to
    the accumulated ones), its share of the optimizer state (``optimizer_bytes``, by trainable bytes; None: two
    copies of them) and the step's temporaries (one more copy of its trainable parameters)."""
    trainable = [sum(_nbytes(p) for p in s if p.requires_grad and id(p) in groups) for s in shards]
    total = sum(trainable)
    optimizer = optimizer_bytes if optimizer_bytes is not None else 2 * total
    twice = 2 if grad_accumulation > 1 else 1
    return [sum(_nbytes(p) for p in s) + twice * sum(_nbytes(p) for p in s if p.requires_grad)
            + (optimizer * t // total if total else 0) + t for s, t in zip(shards, trainable)]


@dataclass
class _Slot:
    """One parameter held on a device, and the host tensors its values go back into."""

    param: nn.Parameter
    home: torch.Tensor                                   # the host tensor ``param.data`` was
    state_homes: dict[str, torch.Tensor] = field(default_factory=dict)  # optimizer state key -> host tensor


class StateHome(HomeSteps):
    """Where one task's parameters, gradients and optimizer state are, and the moves between host and a device
    (see the module docstring). ``lock`` is held by the task's host thread around its flush, step and
    checkpoints, and by whoever moves the state."""

    def __init__(self, name: str, optimizer: torch.optim.Optimizer, store: HostStore,
                 grad_accumulation: int = 1, scaled: bool = False) -> None:
        self.name, self.optimizer, self.store = name, optimizer, store
        self.scaled = scaled  # fp16: a GradScaler (host memory) unscales and steps its gradients
        self.lock = threading.RLock()
        self.counts = CopyCounts()          # this task's copies and waits, on every device
        self.cache: StateCache | None = None   # the device cache holding its entries; None: host memory
        self.enabled = True
        self.why = "its state is in host memory until its first segment runs"
        self.room: int | None = None        # device bytes an out-of-memory re-plan left it (units and state)
        self.state_bytes = 0                # predicted device bytes of its state, every shard resident
        self.device_bytes = 0               # measured bytes of its state on the device (last move or step)
        self.steps_on_device = 0
        self.steps_on_host = 0
        self.evictions = 0
        self.state_at_first_step: int | None = None
        self.state_since_first_step: int | None = None  # state bytes moved from its first step to its last
        self._grad_accumulation = grad_accumulation
        self._optimizer_bytes: int | None = None
        self.planned = ""                             # how its plan was made for its entries (entry_plan.py)
        self._shards: list[list[nn.Parameter]] = []   # each shard's own parameters (a tied one: the first's)
        self._exec_params: list[list[nn.Parameter]] = []  # every parameter each shard's units read
        self._entry_bytes: list[int] = []             # predicted device bytes of each shard's entry
        self._slots: dict[int, list[_Slot]] = {}
        self._held_version = 0                        # bumped when _slots or _entry_bytes change (held_bytes)
        self._held: tuple[int, int] | None = None
        self._groups: dict[int, dict[str, Any]] = {}
        self.lazy: LazySteps | None = None            # the lazy per-shard step (lazy.py), when allowed
        self.movable: set[int] = set()                # shards whose entries may be on the device (state_cache)
        self.moves_in: dict[int, int] = {}            # shard -> times its entry moved onto a device
        self.step_path: str | None = None             # how its last step ran: resident, lazy, whole-host
        self.step_why = ""
        self.settled = threading.Event()              # clear: its host thread's flush/step after a segment is due
        self.settled.set()
        self._host_hold: Callable[[], str | None] | None = None

    # -- the task's shards and their predicted bytes ---------------------------------------------------------
    def reshard(self, execs: Sequence[ShardExec]) -> None:
        """The task's shards from now on; its state must be in host memory (``release`` first). A parameter
        shared by several shards belongs to the first."""
        if self.cache is not None:
            raise RuntimeError(f"task {self.name!r} re-cut while its state is on {self.cache.device.name}")
        seen: set[int] = set()
        self._shards = []
        for ex in execs:  # frozen parameters are no state: units copy them in (ShardExec.moving)
            own = [p for p in ex.params if id(p) not in seen and p.requires_grad]
            seen.update(id(p) for p in own)
            self._shards.append(own)
        self._exec_params = [[p for p in ex.params if p.requires_grad] for ex in execs]
        self._groups = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        self.movable, self.moves_in = set(), {}
        if self.lazy is not None:
            with self.lock:
                self.lazy.reshard(self._exec_params, self.entry_device)
        self._predict()

    def set_lazy(self, lazy: LazySteps) -> None:
        """Step this task lazily per shard whenever its shards are not all on one device (lazy.py)."""
        with self.lock:
            self.lazy = lazy
            lazy.reshard(self._exec_params, self.entry_device)

    @property
    def lazy_ok(self) -> bool:
        """Whether its state may be kept as per-shard entries (its optimizer takes the lazy per-shard step)."""
        return self.lazy is not None and self.lazy.verdict.lazy

    def needs(self, shard: int) -> list[int]:
        """The shards whose entries shard ``shard``'s units read (its own, and the owners of its tied ones)."""
        return self.lazy.needs(shard) if self.lazy is not None else [shard]

    def entry_bytes(self, shards: Sequence[int]) -> int:
        """Predicted device bytes of these shards' entries."""
        return sum(self._entry_bytes[i] for i in set(shards) if i < len(self._entry_bytes))

    def entry_list(self) -> list[int]:
        return list(self._entry_bytes)

    def held_bytes(self) -> int:
        """Predicted device bytes of the entries on its device now."""
        # read by the board at every pick (holder): kept until its entries or their sizes change (a version
        # bumped there; a value computed while they changed is stored under the old version, so not reused)
        version = self._held_version
        kept = self._held
        if kept is not None and kept[0] == version:
            return kept[1]
        nbytes = self.entry_bytes(list(self._slots))
        self._held = (version, nbytes)
        return nbytes

    def _entries_changed(self) -> None:
        self._held_version += 1

    def holder(self) -> tuple[int | None, int]:
        """(the index of the device holding its entries, their predicted bytes); (None, 0): in host memory."""
        cache = self.cache  # plain reads (the board's policy, any thread): a guess that may be a moment old
        return (None, 0) if cache is None else (cache.index, self.held_bytes())

    def resident_shards(self) -> set[int]:
        return set(self._slots)

    @property
    def n_shards(self) -> int:
        return len(self._shards)

    @property
    def optimizer_bytes(self) -> int | None:
        return self._optimizer_bytes

    def set_optimizer_bytes(self, nbytes: int) -> None:
        """The optimizer state's bytes as measured for host admission (training/footprint.py)."""
        self._optimizer_bytes = nbytes
        self._predict()

    def _predict(self) -> None:
        self._entry_bytes = entry_sizes(self._shards, self._groups, self._optimizer_bytes, self._grad_accumulation)
        self._entries_changed()
        self.state_bytes = sum(self._entry_bytes)

    def hold_on_host(self, reason: Callable[[], str | None]) -> None:
        """While ``reason()`` names one, the state stays in host memory (state_cache.py asks at each segment)."""
        self._host_hold = reason

    def host_hold(self) -> str | None:
        hold = self._host_hold
        return None if hold is None else hold()

    def disable(self, why: str) -> None:
        """Keep this task's state in host memory (``why`` goes into its stats)."""
        self.enabled, self.why = False, why

    # -- where it is -----------------------------------------------------------------------------------------
    def where(self, shard: int) -> Device | None:
        """The device holding every parameter (with its gradient and optimizer state) shard ``shard``'s units read;
        None: host memory."""
        cache = self.cache
        if cache is None or not all(j in self._slots for j in self.needs(shard)):
            return None
        return cache.device

    def entry_device(self, shard: int) -> Device | None:
        """Where shard ``shard``'s own entry is (None: host memory)."""
        cache = self.cache
        return cache.device if cache is not None and shard in self._slots else None

    def step_device(self) -> Device | None:
        """The device the whole optimizer step runs on: the one holding every shard's state, else None (host)."""
        cache = self.cache
        if cache is None or len(self._slots) < len(self._shards):
            return None
        return cache.device

    def _device_tensors(self, slot: _Slot) -> list[torch.Tensor]:
        p = slot.param
        out = [p.data] + ([p.grad] if p.grad is not None else [])
        return out + [v for _, v in self._moved_state(p, back=True)]

    def _moved_state(self, p: nn.Parameter, back: bool) -> list[tuple[str, torch.Tensor]]:
        """``p``'s optimizer state tensors that move with it (``back``: going home, also any it made off the
        host, e.g. a counter an optimizer makes on the parameter's device)."""
        if p not in self.optimizer.state:  # the state is a defaultdict: a lookup would add an entry
            return []
        group = self._groups.get(id(p))
        return [(k, v) for k, v in self.optimizer.state[p].items() if isinstance(v, torch.Tensor)
                and (moves_with_param(group, k) or (back and v.device.type != "cpu"))]

    # -- moves -----------------------------------------------------------------------------------------------
    def move_in(self, cache: StateCache, shards: Sequence[int] | None = None) -> None:
        """Copy these shards' state (default: every shard's) onto ``cache``'s device and point the model and
        optimizer at it. Raises (out of memory) with those shards' state left in host memory."""
        device = cache.device
        with self.lock, device.copier.charged_to(self.counts):
            chosen = [i for i in (range(len(self._shards)) if shards is None else sorted(set(shards)))
                      if i not in self._slots]
            moved: dict[int, list[tuple[_Slot, torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]]] = {}
            with device.copy_scope():  # CPU devices: the copies count as the device's memory
                for i in chosen:
                    moved[i] = []
                    for p in self._shards[i]:
                        state = self._moved_state(p, back=False)
                        moved[i].append((_Slot(p, p.data, dict(state)), device.copier.to_device(p.data, "state"),
                                         None if p.grad is None else device.copier.to_device(p.grad, "state"),
                                         {k: device.copier.to_device(v, "state") for k, v in state}))
                self.store.move_pending(lambda g: device.copier.to_device(g, "state"), self._keys(chosen))
            # Nothing points at the copies before all of them exist: an out-of-memory above leaves the host state
            for i, entries in moved.items():
                for slot, data, grad, state in entries:
                    self._point(slot.param, data, grad, state)
                self._slots[i] = [slot for slot, *_ in entries]
                self._entries_changed()
                self.moves_in[i] = self.moves_in.get(i, 0) + 1
            if self.cache is None:
                self.cache = cache
                cache.add(self)
            self.hold_now()

    def _keys(self, shards: Sequence[int]) -> set[int]:
        return {id(p) for i in shards for p in self._shards[i]}

    def release(self, why: str | None = None, wait: float | None = None,
                shards: Sequence[int] | None = None) -> int:
        """Write the state of these shards (default: all) back into host memory and free their device bytes (the
        task ends, is re-planned or is evicted: ``why``); returns the bytes written back (0: it was in host
        memory). ``wait``: at most that many seconds for the task's host thread to leave its lock (its step), else
        nothing is done and -1 returned."""
        if not self.lock.acquire(timeout=-1 if wait is None else wait):
            return -1
        try:
            return self._release(shards, why)
        finally:
            self.lock.release()

    def _release(self, shards: Sequence[int] | None, why: str | None) -> int:
        """(the lock held)"""
        cache = self.cache
        if cache is None:
            return 0
        chosen = sorted(self._slots) if shards is None else [i for i in sorted(set(shards)) if i in self._slots]
        copier = cache.device.copier
        assign: list[Callable[[], None]] = []
        written = 0
        with copier.charged_to(self.counts):
            for i in chosen:
                for slot in self._slots[i]:
                    written += self._write_back(slot, copier, assign)
            self.store.move_pending(lambda g: self._copy_home(copier, g), self._keys(chosen))
            copier.wait_written()
        for step in assign:  # after the wait: the host tensors hold their values
            step()
        for i in chosen:
            del self._slots[i]
            self._entries_changed()
        if why is not None:
            self.why = why
        if self._slots:
            self.hold_now()
            return written
        self.cache = None
        self.device_bytes = 0
        self.settled.set()
        cache.remove(self)
        return written

    @staticmethod
    def _copy_home(copier: Any, t: torch.Tensor, home: torch.Tensor | None = None) -> torch.Tensor:
        if home is None or home.shape != t.shape or home.dtype != t.dtype:
            home = copier.host_like(t)
        copier.write_back(home, t)
        return home

    def _write_back(self, slot: _Slot, copier: Any, assign: list[Callable[[], None]]) -> int:
        """Issue the copies of one parameter's state into host tensors; ``assign`` gets what points the model
        and optimizer at them once the copies are done."""
        p = slot.param
        copier.write_back(slot.home, p.data)
        grad = None if p.grad is None else self._copy_home(copier, p.grad)
        state = {k: self._copy_home(copier, v, slot.state_homes.get(k)) for k, v in self._moved_state(p, back=True)}
        slot.state_homes.update(state)

        assign.append(lambda: self._point(p, slot.home, grad, state))
        return _nbytes(p) + (0 if grad is None else _nbytes(grad)) + sum(_nbytes(v) for v in state.values())

    @contextlib.contextmanager
    def on_host(self) -> Iterator[None]:
        """Inside, the model's parameters and the optimizer's state are host tensors holding the current values
        (a checkpoint or snapshot reads them); the state stays resident and is pointed at again afterwards.
        Gradients stay where they are (no checkpoint holds them)."""
        with self.lock:
            cache = self.cache
            if cache is None:
                yield
                return
            copier = cache.device.copier
            swaps: list[tuple[_Slot, torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]] = []
            with copier.charged_to(self.counts):
                for slots in self._slots.values():
                    for slot in slots:
                        p = slot.param
                        copier.write_back(slot.home, p.data)
                        state = dict(self._moved_state(p, back=True))
                        slot.state_homes.update({k: self._copy_home(copier, v, slot.state_homes.get(k))
                                                 for k, v in state.items()})
                        swaps.append((slot, p.data, p.grad, state))
                copier.wait_written()
            try:
                for slot, _, _, state in swaps:
                    self._point(slot.param, slot.home, None, {k: slot.state_homes[k] for k in state})
                yield
            finally:
                for slot, data, grad, state in swaps:
                    self._point(slot.param, data, grad, state)

    def _point(self, p: nn.Parameter, data: torch.Tensor, grad: torch.Tensor | None,
               state: dict[str, torch.Tensor]) -> None:
        """Make ``p`` (the model's own Parameter) and its optimizer state refer to these tensors."""
        p.grad = None  # (CUDA: a gradient must be on its parameter's device when assigned)
        p.data = data
        p.grad = grad
        if state:
            self.optimizer.state[p].update(state)

    # -- reading -----------------------------------------------------------------------------------------------
    def device_storages(self) -> set[int]:
        """Data pointers of the storages its state has on a device (none in host memory)."""
        with self.lock:
            return {t.untyped_storage().data_ptr() for slots in self._slots.values() for s in slots
                    for t in self._device_tensors(s)}

    def home_bytes(self) -> int:
        """Host bytes kept for its state while it is on a device (the tensors it goes back into)."""
        with self.lock:
            return sum(t.untyped_storage().nbytes() for slots in self._slots.values() for s in slots
                       for t in [s.home, *s.state_homes.values()])
