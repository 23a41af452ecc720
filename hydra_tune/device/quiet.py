"""Units that run with no random-number routing at all, guarded: a CPU device's segments that drew nothing.

    quiet = QuietUnits()
    quiet.measured(key, drew=bool(mode.seeded))       # after a measured (UnitMode) segment of ``key``
    if quiet.allows(key):
        with quiet.guarded(key, rng): ...            # the unit: no per-call router; raises UnroutedDraw if it drew

Why: the light router (dispatch.RandomRouter) is a torch-function mode, so every torch call of a unit pays a Python
hook to find the few that draw random numbers: on small models about a sixth of a unit alone and far more when
devices contend for the GIL. Most segments draw nothing (evaluation, models without dropout), and the device
measured each segment key once op by op (UnitMode.seeded says whether it drew): those run without any mode.

Rules (nothing silently wrong): a unit run this way may still draw (a draw on some minibatches only, say); an
unrouted CPU draw takes torch's global generator. So the global generator's state is read before and after the
unit (under the lock that lending it takes, dispatch._GLOBAL_RNG_LOCK); if it moved, the unit raises
``UnroutedDraw``, the key is routed from then on, and the worker runs the segment again from its start (the
retry of an out-of-memory, without a re-plan): exact. A draw by another thread of the process in that time
(user code outside any task) reads the same: a needless retry, never a wrong result. Once any task lent the global
generator (a random op without a ``generator`` argument, dispatch.UnitMode._seeded), quiet units stop for the
process: a quiet unit's stray draw inside that window would move the lent stream, not the global one.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable, Iterator

import torch

from . import dispatch
from .rng import TaskRNG
from .seeding import seeding_to


class UnroutedDraw(RuntimeError):
    """A unit run without routing drew from torch's global CPU generator: its segment runs again, routed."""


class QuietUnits:
    """Per device: the segment keys measured to draw no random numbers, run unrouted with the guard."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._quiet: set[Hashable] = set()
        self.counts = {"quiet": 0, "reruns": 0}

    def measured(self, key: Hashable, drew: bool) -> None:
        """A measured unit of segment ``key`` ran; ``drew``: it drew random numbers on the CPU."""
        with self._lock:
            if drew:
                self._quiet.discard(key)
            else:
                self._quiet.add(key)

    def allows(self, key: Hashable) -> bool:
        return key in self._quiet and not dispatch.lent_global()

    def forget(self, task: str) -> None:
        with self._lock:
            self._quiet = {k for k in self._quiet if not (isinstance(k, tuple) and k and k[0] == task)}

    @contextlib.contextmanager
    def guarded(self, key: Hashable, rng: TaskRNG) -> Iterator[None]:
        """Run the unit with only the task's seeding calls routed; raise UnroutedDraw if the global generator
        moved meanwhile (the key is routed from then on)."""
        before = dispatch.global_rng_state()
        with seeding_to(rng):
            yield None
        if not torch.equal(before, dispatch.global_rng_state()):
            with self._lock:
                self._quiet.discard(key)
                self.counts["reruns"] += 1
            raise UnroutedDraw(f"a unit of segment {key!r} measured to draw no random numbers drew from torch's "
                               "global CPU generator; it runs again with its draws routed to the task's stream")
        self.counts["quiet"] += 1
