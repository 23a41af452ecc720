"""Scheduling policies over plain data: which ready task a free device runs next.

    ready = [Ready("a", seq=3, last_device=1, remaining=9.0), Ready("b", seq=1, last_device=0, remaining=2.0)]
    lrtf(ready, device=0, idle=()) == 0          # Sharded-LRTF: the longest remaining work first
    fifo(ready, device=0, idle=()) == 1          # the task that has waited longest

A policy sees only small records, never tensors or threads, so it is tested with exact expected choices and the
simulator replays the very same functions. The runtime asks a policy whenever a device needs its next minibatch
of work: a task's units within one minibatch stay on the device that holds its shards and activations (that is
the affinity that never idles another device: the task has no other unit that could run elsewhere meanwhile).
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


Policy = Callable[[Sequence[Ready], int, Sequence[int]], int]
"""``policy(ready, device, idle) -> index into ready``: ``device`` asks; ``idle`` lists the other devices that are
waiting for work right now (each will ask right after)."""


def fifo(ready: Sequence[Ready], device: int, idle: Sequence[int] = ()) -> int:
    """The task that has waited longest; among equals, one that last ran on this device."""
    return min(range(len(ready)), key=lambda i: (ready[i].seq, ready[i].last_device != device))


def round_robin(ready: Sequence[Ready], device: int, idle: Sequence[int] = ()) -> int:
    """Every task in turn: the one with the fewest turns so far, then the earliest admitted."""
    return min(range(len(ready)), key=lambda i: (ready[i].turns, ready[i].admitted, ready[i].seq))


def lrtf(ready: Sequence[Ready], device: int, idle: Sequence[int] = (), affinity: float = 0.0) -> int:
    """Sharded-LRTF with affinity.

    Rank by estimated remaining time (longest first, then the longest waiting). The first ``1 + len(idle)`` of
    that ranking start now whatever this device takes, so within that window prefer a task that last ran here,
    then one that did not last run on another idle device (that device will take it), then the longest.
    ``affinity`` (a fraction; the runtime's board passes one, the simulator 0): when no other device is idle and
    the longest last ran on another device, a task that last ran here whose remaining time is at least
    ``(1 - affinity)`` times the longest's runs instead (its state is here: no move both ways).
    """
    order = sorted(range(len(ready)), key=lambda i: (-ready[i].remaining, ready[i].seq))
    window = order[:1 + len(idle)]
    for i in window:
        if ready[i].last_device == device:
            return i
    top = ready[window[0]]
    if affinity and not idle and top.last_device is not None:
        floor = top.remaining * (1 - affinity)
        for i in order[1:]:
            if ready[i].remaining < floor:
                break
            if ready[i].last_device == device:
                return i
    others = set(idle)
    for i in window:
        if ready[i].last_device not in others:
            return i
    return window[0]


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
