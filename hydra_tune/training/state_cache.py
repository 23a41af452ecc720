"""One device's cache of tasks' state (resident.py): room for a task's units and state, made by evicting others.

    cache = StateCache(device, 0, order=board.run_order)   # device.states, made by the device's worker
    cache.begin(home, peak=plan.peak)   # a segment starts: room made, the task's state moved in when it fits
    cache.end(home)                     # the segment ran: its state may be evicted from now on
    cache.prefetched(home)              # that task runs next here: its state stays meanwhile
    cache.using(home, shards)           # a unit starts: the shards of its units left (which entries to keep)
    cache.fetch(home, shards)           # a unit's entries move in (StateHome.use)
    cache.hold_graph(store, i, nbytes)  # a prepared forward's graph waits here for its backward (held_graphs.py)

Rules: at the start of a segment, a task's state moves in whole (``StateHome.move_in``) when its predicted bytes
fit beside its plan's peak within the device budget and the room an out-of-memory re-plan left it
(``policy.partition.resident_fits``), after evicting other entries. Otherwise a task whose optimizer takes the lazy
per-shard step keeps per-shard entries: those whose reads fit beside the peak (``movable``) move in for their units
(``fetch``, from ``StateHome.use``); the others, and every task that must stay whole, keep the host path (``why``
says which and why). Eviction is per entry (a whole task's state goes as a whole, never while it runs): first the
entries of the task expected to run latest (``order``: the board's guess), then, within a task, the entry it reads
latest (the running task: by its units left), then the largest (reload plus write-back cost the same per byte);
never the entries the running task's current unit reads, nor those of the task picked next for the device. An
entry goes back to host memory only when evicted (``StateHome.release``). Before evicting another task's entries
it waits (up to ``EVICT_WAIT`` seconds) for that task's host thread to settle: a segment's end leaves gradients on
the device and its step is imminent, so the step goes first, where its state is (``StateHome.settled``). After an
out-of-memory the device makes no more per-shard entries (``after_oom``). Graphs held across segments
(held_graphs.py) count beside the state; making room drops them first (their backward recomputes), and a graph is
held only where it fits beside what is held and the running task's peak without evicting anything
(``room_for_graph``; the part of it that peak reserves already is not counted twice).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..device.devices import Device
from ..policy.partition import resident_fits
from .held_graphs import HeldGraphs
from .resident import StateHome
from .store import HostStore

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
        self._upcoming: list[int] = []   # the running task's shards, unit by unit, from the running unit on
        self._peak = 0                   # the running task's units' peak
        self.evictions = 0
        self.entries_off: str | None = None  # why per-shard entries are no longer made here (an out-of-memory)
        self.graphs = HeldGraphs()       # kept forwards waiting across segments for their backward

    def add(self, home: StateHome) -> None:
        with self._lock:
            if not any(h is home for h in self._homes):
                self._homes.append(home)

    def remove(self, home: StateHome) -> None:
        with self._lock:
            self._homes = [h for h in self._homes if h is not home]

    def total(self) -> int:
        """Device bytes reserved for the state held here (predicted: each entry's bytes) and the graphs held here
        but the running task's."""
        with self._lock:
            running = self._running.store if self._running is not None else None
            return sum(h.held_bytes() for h in self._homes) + self.graphs.nbytes(running)

    def room_for_graph(self, nbytes: int, reserved: int = 0) -> bool:
        """Whether a graph of ``nbytes`` the running task keeps here for a later backward fits beside what is held
        and the running task's units' peak, evicting nothing (a task that needs the room later drops it).
        ``reserved``: bytes of it that peak holds already (the last shard's: its recomputing B unit makes that very
        graph within its peak, and while the graph waits no other unit of the task runs, so it needs no more)."""
        budget = self.device.plan_budget
        return budget is None or self.total() + max(nbytes - reserved, 0) + self._peak <= budget

    def hold_graph(self, store: HostStore, index: int, nbytes: int) -> None:
        """``store.kept[index]`` stays here for its backward, counted as ``nbytes`` (held_graphs.py)."""
        self.graphs.hold(store, index, nbytes)

    def prefetched(self, home: StateHome) -> None:
        """``home``'s task runs next here: its entries are not evicted meanwhile."""
        with self._lock:
            self._next = home

    def using(self, home: StateHome, shards: Sequence[int]) -> None:
        """The running task's unit starts: ``shards`` are its shards unit by unit from this one on (the first two
        are never evicted; the rest tell which of its entries is used latest)."""
        with self._lock:
            if self._running is home:
                self._upcoming = list(shards)

    def begin(self, home: StateHome, peak: int) -> None:
        """A segment of ``home``'s task starts on this device; its units need ``peak`` bytes beside the state
        held here. Its state moves here when it fits (room made by evicting others); else, when its optimizer
        takes the lazy per-shard step, its shards become entries that move in for their units; others are
        evicted as its units need room (module docstring)."""
        with self._lock:
            self._running, self._upcoming, self._peak = home, [], peak
            if self._next is home:
                self._next = None
        self.graphs.unload(home.store, self.device.copier.release)  # (another task's parameters: not counted)
        if home.cache is not None and home.cache is not self:
            home.release("its next segment ran on another device")  # a task's state lives on one device
        budget = self.device.plan_budget
        held = home.host_hold()
        if held is not None:  # a prepared loop holds tensors aliasing the host ones (prepare/access.py)
            home.release(held)
            home.movable, home.why = set(), held
        elif home.cache is None and home.enabled and home.scaled and not self.device.steps_loss_scaler:
            home.why = (f"fp16 loss scaling: its GradScaler lives in host memory, which {self.device.name} cannot "
                        "step gradients with exactly (torch reads its non-blocking device->host copy at once)")
        elif home.enabled and not (home.cache is self and len(home.resident_shards()) == home.n_shards):
            self._place(home, peak, budget)  # (whole state here already: nothing to move, its bytes counted)
        self._make_room(home, peak, budget, optional=False)

    def _place(self, home: StateHome, peak: int, budget: int | None) -> None:
        limits = [x for x in (budget, home.room) if x is not None]
        limit = min(limits) if limits else None
        every = list(range(home.n_shards))
        fits = resident_fits(peak, home.state_bytes, limit)
        if fits and self._make_room(home, home.entry_bytes(set(every) - home.resident_shards()) + peak, budget,
                                    optional=True, keep=every):
            if self._move(home, every):
                home.movable = set(every) if home.lazy_ok else set()
                home.why = f"its state fits on {self.device.name}"
                return
        if fits:
            why = f"other tasks' state on {self.device.name} that cannot be evicted now leaves no room"
        else:
            why = (f"its state ({home.state_bytes} bytes) next to its units' peak ({peak} bytes) exceeds what it "
                   f"may use on {self.device.name} ({limit} bytes: the device budget, or the room an out-of-memory "
                   "re-plan left it)")
        if not home.lazy_ok or self.entries_off:
            home.movable = set()
            home.why = why + (f"; {self.entries_off}" if self.entries_off and home.lazy_ok else
                              "" if home.lazy is None else f"; its state stays whole ({home.lazy.verdict.reason})")
            return
        home.movable = {i for i in every if resident_fits(peak, home.entry_bytes(home.needs(i)), limit)}
        host = sorted(set(every) - home.movable)
        home.why = (f"{why}: per-shard entries, shards {sorted(home.movable)} move in for their units and step "
                    "there (lazy per-shard step)" + (f"; shards {host} keep the host path (an entry next to its "
                                                     "units' peak exceeds that)" if host else ""))

    def _move(self, home: StateHome, shards: Sequence[int]) -> bool:
        try:
            home.move_in(self, shards)
            return True
        except torch.OutOfMemoryError:
            home.why = f"{self.device.name} ran out of memory while its state was copied in"
            return False

    def after_oom(self) -> None:
        """The device ran out of memory: it holds less than its budget says, so per-shard entries are no longer
        made here (their room is not known) and those here go back to host memory now; a task whose whole state
        fits keeps the rules for that (its re-plan's ``room``)."""
        self.entries_off = (f"per-shard entries are off on {self.device.name} since it ran out of memory (it holds "
                            "less than its budget says)")
        with self._lock:
            homes = [h for h in self._homes if h.movable]
        for home in homes:
            home.movable = set()
            home.release(self.entries_off, wait=0)

    def fetch(self, home: StateHome, shards: Sequence[int]) -> bool:
        """Move these entries of the running task in for its unit (compute thread, its lock held), evicting
        other entries for room; whether they are here now."""
        if self.entries_off:
            return False
        need = home.entry_bytes(shards) + self._peak
        if not self._make_room(home, need, self.device.plan_budget, optional=True, keep=shards):
            return False
        return self._move(home, shards)

    def end(self, home: StateHome) -> None:
        with self._lock:
            if self._running is home:
                self._running, self._upcoming = None, []
        if home.cache is self and home.store.has_grads():
            home.settled.clear()  # its host thread flushes its gradients (and may step) now: evictions wait

    def _protected(self, home: StateHome, keep: Sequence[int]) -> set[int]:
        """(the lock held) Entries of ``home`` never evicted now: ``keep``, and for the running task those its
        current unit reads. (Its next unit's are ranked by their use, not kept: entries are never copied ahead,
        so none is in flight; keeping both would refuse a unit whose entries fit alone.)"""
        out = set(keep) if home is not None else set()
        if home is self._running:
            for s in self._upcoming[:1]:
                out.update(home.needs(s))
        return out

    def _next_use(self, home: StateHome, shard: int) -> int:
        """(the lock held) How far ahead the running task reads ``shard``: its position in the units left, else
        after them (its next segment starts with its first shard)."""
        if home is self._running:
            for j, s in enumerate(self._upcoming):
                if shard in home.needs(s):
                    return j
            return len(self._upcoming) + shard
        return shard

    def _victims(self, home: StateHome, keep: Sequence[int]) -> list[tuple[tuple[int, int, int], StateHome,
                                                                             list[int]]]:
        """(the lock held) Entries that may go, each with its rank (evicted first: the task that runs latest,
        then its entry used latest, then the largest: reload plus write-back cost the same per byte)."""
        rank = {name: i + 1 for i, name in enumerate(self._order())}
        out = []
        for h in self._homes:
            if h is self._next:
                continue
            here = h is home or h is self._running
            if here and not h.lazy_ok:
                continue  # a whole task's state goes only as a whole: not while it runs
            r = 0 if here else rank.get(h.name, len(rank) + 1)
            shards = sorted(h.resident_shards() - (self._protected(h, keep if h is home else ())))
            groups = [[s] for s in shards] if h.lazy_ok else [shards]
            out += [((-r, -self._next_use(h, g[0]), -h.entry_bytes(g)), h, g) for g in groups if g]
        return sorted(out, key=lambda v: v[0])

    def _make_room(self, home: StateHome, need: int, budget: int | None, optional: bool,
                   keep: Sequence[int] = ()) -> bool:
        """Evict entries until ``need`` more bytes fit beside the state held here (``optional``: only if that
        can be reached); whether it fits."""
        if budget is None:
            return True
        with self._lock:
            held = sum(h.held_bytes() for h in self._homes)
            running = self._running.store if self._running is not None else None
        graphs = self.graphs.nbytes(running)
        over = held + graphs + need - budget
        if over <= 0:
            return True
        with self._lock:  # (ranked only when something must go: most segments of a kept task find room)
            victims = self._victims(home, keep)
        spare = (home.store, running)  # (the running task's graphs are inside its peak; its own it needs now)
        if optional and self.graphs.nbytes(*spare) + sum(v.entry_bytes(g) for _, v, g in victims) < over:
            return False
        over -= self.graphs.drop(over, spare)  # the cheapest to lose: a recompute, not a write-back and reload
        if over <= 0:
            return True
        for _, victim, shards in victims:
            over -= self._evict(victim, shards, home)
            if over <= 0:
                return True
        return False

    def _evict(self, victim: StateHome, shards: list[int], home: StateHome) -> int:
        """Write these entries of ``victim`` back once its host thread settled (flushed its gradients, took its
        step: the step goes first, where its state is) and left its lock (up to ``EVICT_WAIT`` seconds each, else
        they stay); the bytes freed here."""
        if victim is not home and victim is not self._running:
            victim.settled.wait(EVICT_WAIT)
        if not victim.lock.acquire(timeout=EVICT_WAIT):
            return 0
        try:
            with self._lock:
                if victim.cache is not self or victim is self._next or (
                        victim is self._running and victim is not home):
                    return 0  # moved or released meanwhile, or picked to run
                shards = [s for s in shards if s in victim.resident_shards()]
            freed = victim.entry_bytes(shards)
            if freed:
                self.graphs.drop_of(victim.store)  # a graph over its state would keep storage no longer counted
                victim.release(f"evicted from {self.device.name} to make room for another task" if victim is not home
                               else None, shards=shards)
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
            return {"resident_tasks": len(self._homes), "resident_bytes": sum(h.held_bytes() for h in self._homes),
                    "evictions": self.evictions, "graphs_held": self.graphs.held,
                    "graphs_dropped": self.graphs.dropped, "graphs_unloaded": self.graphs.unloaded}
