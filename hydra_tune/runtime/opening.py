"""The board's openings: a task's next segment opened by its host thread, by the device kept on it
(``open_here``, whose light runs go on while ``keeps`` says so), or by its caller's thread on a lent device (lend.py).

    board._open(task)                 # in the task's host thread (host.py): the chain advanced, the task queued
    board.open_here(task, 0)          # in device 0's thread, kept on the task (worker.py); board.keeps(task, 0)
    run = board.borrow(task)          # a caller-driven task: the device kept on it, lent for one segment, or None
    board.give_back(task, ran)

Rules: the chain advances outside the board's lock (its host work may take long or block); what it opened is
handed to the device kept on the task or queued under the lock; a task that ended meanwhile is let go by whoever
opened it. Mixed into Scheduler (scheduler.py), whose attributes and lock it uses.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import TaskCancelled
from ..training.segments import Segment
from .admitted import Admitted

# How long a device waits, past other work and the policy's turn, for a task's segment that completes its last one
# (Segment.follows: a prepared training forward's backward, the loop's next call after its loss): a ModelTask's
# step is one segment (F.. L B..), a prepared step two; the device keeps the pair together, as for the ModelTask, and
# its graph kept for the backward stays usable (the backward on another device recomputes that forward).
FOLLOW = 0.05  # (KEEP_WAIT's least: 20 ms was passed on a loaded 2-core box, now and then)

Lend = Callable[[Admitted, Any], bool]  # a device's run of a task's segment in the calling thread (DeviceWorker.run_lent)

if TYPE_CHECKING:
    from .picker import Picker


class Openings:
    """Mixed into Scheduler (see the module docstring)."""

    _lock: threading.RLock
    cond: threading.Condition
    _tasks: dict[str, Admitted]
    _closed: bool
    _lenders: dict[int, Lend]
    _picker: Picker
    _ready: list[tuple[int, Admitted]]
    _idle: set[int]
    _seq: int

    # (and Scheduler's end(), _push() and _off_device())

    # -- the host threads' work -------------------------------------------------------------------------------
    def _open(self, task: Admitted, here: int | None = None,
              spent: Callable[[], float] | None = None) -> Admitted | None:
        """In ``task``'s host thread: advance its chain to the next segment (the host work before it), then put
        it in the ready queue or hand it to the device waiting for it; end it when its chain is done or failed.
        A task that ended meanwhile is let go here. ``here``: the device kept on the task opens it itself
        (``Scheduler.open_here``), in the same hold of the lock: ``task`` when it got its segment, else None.
        ``spent()``: seconds of the opening that were units, not host work (training/light_run.py)."""
        t0 = time.perf_counter()
        segment, status, error = self._advance(task)
        if spent is not None:
            t0 += spent()
        nxt = None
        with self._lock:
            live, free = self._opened(task, t0, segment, status, here is not None)
            if here is not None:
                if live and status is None and task.kept_by == here and not self._closed:
                    nxt = task
                task.kept_by = None
        del segment
        self._after_opening(task, live, free, status, error)
        return nxt

    def _advance(self, task: Admitted) -> tuple[Segment | None, str | None, BaseException | None]:
        """Outside the lock: the task's next segment from its chain, or how the chain ended (a task that ended
        meanwhile is not advanced; reading the dict needs no lock, its entry only goes)."""
        if self._tasks.get(task.name) is not task:
            return None, None, None
        try:
            return next(task.chain), None, None
        except StopIteration:
            return None, "done", None
        except BaseException as exc:  # one task's failure is that task's alone
            return None, "failed", exc

    def _opened(self, task: Admitted, t0: float, segment: Segment | None, status: str | None,
                here: bool) -> tuple[bool, bool]:
        """Under the lock, after ``_advance``: the segment handed to the device kept on it (``here``: that device
        opened it itself; no one else waits for it) or queued; (whether the task is still on the board, whether
        it is to be let go now)."""
        task.opening = False
        task.open_seconds = time.perf_counter() - t0
        live = self._tasks.get(task.name) is task
        if live and status is None:
            task.segment = segment
            if segment is not None and segment.handover:  # the policy gave the device to another task: queued
                task.kept_by = None
            if task.kept_by is not None:
                if not here:
                    self.cond.notify_all()  # the device waiting for it takes it
            elif not self._closed:  # closing: close() ends it
                self._push(task)
        return live, task.released

    def _after_opening(self, task: Admitted, live: bool, free: bool, status: str | None,
                       error: BaseException | None) -> None:
        if free:
            self._let_go(task)
        elif live and status is not None:
            self.end(task, status, error)

    def _let_go(self, task: Admitted) -> None:
        task.let_go()
        with self._lock:
            task.state = None  # type: ignore[assignment]  # drop the model, optimizer and store now

    # -- a caller-driven task's segments in its caller's thread (lend.py) ------------------------------------
    def add_lender(self, index: int, run: Lend) -> None:
        """Device ``index``'s units may run in a caller's thread: ``run(task, segment)`` there."""
        self._lenders[index] = run

    def borrow(self, task: Admitted) -> Lend | None:
        """For ``task``, opening (its host thread waits for its caller): the run of the device kept on it, lent to
        the calling thread for one segment, while the policy's turn holds there (an idle device has nothing ready
        to run: the queue would have given it work); None: the segment goes through the board."""
        with self.cond:
            index = task.kept_by
            if (index is None or index not in self._lenders or self._closed or task.lent is not None
                    or not task.opening or self._tasks.get(task.name) is not task or task.handle.cancel_requested
                    or not self._due(task, index)):
                return None
            task.lent, task.lent_by = index, threading.get_ident()
            return self._lenders[index]

    def keeps(self, task: Admitted, index: int, granted: bool = False) -> bool:
        """Whether device ``index``, opening ``task``'s next segment itself (``open_here``), goes on with it now (a
        kept light task's next minibatch in the device's thread: training/light_run.py): it is not cancelled, the
        board is open, and the policy picked it just now (``granted``), or its policy turn holds there
        (``Picker.holds``), or, that turn over, the policy asked now as at a segment's end picks it again (its
        turn starts anew: no segment just to hand the device back)."""
        with self._lock:
            if self._closed or self._tasks.get(task.name) is not task or task.handle.cancel_requested:
                return False
            if granted or self._picker.holds(task, index, self._idle, bool(self._ready)):
                return True
            state = task.state
            return state is not None and any(state.remaining().values()) and self._picks(task, index)

    def open_here(self, task: Admitted, index: int, spent: Callable[[], float] | None = None) -> Admitted | None:
        """As ``ran(task, index, keep=True)`` followed by ``take_kept``, with the host work run in the calling
        device thread (``TaskState.light_host_work``: a short step over list data), which saves the two thread
        hand-offs a segment costs otherwise: ``task`` with its next segment open, or None when it ended, was
        cancelled or the board closed. Two holds of the lock, not four: a segment each."""
        with self._lock:
            opening, cancelled = self._off_device(task, index, index)
        if cancelled:
            self.end(task, "cancelled", TaskCancelled(f"task {task.name!r} was cancelled"))
        if not opening:
            return None
        return self._open(task, here=index, spent=spent)  # as its host thread would: kept_by set, handed back here

    def give_back(self, task: Admitted, ran: bool, follows: bool = False) -> None:
        """The lent segment of ``task`` ended (``ran``: it ran whole; ``follows``: its next completes it, see
        Segment.follows): its device decides again; a task cancelled meanwhile ends now."""
        with self.cond:
            task.lent = task.lent_by = None
            task.lent_segments += ran
            waited, task.follows = task.follows, self.follow_until() if follows else 0.0
            # a device that stayed for this segment goes on (``wait_kept``): woken only where it would not wait on
            # (another task ready, or it owes a choice); else its wake-up would cost the caller's thread the GIL
            if waited and (self._ready or task.owes):
                self.cond.notify_all()
            if task.lent_waiters:
                self.cond.notify_all()
            cancelled = self._tasks.get(task.name) is task and task.handle.cancel_requested
        if cancelled:
            self.end(task, "cancelled", TaskCancelled(f"task {task.name!r} was cancelled"))

    # -- a segment that completes the last one (Segment.follows) -------------------------------------------
    @staticmethod
    def follow_until() -> float:
        """Until when the devices wait for the segment that completes a task's last one (``FOLLOW``)."""
        return time.perf_counter() + FOLLOW

    def _due(self, task: Admitted, index: int) -> bool:
        """Under the lock: whether device ``index``, kept on ``task``, runs its next segment now: within its turn;
        when it completes the last one (a prepared forward's backward: the turn is the step's, as an L unit is);
        or when the policy, asked now as the device would ask it, picks ``task`` (its turn starts anew)."""
        if self._picker.in_turn(task, index):
            return True
        if task.follows > time.perf_counter():
            task.follow_waits += 1
            return True
        if self._picks(task, index):
            task.lent_picks += 1
            return True
        return False

    def _picks(self, task: Admitted, index: int) -> bool:
        """Under the lock: whether the policy gives device ``index`` to ``task`` (as if ready now, last run there)
        over the ready tasks it may take; if so, ``task``'s turn there starts (as after any pick)."""
        cands = [(seq, a) for seq, a in self._ready if a.set_aside in (None, index)] + [(self._seq + 1, task)]
        records = self._picker.records(index, cands, task)
        if self._picker.pick(records, index, sorted(self._idle - {index})) != len(cands) - 1:
            return False
        self._picker.picked(task, index)
        return True

    def _stays(self, task: Admitted, index: int) -> bool:
        """Under the lock, device ``index`` finishing ``task``'s segment that its next completes (``choose_next``):
        it stays for that one. Out of its turn, the policy is asked as at any segment's end, so a pick of ``task``
        starts its turn anew there (its next step may run lent); a pick of another counts here, and once the pair
        ran the device chooses again (``owes``: ``wait_kept`` ends, the next segment of ``task`` is queued)."""
        if not self._picker.in_turn(task, index) and not self._picks(task, index):
            task.follow_waits += 1
            task.owes = True  # once the pair ran, the device chooses again (``wait_kept``): no kept hand-over
        return True

    def wait_kept(self, task: Admitted, done: Callable[[], bool], other: Callable[[], bool], wait: float) -> None:
        """Under the lock, in ``take_kept``: wait up to ``wait`` seconds until ``done()``, or until ``other()`` (a
        ready task to run instead), but while ``task``'s next segment completes its last one (``follows``) other
        work waits for it (a few microseconds of the caller's work: the loss between forward and backward), past
        ``wait`` too."""
        # (not renewed by its lent segments: a loop that calls again and again would keep the device for good, as
        # a task that is not ready, not opening, is no candidate of the policy's; the device chooses again then)
        deadline = time.perf_counter() + wait
        stayed = False
        while not done():
            now = time.perf_counter()
            patient = task.follows > now
            if not patient and (now >= deadline or task.owes or other()):
                break
            if patient and not stayed and (now >= deadline or other()):
                stayed = True
                task.follow_waits += 1
            self.cond.wait(task.follows - now if patient else deadline - now)
        task.owes = False

    def _wait_lent(self, task: Admitted) -> None:
        """Under the lock: wait for ``task``'s lent segment to end (a few units: it is not interrupted)."""
        task.lent_waiters += 1
        try:
            self.cond.wait_for(lambda: task.lent is None)
        finally:
            task.lent_waiters -= 1
