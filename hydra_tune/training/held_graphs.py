"""Kept forwards that wait across segments for their backward on one device, counted beside the state held there.

    graphs = HeldGraphs()                            # one per StateCache (state_cache.py): ``cache.graphs``
    graphs.hold(store, index, nbytes)                # store.kept[index] (droppable) waits here for its B unit
    graphs.nbytes(store)                             # what they hold, but the running task's (its peak counts it)
    graphs.drop(over, spare=(store,))                # free at least ``over`` bytes by dropping graphs, if it can
    graphs.unload(store, copier.release)             # store's segment begins: the others' loaded parameters go

Why: a prepared model's training forward (prepare/driver.py) keeps its last shard's graph so its backward, a
call later, needs no recompute. Unlike a segment's kept forwards (inside its units' planned peak), that graph
stays on the device while the user's loop computes the loss, and other tasks' segments may run there meanwhile:
its bytes are held as state is, so the device's cache counts them when it makes room and when it tells the copy
thread what is free. A held graph is the cheapest thing to give up (its backward recomputes one forward, exactly:
its forward saved what that needs, residency.Kept ``droppable``), so it goes before any state entry.

Rules: a graph counts while it is its store's ``kept[index]`` (a backward, a new forward or the task's end drops
it there: nothing to tell here; it is held weakly, so dropping it there frees it); dropping pops it from its store
(``dict.pop``: whoever pops first has it, so a backward that took it meanwhile runs through it and nothing is freed
here); a task's state evicted from the device drops its graphs too (``drop_of``).
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .store import HostStore


class HeldGraphs:
    """The held graphs of one device (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (store, shard, its Kept, predicted bytes), the first and third weakly
        self._held: list[tuple[weakref.ref[HostStore], int, weakref.ref[Any], int]] = []
        self.held = 0      # graphs held here (stats: "graphs_held")
        self.dropped = 0   # of them dropped for room (their backward recomputed: "graphs_dropped")
        self.unloaded = 0  # of them whose parameter copies gave their bytes back for another task ("graphs_unloaded")

    def hold(self, store: HostStore, index: int, nbytes: int) -> None:
        """``store.kept[index]``, just kept on this device, waits here for its backward (``nbytes`` predicted)."""
        with self._lock:
            self._prune()
            self._held.append((weakref.ref(store), index, weakref.ref(store.kept[index]), nbytes))
            self.held += 1

    def _prune(self) -> None:
        """(the lock held) Forget graphs no longer kept (their backward ran, or they were cleared)."""
        self._held = [h for h in self._held if self._live(h) is not None]

    @staticmethod
    def _live(held: tuple[weakref.ref[HostStore], int, weakref.ref[Any], int]) -> HostStore | None:
        """The store of a held graph still kept there, else None."""
        store, kept = held[0](), held[2]()
        return store if store is not None and kept is not None and store.kept.get(held[1]) is kept else None

    def nbytes(self, *but: HostStore | None) -> int:
        """Predicted bytes of the graphs held here, but those of the stores in ``but`` (the running task's: its
        peak counts them)."""
        with self._lock:
            self._prune()
            return sum(h[3] for h in self._held if not any(h[0]() is s for s in but))

    def drop(self, over: int, spare: tuple[HostStore | None, ...] = ()) -> int:
        """Drop held graphs (but ``spare``'s) until ``over`` bytes are freed, the oldest first; the bytes freed."""
        freed = 0
        with self._lock:
            self._prune()
            for held in list(self._held):
                if freed >= over:
                    break
                store = self._live(held)
                if store is None or any(store is s for s in spare):
                    continue
                if self._take(store, held):
                    freed += held[3]
            self._prune()
        return freed

    def unload(self, running: HostStore | None, release: Callable[[torch.Tensor], None]) -> None:
        """Another task's segment (``running``'s) begins here: the held graphs' loaded parameter copies give their
        bytes back (``release``: the device copier's), so what the device holds is what the cache counts; their
        backward refills them (residency.Kept ``loaded``)."""
        with self._lock:
            for store_ref, index, kept_ref, _ in self._held:
                store, kept = store_ref(), kept_ref()
                if store is None or store is running or kept is None or not kept.loaded:
                    continue
                for t in kept.loaded:
                    release(t)
                kept.loaded, kept.filled = [], False
                self.unloaded += 1

    def drop_of(self, store: HostStore) -> None:
        """Drop ``store``'s held graphs (its task's state leaves this device: a graph over that state would keep
        device storage the cache no longer counts)."""
        with self._lock:
            for held in self._held:
                if self._live(held) is store:
                    self._take(store, held)
            self._prune()

    def _take(self, store: HostStore, held: tuple[weakref.ref[HostStore], int, weakref.ref[Any], int]) -> bool:
        """(the lock held) Pop the held graph from its store, counted as dropped; False when a backward popped it
        first (``dict.pop``: whoever pops first has it)."""
        if store.kept.pop(held[1], None) is held[2]():
            self.dropped += 1
            return True
        return False
