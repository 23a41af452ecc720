"""A caller-driven task's segment run in its caller's thread, on the device the scheduler kept on the task.

    lender = Lender(board, task)          # Scheduler.admit gives one to a task with ``attach_lender`` (prepare)
    ran = lender.run(make, after)         # None: not lent (go through the board); True: ran; False: the task ended

Why: a prepared model's call (runner.py) is otherwise four thread hand-offs: the caller's thread to the task's
host thread, which opens the segment, to the device's worker, which runs it, back to the host thread and back to
the caller. For a small model's step those wake-ups cost more than its units. While the policy keeps a device on
the task (its worker waits for the task's next segment: ``Scheduler.take_kept``) and the task's turn there holds
(``Picker.holds``: as a ModelTask's next segment would run there without asking the policy again), the caller's
thread itself opens the segment and runs it on that device (``DeviceWorker.run_lent``), and the worker keeps
waiting: no hand-off at all. Each call is one lent segment; between calls the worker decides again as it does for
any kept task (other tasks that last ran there go first, and its wait ends after ``KEEP_WAIT``), so a prepared loop
holds a device no longer than a ModelTask does.

Rules: the task stays "opening" for the board all along (its host thread waits for the caller's next request and
touches nothing), so no other thread opens or runs it meanwhile; the device runs nothing else while lent, and a
task ended by another thread (cancelled, the runtime closing) ends once its lent segment returned. The caller's
torch state is set aside for the segment (device/lent.py); where it cannot be (autocast, a torch-function mode),
or the device's units must run in its worker (CUDA), the call goes through the board as before.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..device.lent import plain_thread

if TYPE_CHECKING:
    from .admitted import Admitted
    from .scheduler import Scheduler


class Lender:
    """The lent runs of one admitted task (see the module docstring)."""

    def __init__(self, board: Scheduler, task: Admitted) -> None:
        self._board = board
        self._task = weakref.ref(task)  # the task's driver holds this: no cycle keeps an ended task alive

    def run(self, make: Callable[[], Any], after: Callable[[], None]) -> bool | None:
        """Open the segment (``make``), run it on the device kept on the task, then ``after``, all in this thread:
        True; False when the task ended instead (its error is its handle's); None when no device is lent now."""
        task = self._task()
        scope = plain_thread()
        if task is None or scope is None:
            return None
        run = self._board.borrow(task)
        if run is None:
            return None
        ran = follows = False
        try:
            with scope:
                segment = make()
                follows = segment.follows
                if run(task, segment):
                    after()
                    ran = True
        except BaseException as exc:  # an error of its host work (or ours): the task fails with it, as in its chain
            self._board.end(task, "failed", exc)
        finally:
            self._board.give_back(task, ran, follows and ran)
        return ran
