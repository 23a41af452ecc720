"""What a runtime's CPU stand-ins learned by counting segments op by op, kept once for all of them.

    records = Measurements()                              # resolve.py: one per runtime, given to each CpuDevice
    records.verdict(key, here=set())                      # COUNT (count it here), PENDING or KNOWN
    records.begin(key, task)                              # a device counts segment ``key`` (task or class, shapes)
    records.done(key, peak, "cpu:0")                      # ... and finished: its peak, counted there
    records.peak(key, "cpu:1")                            # the peak another device running it uncounted notes

Why: a CPU stand-in counts a segment's allocations op by op the first time it sees the segment's key, and learns
then which stages draw random numbers (quiet.py) and whether every draw was one the light router knows. A device that
kept this to itself counted every key again: two devices starting a search counted the class's first segment side by
side, on one interpreter lock with the caller's next submits, and a trial that moved to another device was counted
once more there. The stand-ins are threads of one process on one CPU: a segment allocates and draws alike on each, so
what one counted holds for the others. (Counting a key once on each device, never beside another count of it, saves
nothing: a count beside other work is what costs. The figures: benchmarks/README.md.)

Rules: a key is KNOWN once a device finished counting it (``done``): the others run it uncounted (quiet or routed, as
the counting device would) and note the peak that device counted for it (the same segment and plan; what else a
device holds while an uncounted segment runs is not in its peak, as for any uncounted segment; adding the counted
bytes to what a device holds instead would count twice the storages that outlive a unit). While a count runs
elsewhere the key is PENDING: a device runs it routed and guarded (CpuDevice: the global generator read before and
after; a move raises UnroutedDraw and that device counts the key itself next, ``here``), never unguarded before its
draws are known. A task or class that drew where the router does not see (``unrouted``) is counted every time, on
every device. One lock guards the records; each device keeps its own account, counters and running unit.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

# classes of equal tasks (training/measure_class.py) whose measured segments the records keep (the latest counted)
MEASURED_CLASSES = 64

COUNT, PENDING, KNOWN = "count", "pending", "known"


class Measurements:
    """The counted segments' records of one runtime's CPU stand-ins (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.begun: dict[Any, set[Any]] = {}  # task or class -> the segment keys a device began counting
        # segment key -> (the device's peak while it counted it, that device): its count is done
        self._done: dict[Any, tuple[int, str]] = {}
        self.unrouted: set[Any] = set()  # tasks and classes whose counted units drew where the router cannot see
        self.stages: dict[Hashable, frozenset[str]] = {}  # segment key -> the stages that drew (quiet.py)
        self._classes: OrderedDict[Any, None] = OrderedDict()  # the classes counted, the latest last
        self._owners: dict[Any, str] = {}  # a class's segment key -> the task it was first counted for

    def verdict(self, key: Any, here: set[Any], limited: bool = False) -> str:
        """How a device runs segment ``key`` now: COUNT it (never begun, its task or class unrouted, the device's test
        limit set, or ``here``: the device's own keys to count again), PENDING or KNOWN."""
        owner = _owner(key)
        if key not in self.begun.get(owner, ()) or owner in self.unrouted or limited or key in here:
            return COUNT
        return KNOWN if key in self._done else PENDING

    def begin(self, key: Any, task: str | None) -> None:
        """A device counts ``key`` now (for ``task``); a class is kept among the latest MEASURED_CLASSES."""
        owner = _owner(key)
        with self.lock:
            self.begun.setdefault(owner, set()).add(key)
            if isinstance(owner, str):
                return
            if task is not None:
                self._owners.setdefault(key, task)
            # (noted when counted, not at every unit: a class let go while in use is counted again, once)
            self._classes[owner] = None
            self._classes.move_to_end(owner)
            while len(self._classes) > MEASURED_CLASSES:
                self._forget(self._classes.popitem(last=False)[0])

    def done(self, key: Any, peak: int, device: str) -> None:
        """``device`` finished counting ``key``, its bytes at most ``peak`` meanwhile."""
        with self.lock:
            if key in self.begun.get(_owner(key), ()):  # (not let go meanwhile)
                self._done[key] = (peak, device)

    def peak(self, key: Any, device: str) -> int:
        """The peak KNOWN ``key`` was counted with, for ``device`` to note: 0 on the device that counted it (its peak
        has it)."""
        peak, counted_on = self._done.get(key, (0, device))
        return 0 if counted_on == device else peak

    def note_unrouted(self, owner: Any) -> None:
        self.unrouted.add(owner)

    def shares(self, key: Any, task: str, quiet: bool) -> bool:
        """Whether ``task`` runs segment ``key`` of its class as the class: not counted yet (it counts it for the
        class), counted for ``task`` itself, its count still running (PENDING: guarded), or counted with every draw
        inside a stage it routes (``quiet``, and not unrouted)."""
        owner = key[0]
        if key not in self.begun.get(owner, ()) or self._owners.get(key) == task or key not in self._done:
            return True
        return owner not in self.unrouted and quiet

    def forget(self, task: Any) -> None:
        """``task`` ended (or a class fell out of the latest): what was learned of it goes (a later task may take its
        name, and the records would grow with every task the runtime saw)."""
        with self.lock:
            self._forget(task)

    def _forget(self, task: Any) -> None:
        for key in self.begun.pop(task, ()):
            self._done.pop(key, None)
        self.unrouted.discard(task)
        for key in [k for k in self.stages if isinstance(k, tuple) and k[:1] == (task,)]:
            del self.stages[key]
        if self._owners:  # (a later task of that name is no class key's counter)
            self._owners = {k: v for k, v in self._owners.items() if v != task and k[0] != task}


def _owner(key: Any) -> Any:
    return key[0] if isinstance(key, tuple) else key
