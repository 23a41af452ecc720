"""Units that run with random-number routing only where they draw, guarded: a CPU device's measured segments.

    quiet = QuietUnits(records)                        # records: measured.py (shared by a runtime's CPU devices)
    quiet.begin_segment()                              # a segment of ``key`` is measured (UnitMode, op by op)
    with quiet.measuring(key, mode): ...               # each of its units: which stages drew (by stage name)
    if quiet.allows(key):                              # a later segment of ``key``:
        with quiet.guarded(key, rng):                  #   no router around the unit; raises UnroutedDraw if it
            with quiet.stage_scope("2:Dropout"): ...   #   drew outside the stages routed here

Why: the light router (dispatch.RandomRouter) is a torch-function mode, so every torch call of a unit pays a Python
hook to find the few that draw random numbers: on small models about a sixth of a unit alone and far more when
devices contend for the GIL. The device measured each segment key once op by op; the stages whose calls drew then
(a Dropout, an attention block) are the only ones routed, the rest of the unit runs with no mode at all, and a
segment that drew nothing (evaluation, models without dropout) runs wholly unrouted. Draws outside any stage (in
the loss) keep the key on the router.

Rules (nothing silently wrong): a quiet unit may still draw elsewhere (a draw on some minibatches only, say); an
unrouted CPU draw takes torch's global generator. So the global generator's state is read before and after the
unit (dispatch.global_rng_state; a read that may have fallen in a task's lent window counts as a move); if it
moved, the unit raises ``UnroutedDraw``, the key goes back to the router, and the worker runs the segment again
from its start (the retry of an out-of-memory, without a re-plan): exact. A draw by another thread of the process
in that time (user code outside any task) reads the same: a needless rerun, never a wrong result. Once any task
lent the global generator (a random op without a ``generator`` argument, dispatch.UnitMode._seeded), quiet units
stop for the process: a stray draw inside that window would move the lent stream, not the global one. Stages are
named, not numbered, so a re-plan that cuts the model anew keeps what was measured. One device thread uses an
instance at a time; what was measured (which stages drew, per key) is in the runtime's ``Measurements``, shared by
its CPU devices (measured.py): a key one of them measured runs quiet on the others too.
"""
from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator
from typing import Any

from . import dispatch
from .measured import Measurements
from .rng import TaskRNG
from .seeding import seeding_to

_NULL = contextlib.nullcontext()


class UnroutedDraw(RuntimeError):
    """A unit run without routing drew from torch's global CPU generator: its segment runs again, routed."""


class QuietUnits:
    """Per device: its quiet units; for each measured segment key, the stages whose calls drew, in ``records``
    (see the module docstring)."""

    def __init__(self, records: Measurements | None = None) -> None:
        records = records if records is not None else Measurements()
        self._lock = records.lock
        self._stages = records.stages  # key -> names of the stages that drew
        self.counts = {"quiet": 0, "reruns": 0, "fast_path_reruns": 0}  # (the last: fastpath.py)
        self._mode: dispatch.UnitMode | None = None  # the measured unit's mode, while one runs
        self._drawing: set[str] = set()
        self._inside = 0  # draws seen inside stages, in the measured unit
        self._stray = False  # some unit of the measured segment drew outside every stage
        self._routed: frozenset[str] = frozenset()  # the running quiet unit's stages to route
        self._rng: TaskRNG | None = None

    # -- measuring --------------------------------------------------------------------------------------------
    def begin_segment(self) -> None:
        self._drawing, self._stray = set(), False

    @contextlib.contextmanager
    def measuring(self, key: Hashable, mode: dispatch.UnitMode) -> Iterator[None]:
        """Around a measured unit of segment ``key`` (every unit of it: a recompute replays F's draws)."""
        self._mode, self._inside, before = mode, 0, mode.draws
        try:
            yield
        finally:
            self._mode = None
        self._stray = self._stray or mode.draws - before > self._inside
        with self._lock:
            if self._stray:
                self._stages.pop(key, None)
            else:
                self._stages[key] = frozenset(self._drawing)

    @contextlib.contextmanager
    def _count(self, name: str, mode: dispatch.UnitMode) -> Iterator[None]:
        before = mode.draws
        try:
            yield
        finally:
            if mode.draws > before:
                self._drawing.add(name)
                self._inside += mode.draws - before

    # -- running ----------------------------------------------------------------------------------------------
    def allows(self, key: Hashable) -> bool:
        return key in self._stages and not dispatch.lent_global()

    def stage_scope(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """Around one stage's call: counted while measured, routed in a quiet unit if it drew then, else nothing."""
        mode = self._mode
        if mode is not None:
            return self._count(name, mode)
        if name in self._routed:
            return self._route()
        return _NULL

    def scoped_stages(self) -> frozenset[str] | None:
        """``Device.scoped_stages``: while measured every stage is counted (None); in a quiet unit the stages
        routed; else none."""
        return None if self._mode is not None else self._routed

    def _route(self) -> contextlib.AbstractContextManager[Any]:
        # (inside ``guarded``, which routes this thread's seeding calls to the same stream already)
        return dispatch.router_for(self._rng)

    def guarded(self, key: Hashable, rng: TaskRNG) -> contextlib.AbstractContextManager[None]:
        """Run the unit routing only its drawing stages; raise UnroutedDraw if the global generator moved
        meanwhile (the key goes back to the router)."""
        return _Guarded(self, key, rng)

    def enter(self, key: Hashable, rng: TaskRNG) -> None:
        """``_Guarded``: a quiet unit of ``key`` starts on this device."""
        self._routed, self._rng = self._stages.get(key, frozenset()), rng

    def leave(self) -> None:
        self._routed, self._rng = frozenset(), None

    def moved(self, key: Hashable) -> UnroutedDraw:
        """``_Guarded``: the global generator moved in a quiet unit of ``key``: the key goes back to the router."""
        with self._lock:
            self._stages.pop(key, None)
            self.counts["reruns"] += 1
        return UnroutedDraw(f"a unit of segment {key!r} drew from torch's global CPU generator outside the stages "
                            "measured to draw; it runs again with its draws routed to the task's stream")


class _Guarded:
    """``QuietUnits.guarded``: a class, not a generator (one per unit; a generator's block costs more calls)."""

    __slots__ = ("quiet", "key", "seeding", "before")

    def __init__(self, quiet: QuietUnits, key: Hashable, rng: TaskRNG) -> None:
        self.quiet, self.key, self.seeding = quiet, key, seeding_to(rng)
        self.before: bytes | None = None

    def __enter__(self) -> None:
        self.quiet.enter(self.key, self.seeding.target)
        self.before = dispatch.global_rng_state()
        self.seeding.__enter__()

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        self.seeding.__exit__()
        self.quiet.leave()
        if kind is not None:  # the unit's own error (an out-of-memory, say) is what its retry handles
            return
        if not dispatch.unmoved(self.before):  # moved, or lent: not known unmoved
            raise self.quiet.moved(self.key)
        self.quiet.counts["quiet"] += 1
