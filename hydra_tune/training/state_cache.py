"""One device's cache of tasks' state (resident.py): room for a task's units and state, made by evicting others.

    cache = StateCache(device, 0, order=board.run_order)   # device.states, made by the device's worker
    cache.begin(home, peak=plan.peak)   # a segment starts: room made, the task's state moved in when it fits
    cache.end(home)                     # the segment ran: its state may be evicted from now on
    cache.prefetched(home)              # that task runs next here: its state stays meanwhile

Rules: at the start of a segment, a task's state moves in (all shards, ``StateHome.move_in``) when its predicted
bytes fit beside its plan's peak within the device budget and the room an out-of-memory re-plan left it
(``policy.partition.resident_fits``), after evicting other tasks' state; otherwise it stays in host memory and
only its units need room. Eviction writes state back to host memory (``StateHome.release``): first that of the
task expected to run latest (``order``: the board's guess, tasks whose host thread is busy last), among equals
the largest; never the running task's nor the one picked next for the device; it waits up to ``EVICT_WAIT``
seconds for a task's host thread to finish its step. Room for state is made only when enough can be evicted;
room for units always, as far as it can be.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..device.devices import Device
from ..policy.partition import resident_fits
from .resident import StateHome

EVICT_WAIT = 5.0  # seconds a device waits for a task's host thread to finish its step before evicting its state


class StateCache:
    """One device's resident task state (see the module docstring). ``order()``: task names in the order they
    are expected to run (soonest first); a task not named runs latest."""

    def __init__(self, device: Device, index: int, order: Callable[[], Sequence[str]]) -> None:
        self.device, self.index = device, index
        self._order = order
        self._lock = threading.Lock()
        self._homes: list[StateHome] = []
        self._running: StateHome | None = None
        self._next: StateHome | None = None
        self.evictions = 0

    def add(self, home: StateHome) -> None:
        with self._lock:
            self._homes.append(home)

    def remove(self, home: StateHome) -> None:
        with self._lock:
            self._homes = [h for h in self._homes if h is not home]

    def total(self) -> int:
        """Device bytes reserved for the state held here (predicted: each task's ``state_bytes``)."""
        with self._lock:
            return sum(h.state_bytes for h in self._homes)

    def prefetched(self, home: StateHome) -> None:
        """``home``'s task runs next here: its entries are not evicted meanwhile."""
        with self._lock:
            self._next = home

    def begin(self, home: StateHome, peak: int) -> None:
        """A segment of ``home``'s task starts on this device; its units need ``peak`` bytes beside the state
        held here. Its state moves here when it fits (room made by evicting others), others are evicted as its
        units need room (module docstring)."""
        with self._lock:
            self._running = home
            if self._next is home:
                self._next = None
        if home.cache is not None and home.cache is not self:
            home.release("its next segment ran on another device")  # a task's state lives on one device
        budget = self.device.plan_budget
        if home.cache is None and home.enabled and home.scaled and not self.device.steps_loss_scaler:
            home.why = (f"fp16 loss scaling: its GradScaler lives in host memory, which {self.device.name} cannot "
                        "step gradients with exactly (torch reads its non-blocking device->host copy at once)")
        elif home.cache is None and home.enabled:
            limits = [x for x in (budget, home.room) if x is not None]
            limit = min(limits) if limits else None
            if not resident_fits(peak, home.state_bytes, limit):
                home.why = (f"its state ({home.state_bytes} bytes) next to its units' peak ({peak} bytes) exceeds "
                            f"what it may use on {self.device.name} ({limit} bytes: the device budget, or the room "
                            "an out-of-memory re-plan left it)")
            elif self._make_room(home, home.state_bytes + peak, budget, optional=True):
                try:
                    home.move_in(self)
                    home.why = f"its state fits on {self.device.name}"
                except torch.OutOfMemoryError:
                    home.why = f"{self.device.name} ran out of memory while its state was copied in"
            else:
                home.why = f"other tasks' state on {self.device.name} that cannot be evicted now leaves no room"
        self._make_room(home, peak, budget, optional=False)

    def end(self, home: StateHome) -> None:
        with self._lock:
            if self._running is home:
                self._running = None

    def _make_room(self, home: StateHome, need: int, budget: int | None, optional: bool) -> bool:
        """Evict others until ``need`` more bytes fit beside the state held here (``optional``: only if that
        can be reached); whether it fits."""
        if budget is None:
            return True
        with self._lock:
            held = sum(h.state_bytes for h in self._homes)
            pinned = (home, self._running, self._next)
            victims = [h for h in self._homes if not any(h is x for x in pinned)]
        over = held + need - budget
        if over <= 0:
            return True
        if optional and sum(h.state_bytes for h in victims) < over:
            return False
        rank = {name: i for i, name in enumerate(self._order())}
        for victim in sorted(victims, key=lambda h: (-rank.get(h.name, len(rank)), -h.state_bytes)):
            over -= self._evict(victim)
            if over <= 0:
                return True
        return False

    def _evict(self, victim: StateHome) -> int:
        """Write ``victim``'s state back once its host thread left its lock (its step: up to ``EVICT_WAIT``
        seconds, else it stays); the bytes freed here."""
        if not victim.lock.acquire(timeout=EVICT_WAIT):
            return 0
        try:
            with self._lock:
                if victim.cache is not self or victim is self._running or victim is self._next:
                    return 0  # moved or released meanwhile, or picked to run
            freed = victim.state_bytes
            victim.release(f"evicted from {self.device.name} to make room for another task")
            victim.evictions += 1
            with self._lock:
                self.evictions += 1
            return freed
        finally:
            victim.lock.release()

    def clear(self) -> None:
        """Write every task's state back (the runtime closes); one whose host thread is inside its step stays
        (that thread writes it back when its task's chain is let go: TrainingLoop.segments)."""
        with self._lock:
            homes = list(self._homes)
        for home in homes:
            home.release(wait=0)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"resident_tasks": len(self._homes), "resident_bytes": sum(h.state_bytes for h in self._homes),
                    "evictions": self.evictions}
