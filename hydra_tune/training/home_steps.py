"""The step side of a task's StateHome (resident.py): where its optimizer step runs, the lazy per-shard step's
hooks (lazy.py) and what ``stats()`` reports.

    with home.stepping() as device: optimizer.step()   # one whole step, where its whole state is (None: host)
    if home.steps_lazily(): home.begin_lazy()           # the lazy step's boundary (optstep.py)
    home.use(shard, device)                             # before a unit: entries in, pending updates applied
    home.flush(); home.finish()                         # every pending update applied; (end) written back

Rules: every method runs with the home's lock held (an RLock: the task's host thread, a device's compute thread,
an evicting device), so one thread at a time owns the PendingStep and no move overlaps an update. Step counts:
``steps_on_device``/``steps_on_host`` count optimizer steps (a whole step where it ran; a lazy step on the device
when every shard's update of it ran on a device); ``shard_steps_on_device``/``_on_host`` count per-shard updates.
``step_path``: "resident" (the whole step over device tensors), "lazy" (per shard) or "whole-host" (one whole
step in host memory), with ``step_why``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..device.devices import Device


_NULL = contextlib.nullcontext()


def moves_with_param(group: dict[str, Any] | None, key: str) -> bool:
    """Whether optimizer state ``key`` moves to its parameter's device: all but the ``step`` counter of a group
    that is neither capturable nor fused (torch reads that one on the host, without a device sync)."""
    return key != "step" or bool(group and (group.get("capturable") or group.get("fused")))


class HomeSteps:
    """Mixed into StateHome (resident.py), whose attributes it uses (see the module docstring)."""

    state_at_first_step: int | None = None
    state_since_first_step: int | None = None  # state bytes moved from its first step to its last

    def hold_now(self) -> None:
        """Count what the step or the flush made on the device (gradients, optimizer state) as its memory."""
        cache = self.cache
        if cache is None:
            return
        # Runs after every flush and step: one pass over the parameters (no ``p.data`` aliases, no per-tensor
        # lists); each tensor once (a parameter's data is the parameter's own storage), as ``_device_tensors``.
        storages: list[torch.UntypedStorage] = []
        groups = self._groups
        # by identity: a Parameter's hash is a Python call, and ``state`` is a defaultdict (a lookup adds an entry)
        state = {id(p): st for p, st in self.optimizer.state.items()}
        moves: dict[int, bool] = {}  # per parameter group: whether its ``step`` counters move too
        for slots in self._slots.values():
            for slot in slots:
                p = slot.param
                storages.append(p.untyped_storage())
                grad = p.grad
                if grad is not None:
                    storages.append(grad.untyped_storage())
                st = state.get(id(p))
                if st:
                    group = groups.get(id(p))
                    step_moves = moves.get(id(group))
                    if step_moves is None:
                        step_moves = moves[id(group)] = moves_with_param(group, "step")
                    for k, v in st.items():  # (a loop, not a comprehension: no frame per parameter)
                        if isinstance(v, torch.Tensor) and (step_moves or k != "step" or v.device.type != "cpu"):
                            storages.append(v.untyped_storage())
        cache.device.hold_storages(storages)
        self.device_bytes = sum(map(torch.UntypedStorage.nbytes, storages))

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The task's host thread changes its state inside (flush of gradients): no move meanwhile."""
        with self.lock:
            yield
            self.hold_now()

    def land_grads(self, store: Any, step_follows: bool = False) -> None:
        """The minibatch's gradients from ``store`` (a HostStore) into ``.grad`` and the store cleared, with no
        move meanwhile (``locked`` as a method: one per minibatch). With ``step_follows`` (``steps_here``: a
        resident step right after) only the gradients are counted now; the step's own count passes over every
        tensor of the task once for both."""
        with self.lock:
            store.flush_grads()
            store.clear()
            if step_follows:
                self.hold_grads()
            else:
                self.hold_now()

    def steps_here(self) -> bool:
        """Whether the step due now runs whole on the device, where ``stepping`` counts its memory. The gradients
        have landed, so nothing is evicted before it (state_cache.py waits for ``settle``)."""
        return self.step_device() is not None

    def hold_grads(self) -> None:
        """Count the gradients on the device as its memory (``hold_now`` without the rest: what a backward made)."""
        cache = self.cache
        if cache is not None:
            cache.device.hold_storages([grad.untyped_storage() for slots in self._slots.values() for slot in slots
                                        if (grad := slot.param.grad) is not None])

    def stepping(self) -> contextlib.AbstractContextManager[Device | None]:
        """Around the task's optimizer step (clipping, step, scheduler, zero_grad), in its host thread: no move
        meanwhile; gives the device its state is on (None: host memory) and counts the step there. A class, not
        a generator block: the loop enters one at every step."""
        return _Stepping(self)

    def step_started(self) -> Device | None:
        """(``_Stepping``, the lock held) Pending updates applied; the device the whole step runs on."""
        self.flush()
        return self.step_device()

    def step_ended(self, device: Device | None) -> None:
        """(``_Stepping``, the lock held) A whole step ran on ``device``: counted, its memory held."""
        if device is not None:
            self.steps_on_device += 1
            self.hold_now()
        else:
            self.steps_on_host += 1
        self.step_path = "resident" if device is not None else "whole-host"
        self.step_why = (f"its whole state is on {device.name}" if device is not None else self._host_why())
        self._stepped()

    def resident_steps(self, device: Device, steps: int) -> None:
        """A light run (light_run.py) took ``steps`` whole steps on ``device`` since: counted as ``step_ended``
        counts each, the memory they hold counted once."""
        with self.lock:
            if steps:
                self.steps_on_device += steps
                self.step_path, self.step_why = "resident", f"its whole state is on {device.name}"
                self._stepped()
            self.hold_now()

    def has_pending(self) -> bool:
        """Whether a per-shard update of the last begun step is not applied yet (lazy.py)."""
        return self.lazy is not None and self.lazy.pending_any()

    def _host_why(self) -> str:
        if self.lazy is not None and not self.lazy.verdict.lazy:
            return f"one whole step in host memory: {self.lazy.verdict.reason}"
        return "one whole step in host memory: its state is not on a device (see why)"

    def _stepped(self) -> None:
        if self.state_at_first_step is None:
            self.state_at_first_step = self.counts.state_bytes()
        self.state_since_first_step = self.counts.state_bytes() - self.state_at_first_step

    def steps_lazily(self) -> bool:
        """Whether the step due now is the lazy per-shard one: its optimizer allows it and its shards are
        per-shard entries that are not all on the device (the lock held)."""
        return self.lazy_ok and bool(self.movable) and self.step_device() is None

    def begin_lazy(self) -> None:
        """The lazy step's boundary (in the task's host thread, the lock held, before ``scheduler.step()``)."""
        lazy = self.lazy
        if lazy is None:
            raise RuntimeError(f"task {self.name!r} has no lazy step")
        why = lazy.begin(self.entry_device)
        self.step_path = "lazy"
        self.step_why = ("per shard, each update where its entry is, just before the shard's next use"
                         if why is None else f"this step applied whole at once: {why}")
        self.hold_now()
        self._stepped()

    def use(self, shard: int, device: Device) -> None:
        """Before a unit of shard ``shard`` runs on ``device`` (its compute thread): the entries it reads move
        in when they may (state_cache.py ``fetch``), and the pending updates it reads are applied where they are.
        A unit that runs on host tensors (its entries may not all be here) finds none of them here: those that
        are go home first (a unit reads one device's tensors or the host's)."""
        with self.lock:
            cache = getattr(device, "states", None)
            moved = False
            if self.movable and cache is not None and self.cache in (None, cache):
                need = self.needs(shard)
                here = [j for j in need if j in self.resident_shards()]
                if len(here) < len(need):
                    moved = True
                    if not (shard in self.movable and cache.fetch(self, [j for j in need if j not in here])) and here:
                        self.release(shards=here)
            if self.lazy is not None and self.lazy.apply(shard, self.entry_device):
                moved = True
            if moved:
                self.hold_now()

    def prefetchable(self, shard: int, device: Device) -> bool:
        """Whether the copy thread may copy shard ``shard`` in ahead of its unit on ``device``: not while an
        update it reads is pending (its unit applies it first), nor when its entries move in (or go home) at its
        unit, nor while they are on another device (a copy would read that device's tensors)."""
        if not self.lock.acquire(timeout=1.0):
            return False
        try:
            if self.lazy is not None and self.lazy.pending(shard):
                return False
            here = self.resident_shards() & set(self.needs(shard))
            if here and (self.cache is None or self.cache.device is not device or self.where(shard) is None):
                return False
            return not (shard in self.movable and self.where(shard) is None)
        finally:
            self.lock.release()

    def flush(self) -> None:
        """Apply every pending per-shard update, each where its entry is (before eval, checkpoints, model(), a
        re-plan, the task's end)."""
        with self.lock:
            # (after every step: only an update applied now makes anything new to count)
            if self.lazy is not None and any(self.lazy.pending(i) for i in range(self.n_shards)):
                self.lazy.flush(self.entry_device)
                self.hold_now()

    def finish(self) -> None:
        """The task trains no more (done, failed, cancelled; its host thread, or the thread letting it go):
        pending updates applied, its state written back to host memory."""
        with self.lock:
            try:
                self.flush()
            except Exception:  # noqa: BLE001  (only after the task's own error: a done task was flushed already)
                pass
            self.release()

    def settle(self) -> None:
        """Its host thread has flushed its gradients and stepped after its last segment: its entries may be
        evicted without waiting (state_cache.py)."""
        self.settled.set()

    def stats(self) -> dict[str, Any]:
        """What ``Runtime.stats()`` reports for the task (plain reads: any thread)."""
        cache, lazy = self.cache, self.lazy
        on_device = self.steps_on_device + (lazy.steps_on_device if lazy is not None else 0)
        on_host = self.steps_on_host + (lazy.steps_on_host if lazy is not None else 0)
        copies, steps = self.counts.snapshot(), on_device + on_host
        out = {"state_on": None if cache is None else cache.device.name, "state_bytes": self.state_bytes,
               "device_bytes": self.device_bytes, "steps_on_device": on_device, "steps_on_host": on_host,
               "evictions": self.evictions, "why": self.why, "step_path": self.step_path,
               "step_why": self.step_why, "lazy": None if lazy is None else lazy.verdict.reason,
               "entry_bytes": self.entry_list(), "resident_shards": sorted(self.resident_shards()),
               "moving_shards": sorted(self.movable), "planned": self.planned,
               "entry_moves_in": [self.moves_in.get(i, 0) for i in range(self.n_shards)],
               "copies": copies, "syncs_per_step": copies["syncs"] / steps if steps else None,
               "state_bytes_after_first_step": self.state_since_first_step}
        if lazy is not None:
            out.update(lazy.stats())
        return out


class _Stepping:
    """``HomeSteps.stepping``'s block: the home's lock, then the device's step scope; a step that raised is not
    counted (as the plain loop's failed step changes nothing it counts)."""

    __slots__ = ("home", "device", "scope")

    def __init__(self, home: HomeSteps) -> None:
        self.home = home

    def __enter__(self) -> Device | None:
        self.home.lock.acquire()
        try:
            self.device = self.home.step_started()
            self.scope = self.device.step_scope() if self.device is not None else _NULL
            self.scope.__enter__()
        except BaseException:
            self.home.lock.release()
            raise
        return self.device

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        try:
            self.scope.__exit__(kind, exc, tb)
            if kind is None:
                self.home.step_ended(self.device)
        finally:
            self.home.lock.release()
