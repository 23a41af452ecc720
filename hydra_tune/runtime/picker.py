"""The policy's view of the board's ready tasks: remaining-time estimates and the small records a policy reads.

    picker = Picker("lrtf")                        # the policy by name (lrtf with the board's AFFINITY band)
    picker.estimator.observe("a", "F0", 0.01)      # a unit ran: feeds the estimates
    pos = picker.pick(picker.records(0, cands, current=None), 0, idle=[1])
    picker.defers(0, ready, idle={1})              # device 0 leaves every ready task to device 1
    picker.local(0, floor, ready)                  # the entry picked among the tasks that last ran on device 0
    picker.picked(task, 0); picker.holds(task, 0, idle={0}, ready=True)   # its turn on device 0 (LRTF: TURN seconds)

Rules: every method runs with the board's lock (``Scheduler.cond``) held and only reads the tasks it is given,
except that an estimate and a Ready record are cached on the task (``Admitted.left``, ``Admitted.record``) while
their fields are unchanged, and a pick's turn (``Admitted.turn``). The policy itself (policy/schedule.py) sees only
the records, never tasks or threads.
"""
from __future__ import annotations

import functools
import time

from ..policy.schedule import POLICIES, Estimator, Ready, defers, lrtf
from .admitted import Admitted

# LRTF's affinity band here (policy/schedule.py lrtf): estimates of equal tasks differ by tens of percent on a busy
# machine, and without it small tasks moved their state between devices about every fourth segment.
AFFINITY = 0.3

# A task LRTF picked for a device keeps it, without the policy being asked again, for this many seconds of short
# segments while no other device waits for ready work: asking (every ready task's record, then a sort) after each
# segment of a small model cost about a tenth of the segment, and each change of task about a millisecond more (the
# other task's light run set up and its state warmed in the caches): 0.1 s against 0.02 took 4-5% off 40 small
# trials on one device (benchmarks/small_trials.py's MLP). A segment longer than this asks every time. FIFO and
# round-robin take turns per segment, as they say.
TURN = 0.1


class Picker:
    """The named policy and the remaining-time estimates of one board (see the module docstring)."""

    def __init__(self, policy: str) -> None:
        self.pick = functools.partial(lrtf, affinity=AFFINITY) if policy == "lrtf" else POLICIES[policy]
        self.estimator = Estimator()
        self.turn = TURN if policy == "lrtf" else 0.0  # how long a pick holds (0: every segment asks)

    def picked(self, task: Admitted, index: int) -> None:
        """The policy gave ``task`` to device ``index``: its turn there starts."""
        if self.turn:
            task.turn = (index, time.perf_counter() + self.turn)

    def holds(self, task: Admitted, index: int, idle: set[int], ready: bool) -> bool:
        """Whether ``task``, finishing a segment on device ``index``, is within its turn there with work left and no
        other device waiting for work while some is ready (``idle``; ``ready``: the ready queue is not empty): the
        device goes on with it without a pick. With nothing ready, a pick could only give ``task`` back to this
        device, so another device idling for want of work does not end the turn (a lone trial on a runtime of
        several devices: the end of every search)."""
        state = task.state
        return (self.in_turn(task, index) and (not ready or idle <= {index}) and state is not None
                and any(state.remaining().values()))

    @staticmethod
    def in_turn(task: Admitted, index: int) -> bool:
        """Whether the policy's last pick of ``task`` for device ``index`` still holds (its turn there)."""
        turn = task.turn
        return turn is not None and turn[0] == index and time.perf_counter() < turn[1]

    def estimate(self, task: Admitted, current: bool = False) -> float:
        """``task``'s estimated seconds left, kept while it waits in the ready queue (its state and unit times
        change only when it runs; a task not measured yet follows the mean over all, so it is asked anew)."""
        if task.left is not None and not current:
            return task.left
        left = self.estimator.remaining(task.name, task.state.remaining())
        if not current and self.estimator.measured(task.name):
            task.left = left
        return left

    def records(self, index: int, cands: list[tuple[int, Admitted]], current: Admitted | None) -> list[Ready]:
        """The policy's view of ``cands`` for device ``index`` (``current``: as if ready now, last run here)."""
        return [self._record(index, seq, a, a is current) for seq, a in cands]

    def _record(self, index: int, seq: int, task: Admitted, current: bool) -> Ready:
        """``task``'s Ready record, reused while its fields are unchanged (with many ready tasks, making a frozen
        record for each at every pick was a large part of a small model's segment)."""
        key = (seq, index if current else task.last_device, self.estimate(task, current), task.turns + current,
               *task.state.home.holder())
        kept = task.record
        if kept is None or kept[0] != key:
            kept = task.record = (key, Ready(task.name, key[0], key[1], key[2], key[3], task.order, key[4], key[5]))
        return kept[1]

    def defers(self, index: int, ready: list[tuple[int, Admitted]], idle: set[int]) -> bool:
        """Whether device ``index`` leaves every ``ready`` task to the other ``idle`` devices holding their state
        (policy.schedule.defers); only where they hold state are the records built (cheap for the common case)."""
        others = idle - {index}
        if not others:
            return False
        held = [(a.last_device, *a.state.home.holder()) for _, a in ready]
        return defers([Ready(a.name, seq, last, 0.0, 0, 0, on, nbytes)
                       for (seq, a), (last, on, nbytes) in zip(ready, held)], index, sorted(others))

    def mine(self, task: Admitted, index: int, floor: float) -> bool:
        """Whether ``task`` last ran on device ``index``, is not set aside for another, and has at least ``floor``
        estimated seconds left."""
        return task.last_device == index and task.set_aside in (None, index) and self.estimate(task) >= floor

    def local(self, index: int, floor: float, ready: list[tuple[int, Admitted]]) -> tuple[int, Admitted] | None:
        """The ``ready`` entry the policy picks among the tasks that last ran on device ``index`` with at least
        ``floor`` estimated seconds left (None: there is none)."""
        local = [(seq, a, self.estimate(a)) for seq, a in ready if self.mine(a, index, floor)]
        if not local:
            return None
        records = [Ready(a.name, seq, index, left, a.turns, a.order) for seq, a, left in local]
        seq, task, _ = local[self.pick(records, index, [])]
        return seq, task
