"""Scheduling policies over plain data: which ready task a free device runs next.

    ready = [Ready("a", seq=3, last_device=1, remaining=9.0), Ready("b", seq=1, last_device=0, remaining=2.0)]
    lrtf(ready, device=0, idle=()) == 0          # Sharded-LRTF: the longest remaining work first
    fifo(ready, device=0, idle=()) == 1          # the task that has waited longest
    held = Ready("c", seq=2, last_device=1, held_on=1, held_bytes=4096)   # its state entries are on device 1
    defers([held], device=0, idle=(1,)) is True  # device 1 is free too and takes it: its state stays put

A policy sees only small records, never tensors or threads, so it is tested with exact expected choices and the
simulator replays the very same functions. The runtime asks a policy whenever a device needs its next minibatch
of work: a task's units within one minibatch stay on the device that holds its shards and activations (that is
the affinity that never idles another device: the task has no other unit that could run elsewhere meanwhile).
Between minibatches the affinity weighs what a device already holds (``held_on``, ``held_bytes``: the task's
state entries, training/resident.py), only among the tasks that start now anyway (``lrtf``), and a device leaves
ready tasks whose state another idle device holds to that device (``defers``, asked by the board's ``take``).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Ready:
    """A task whose next unit may run now."""

    task: str
    seq: int                  # when it became ready (a global counter)
    last_device: int | None   # the device its previous unit ran on (and may still hold its state)
    remaining: float = 0.0    # estimated seconds of work left (Estimator.remaining)
    turns: int = 0            # how many times a device has taken it so far
    admitted: int = 0         # admission order
    held_on: int | None = None  # the device holding its state entries now (None: host memory)
    held_bytes: int = 0         # predicted bytes of those entries: what moving it elsewhere writes back and copies in

    def held_by(self, devices: Sequence[int] | set[int]) -> bool:
        """Whether one of ``devices`` holds some of its state."""
        return self.held_on is not None and self.held_bytes > 0 and self.held_on in devices


Policy = Callable[[Sequence[Ready], int, Sequence[int]], int]
"""``policy(ready, device, idle) -> index into ready``: ``device`` asks; ``idle`` lists the other devices that are
waiting for work right now (each will ask right after)."""


def fifo(ready: Sequence[Ready], device: int, idle: Sequence[int] = ()) -> int:
    """The task that has waited longest; among equals, one whose state this device holds, then one that last ran
    on it."""
    return min(range(len(ready)), key=lambda i: (ready[i].seq, not ready[i].held_by({device}),
                                                 ready[i].last_device != device))


def round_robin(ready: Sequence[Ready], device: int, idle: Sequence[int] = ()) -> int:
    """Every task in turn: the one with the fewest turns so far, then the earliest admitted."""
    return min(range(len(ready)), key=lambda i: (ready[i].turns, ready[i].admitted, ready[i].seq))


def lrtf(ready: Sequence[Ready], device: int, idle: Sequence[int] = (), affinity: float = 0.0) -> int:
    """Sharded-LRTF with affinity.

    Rank by estimated remaining time (longest first, then the longest waiting). The first ``1 + len(idle)`` of
    that ranking start now whatever this device takes, so within that window (never beyond it: no task waits
    for affinity) prefer, in this order: a task whose state this device holds (the most bytes first: the other
    one moves), one that last ran here, one whose state no other idle device holds and that did not last run
    on one (that device will take it: moving a resident task writes its state back and copies it in again),
    then the longest. ``affinity`` (a fraction; the runtime's board passes one, the simulator 0): when no other
    device is idle and nothing in the window is here, a task held here or that last ran here whose remaining
    time is at least ``(1 - affinity)`` times the longest's runs instead (its state is here: no move both ways).
    """
    order = sorted(range(len(ready)), key=lambda i: (-ready[i].remaining, ready[i].seq))
    window = order[:1 + len(idle)]
    if affinity and not idle and not any(_here(ready[i], device) for i in window):
        top = ready[window[0]]
        if top.last_device is not None or top.held_on is not None:
            floor = top.remaining * (1 - affinity)
            for i in order[1:]:
                if ready[i].remaining < floor:
                    break
                if _here(ready[i], device):
                    return i
    return pick_in_window(ready, window, device, idle)


def _here(r: Ready, device: int) -> bool:
    return r.held_on == device or r.last_device == device


def pick_in_window(ready: Sequence[Ready], window: Sequence[int], device: int, idle: Sequence[int]) -> int:
    """Within ``window`` (indices into ``ready``, in the policy's order, all of which start now), the one device
    ``device`` takes: see ``lrtf``."""
    here = [i for i in window if ready[i].held_by({device})]
    if here:
        return max(here, key=lambda i: ready[i].held_bytes)  # max keeps the first of equals
    for i in window:
        if ready[i].last_device == device:
            return i
    others = set(idle)
    for i in window:
        if not ready[i].held_by(others) and ready[i].last_device not in others:
            return i
    for i in window:
        if not ready[i].held_by(others):
            return i
    return window[0]


def defers(ready: Sequence[Ready], device: int, idle: Sequence[int] = ()) -> bool:
    """Whether ``device`` should leave every ready task to the other idle devices (it waits meanwhile): each
    one's state is held by one of them, which takes it when it asks (a device leaving the idle ones wakes the
    others). Taking one here would write its state back and copy it in again."""
    others = set(idle)
    return bool(ready) and bool(others) and all(r.held_by(others) for r in ready)


POLICIES: dict[str, Policy] = {"lrtf": lrtf, "fifo": fifo, "round_robin": round_robin}


@dataclass
class Estimator:
    """Smoothed unit times per task and unit kind, turned into a task's estimated remaining seconds.

        est = Estimator(alpha=0.5)
        est.observe("a", "F", 9.0); est.observe("a", "F", 0.2)      # the first (warm-up) one is replaced
        est.observe("a", "F", 0.4)                                  # smoothed F time of task a: 0.3
        est.remaining("a", {"F": 10, "B": 10})                      # B not measured yet: F's time stands in

    A kind not yet measured for a task is guessed as that task's mean measured unit time, and a task with no
    measurement at all as the mean over all tasks (0.0 before anything ran): new tasks are neither starved nor
    favoured by a made-up number.
    """

    alpha: float = 0.5
    _times: dict[str, dict[str, float]] = field(default_factory=dict)
    _counts: dict[tuple[str, str], int] = field(default_factory=dict)
    _mean: float | None = None  # unit_time of a task with no measurement yet (None: to be computed)

    def observe(self, task: str, kind: str, seconds: float) -> None:
        per = self._times.setdefault(task, {})
        seen = self._counts.get((task, kind), 0)
        self._counts[(task, kind)] = seen + 1
        old = per.get(kind)
        # The first unit of a kind pays warm-up costs (first-touch allocations, kernel selection): the second
        # replaces it instead of being averaged with it.
        per[kind] = seconds if old is None or seen == 1 else old + self.alpha * (seconds - old)
        self._mean = None

    def unit_time(self, task: str, kind: str) -> float:
        per = self._times.get(task)
        if per:
            known = per.get(kind)
            return known if known is not None else sum(per.values()) / len(per)
        if self._mean is None:  # the mean over all tasks, kept until the next observe or forget
            known_all = [t for p in self._times.values() for t in p.values()]
            self._mean = sum(known_all) / len(known_all) if known_all else 0.0
        return self._mean

    def remaining(self, task: str, counts: Mapping[str, int]) -> float:
        """Estimated seconds for ``counts`` more units of each kind."""
        # asked for every ready task whenever a device picks one: kinds with no unit left add nothing
        return sum((n * self.unit_time(task, kind) for kind, n in counts.items() if n), 0.0)

    def measured(self, task: str) -> bool:
        """Whether a unit of ``task`` was observed (else its estimate follows the mean over all tasks)."""
        return task in self._times

    def forget(self, task: str) -> None:
        self._mean = None
        self._times.pop(task, None)
        for key in [k for k in self._counts if k[0] == task]:
            del self._counts[key]
