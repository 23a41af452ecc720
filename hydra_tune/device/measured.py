"""What a runtime's CPU stand-ins learned by counting segments op by op, kept once for all of them.

    records = Measurements()                              # resolve.py: one per runtime, given to each CpuDevice
    records.verdict(key, here=set())                      # COUNT (count it here), PENDING or KNOWN
    records.begin(key, task)                              # a device counts segment ``key`` (task or class, shapes)
    records.done(key, transient)                          # ... and finished: it allocated ``transient`` bytes more
    records.transient(key)                                # what a device running ``key`` uncounted adds to its peak

Why: a CPU stand-in counts a segment's allocations op by op the first time it sees the segment's key, and learns
then which stages draw random numbers (quiet.py) and whether every draw was one the light router knows. Each device
used to keep what it learned to itself, so each device counted every key again: a class of equal trials was
counted once per device, a trial that moved to another device was counted once more there, and two devices starting
a search each paid a counted unit (several times a plain one: ~80 ms for a 4-layer GPT-2 minibatch) side by side.
The stand-ins are threads of one process on one CPU: a segment allocates and draws alike on each, so what one counted
holds for the others.

Rules: a key is KNOWN once a device finished counting it (``done``): the others run it uncounted (quiet or routed, as
the counting device would) and add its ``transient`` bytes to their peak. While a count runs elsewhere the key is
PENDING: a device runs it routed and guarded (CpuDevice: the global generator read before and after; a move raises
UnroutedDraw and that device counts the key itself next, ``here``), never unguarded before its draws are known. A
task or class that drew where the router does not see (``unrouted``) is counted every time, on every device. One
lock guards the records; each device keeps its own account, counters and running unit.
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
        self._transient: dict[Any, int] = {}  # segment key -> bytes its count allocated above its start: done
        self.unrouted: set[Any] = set()  # tasks and classes whose counted units drew where the router cannot see
        self.stages: dict[Hashable, frozenset[str]] = {}  # segment key -> the stages that drew (quiet.py)
        self._classes: OrderedDict[Any, None] = OrderedDict()  # the classes counted, the latest last
        self._owners: dict[Any, str] = {}  # a class's segment key -> the task it was first counted for

    def verdict(self, key: Any, here: set[Any], limited: bool = False) -> str:
        """How a device runs segment ``key`` now: COUNT it (never begun, its task or class unrouted, the device's
        test limit set, or ``here``: the device's own keys to count again), PENDING or KNOWN."""
        owner = _owner(key)
        if key not in self.begun.get(owner, ()) or owner in self.unrouted or limited or key in here:
            return COUNT
        return KNOWN if key in self._transient else PENDING

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

    def done(self, key: Any, transient: int) -> None:
        """A device finished counting ``key``: its units allocated ``transient`` bytes above what it held then."""
        with self.lock:
            if key in self.begun.get(_owner(key), ()):  # (not let go meanwhile)
                self._transient[key] = max(transient, self._transient.get(key, 0))

    def transient(self, key: Any) -> int:
        return self._transient.get(key, 0)

    def note_unrouted(self, owner: Any) -> None:
        self.unrouted.add(owner)

    def shares(self, key: Any, task: str, quiet: bool) -> bool:
        """Whether ``task`` runs segment ``key`` of its class as the class: not counted yet (it counts it for the
        class), counted for ``task`` itself, its count still running (PENDING: guarded), or counted with every draw
        inside a stage it routes (``quiet``, and not unrouted)."""
        owner = key[0]
        if key not in self.begun.get(owner, ()) or self._owners.get(key) == task or key not in self._transient:
            return True
        return owner not in self.unrouted and quiet

    def forget(self, task: Any) -> None:
        """``task`` ended (or a class fell out of the latest): what was learned of it goes (a later task may take its
        name, and the records would grow with every task the runtime saw)."""
        with self.lock:
            self._forget(task)

    def _forget(self, task: Any) -> None:
        for key in self.begun.pop(task, ()):
            self._transient.pop(key, None)
        self.unrouted.discard(task)
        for key in [k for k in self.stages if isinstance(k, tuple) and k[:1] == (task,)]:
            del self.stages[key]
        if self._owners:  # (a later task of that name is no class key's counter)
            self._owners = {k: v for k, v in self._owners.items() if v != task and k[0] != task}


def _owner(key: Any) -> Any:
    return key[0] if isinstance(key, tuple) else key
