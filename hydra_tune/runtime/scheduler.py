"""The runtime's task board: admitted tasks, their host threads, the ready queue, and which task each device runs next.

    board = Scheduler("lrtf", on_end=cleanup)      # on_end(task, status, error): free what an ended task held
    task = board.admit(handle, state, footprint)   # its host thread opens its first segment, then it is ready
    task = board.take(device_index)                # blocks; the task's next segment is open (task.segment)
    board.ran(task, device_index, keep=False)      # its segment ran: its host thread opens the next one
    task = board.take_kept(device_index, task)     # keep=True: wait (briefly) for that task's next segment
    board.end(task, "failed", error)               # once per task; later calls do nothing

Rules: a task is opening its next segment (in its host thread, host.py), in the ready queue, or on one device, never
two of these, so one thread at a time touches its state and it runs on one device at a time. Opening a segment
advances the task's chain (training/loop.py): the plain loop's host work before it (the optimizer step, the next
batch) runs in the task's own host thread, never a device's, so a data iterator that blocks stalls only its task;
the queue holds only tasks whose segment is open, so a device never waits on data. The policy (policy/schedule.py)
picks among the ready tasks with remaining-time estimates that include every unit measured so far (an LRTF pick
holds for a short turn of small segments: picker.py ``TURN``); when it keeps a
device on the task whose segment is ending, the device waits for that task's next segment while its host work
takes about as long as it usually does (``KEEP_WAIT``), then runs other ready tasks (one that last ran there with
about as much work left runs at once instead of the wait; no device with other work takes the kept task then). A
task's failure or cancellation ends that task only; cancelling a task whose host thread is opening ends it at
once, and its chain is let go when that thread returns (a thread that never returns is reported by
``wait_hosts``). One lock (``cond``) guards the board; ``on_end`` runs outside it.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import RuntimeClosed, TaskCancelled, rule_error
from ..training.footprint import Footprint
from ..training.state import TaskState
from .admitted import Admitted
from .handle import TaskHandle
from .host import HostThread
from .lend import Lender
from .opening import Lend, Openings
from .picker import AFFINITY, Picker

# How long a device waits for the next segment of the task the policy kept it on: 4 times that task's last opening
# (its host work: optimizer step, next batch), at least 50 ms, at most 1 s; past that it runs other ready tasks
# (a data iterator that blocks holds no device longer than that).
KEEP_WAIT = (4.0, 0.05, 1.0)
IDLE_AFTER = 0.01  # seconds a device waits in take() before it counts as idle (on_idle)


EndHook = Callable[[Admitted, str, "BaseException | None"], None]


class Scheduler(Openings):
    """Admitted tasks and the ready queue of one runtime (see the module docstring)."""

    def __init__(self, policy: str, on_end: EndHook, history: int | None = None) -> None:
        self.policy = policy
        self._history = history      # ended tasks' records kept (the newest; None: all)
        self._dropped = 0            # records dropped past it
        self._picker = Picker(policy)  # the policy and the remaining-time estimates
        self._on_end = on_end
        # One re-entrant lock guards the board; ``cond`` waits and wakes on it. Code that neither waits nor wakes
        # enters ``_lock`` itself (a C call; entering the Condition is a Python call, several per segment).
        self._lock = threading.RLock()
        self.cond = threading.Condition(self._lock)
        self._ready: list[tuple[int, Admitted]] = []  # (its place: when it left a device, task)
        self._tasks: dict[str, Admitted] = {}
        self._finished: dict[str, dict[str, Any]] = {}
        self._left: list[HostThread] = []  # host threads of ended tasks, until they have ended too
        self._seq = 0
        self._admitted = 0
        self._closed = False
        self._idle: set[int] = set()
        self._lenders: dict[int, Lend] = {}  # devices whose units may run in a caller's thread (lend.py)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- tasks in and out -------------------------------------------------------------------------------------
    def admit(self, handle: TaskHandle, state: TaskState, footprint: Footprint | None) -> Admitted:
        """Put a built task on the board: its host thread opens its first segment, then it is ready. Raises if the
        board is closed, the task was cancelled, or its name or model is already running."""
        name = handle.name
        with self.cond:
            if self._closed:
                raise RuntimeClosed(f"the runtime was closed before task {name!r} started")
            if handle.cancel_requested:
                raise TaskCancelled(f"task {name!r} was cancelled")
            if name in self._tasks:
                raise rule_error("task names are unique among running tasks", "give each ModelTask its own "
                                 "`name`", name=name)
            self._check_model(name, state.model)
            self._admitted += 1
            task = Admitted(handle, state, self._admitted, footprint, self._open)
            self._tasks[name] = task
            task.since, task.opening = self._next_seq(), True
            attach = getattr(state.task, "attach_lender", None)  # a caller-driven task (hydra_tune.prepare)
            if attach is not None and self._lenders:
                attach(Lender(self, task))
            task.host.start()
            task.host.request()  # under the lock: while it is opening, its host thread has work to do
        return task

    def check_model_free(self, name: str, model: Any) -> None:
        """Raise if ``model`` is trained by a running task now: called before a task's build touches its model (the
        module it was given, at submit; the one its factory returned, by ``TaskState.build``'s claim), since the
        build measures it (forward, backward, gradients put back) while the other task's thread steps it, a race
        torch can abort the process on. ``admit`` checks once more under the same lock."""
        with self.cond:
            self._check_model(name, model)

    def _check_model(self, name: str, model: Any) -> None:
        shared = [n for n, a in self._tasks.items() if a.state is not None and a.state.model is model]
        if shared:
            raise rule_error("each running task trains its own model object", "pass a factory "
                             "(`lambda: MyModel()`) or a fresh module per task", task=name, model_also_in=shared[0])

    def end(self, task: Admitted, status: str, error: BaseException | None = None) -> None:
        """End ``task`` (done, failed, cancelled): off the board, its record kept for ``stats``, then ``on_end``;
        its chain and state are let go last (by its host thread, if that is opening a segment now). A task that
        already ended is left alone."""
        with self.cond:
            if self._tasks.get(task.name) is not task:
                return  # already ended (e.g. finished while the runtime was closing)
            if task.lent is not None and task.lent_by != threading.get_ident():
                self._wait_lent(task)  # its caller's segment on a device ends first (lend.py)
                if self._tasks.get(task.name) is not task:
                    return
            del self._tasks[task.name]
            self._ready = [(q, a) for q, a in self._ready if a is not task]
            record = dict(task.stats(), state=status)
            self._keep_record(task.name, record)
            self._picker.estimator.forget(task.name)
            self._left = [h for h in self._left if h.alive] + [task.host]
            self.cond.notify_all()  # a device waiting for its next segment stops waiting
        task.host.stop()
        self._on_end(task, status, error)
        with self.cond:
            record.update(residency=task.state.home.stats())  # with what on_end wrote back
            task.released = True
            free = not task.opening  # else its host thread lets it go when its work returns
        if free:
            self._let_go(task)

    def _keep_record(self, name: str, record: dict[str, Any]) -> None:
        """Under the lock: keep an ended task's record, the newest ``history`` only (a node server runs for weeks)."""
        self._finished.pop(name, None)  # a reused name moves to the newest end
        self._finished[name] = record
        while self._history is not None and len(self._finished) > self._history:
            del self._finished[next(iter(self._finished))]
            self._dropped += 1

    def cancel(self, handle: TaskHandle) -> Admitted | None:
        """Mark ``handle``'s task cancelled; if it waits in the ready queue or its host thread is opening its next
        segment (maybe blocked in its data iterator), take it off and return it (the caller ends it now). A task
        on a device stops at its next unit boundary. A task whose last metrics are out (``state.trained``: its
        host thread is only ending its chain) ends as done: a Tune trial stopped at its last report is complete."""
        with self.cond:
            handle.cancel_requested = True
            task = self._tasks.get(handle.name)
            if task is None or task.handle is not handle:
                return None
            if task.opening and task.lent is None:  # (a lent segment is on a device: give_back ends it)
                return None if getattr(task.state, "trained", False) else task
            if not any(a is task for _, a in self._ready):
                return None
            self._ready = [(q, a) for q, a in self._ready if a is not task]
        return task

    def fail_all(self, error: BaseException) -> None:
        """A fault of the board itself (a device could not take work): end every admitted task with ``error``
        rather than leave it waiting for a device that cannot pick it."""
        with self.cond:
            tasks = list(self._tasks.values())
        for task in tasks:
            self.end(task, "failed", error)

    def close(self) -> list[Admitted] | None:
        """Stop handing out work (waiting devices wake up and get None); the tasks still admitted, or None when
        the board was closed already."""
        with self.cond:
            if self._closed:
                return None
            self._closed = True
            self.cond.notify_all()
            return list(self._tasks.values())

    def wait_hosts(self, timeout: float) -> list[str]:
        """Wait up to ``timeout`` seconds in all for the host threads of ended tasks to end; the names of those
        still running then (stuck in their host work: a data iterator that never returns)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            hosts = list(self._left)
        stuck = [h.name for h in hosts if not h.join(max(deadline - time.monotonic(), 0.0))]
        with self.cond:
            self._left = [h for h in self._left if h.alive]
        return stuck

    # -- devices asking for work ----------------------------------------------------------------------------
    def take(self, index: int, on_idle: Callable[[], object] | None = None) -> Admitted | None:
        """Block until a task is ready for device ``index`` (its next segment open); None once closed.
        ``on_idle()`` runs once, outside the board's lock, when nothing came for ``IDLE_AFTER`` seconds."""
        def ready() -> bool:
            return self._closed or bool(self._ready) and not self._picker.defers(index, self._ready, self._idle)
        with self.cond:
            self._idle.add(index)
            came = self.cond.wait_for(ready, IDLE_AFTER if on_idle is not None else None)
            task = self._took(index) if came else None
        if not came and on_idle is not None:  # (without on_idle the wait has no timeout: it came)
            on_idle()
            with self.cond:
                self.cond.wait_for(ready)
                task = self._took(index)
        if task is not None:
            task.handle.started()
        return task

    def _took(self, index: int) -> Admitted | None:
        """Under the lock, once ``take``'s wait ended: device ``index``'s task (None once closed)."""
        self._idle.discard(index)
        self.cond.notify_all()  # a device that deferred to this one decides again
        return None if self._closed else self._choose(index)

    def take_kept(self, index: int, task: Admitted) -> Admitted | None:
        """Wait for the next segment of ``task``, which the policy kept device ``index`` on (``ran(..., keep=True)``)
        while its host work takes no longer than it usually does (``KEEP_WAIT``): ``task`` once its segment is
        open; None when it ended, the board closed, or its host thread is still busy (it joins the ready queue
        when done: a data iterator that blocks holds no device). While it is still opening, a ready task that
        last ran on this device, with at least ``1 - AFFINITY`` of its estimated time left, is taken instead of
        waiting (returned; ``task`` then joins the ready queue)."""
        factor, least, most = KEEP_WAIT
        with self.cond:
            wait = min(max(factor * task.open_seconds, least), most)
            state = task.state  # (None once ended)
            estimator = self._picker.estimator
            floor = (1 - AFFINITY) * estimator.remaining(task.name, state.remaining()) if state else 0.0
            # (many small tasks: waiting for each host thread's wake-up and step idles the device about as long
            # as it computes; a task from another device would move its state, costing more than the wait)
            self.wait_kept(task, lambda: self._closed or not task.opening or self._tasks.get(task.name) is not task,
                           lambda: any(self._picker.mine(a, index, floor) for _, a in self._ready), wait)
            if task.lent == index:  # its caller's thread runs a segment on this device now (lend.py)
                self._wait_lent(task)
            opened = task.kept_by == index and not task.opening and self._tasks.get(task.name) is task
            task.kept_by = None
            if self._closed:
                return None
            other = None if opened else self._picker.local(index, floor, self._ready)
            if other is not None:
                self._ready.remove(other)
                # kept for this device's next choice: another device that has other work does not take it
                task.set_aside = index
        if other is not None:
            other[1].handle.started()
            return other[1]
        return task if opened else None

    def choose_next(self, index: int, current: Admitted, follows: bool = False) -> Admitted | None:
        """For device ``index``, finishing ``current``'s segment: the task it runs next (its segment open), popped
        from the ready queue, or ``current`` itself when the policy keeps the device on it or its next segment
        completes this one (``follows``: Segment.follows); None when nothing is ready or the board is closed."""
        with self._lock:
            current.follows = self.follow_until() if follows else 0.0
            holds = self._picker.holds(current, index, self._idle, bool(self._ready))
            if not self._closed and self._tasks.get(current.name) is current and (
                    holds or follows and self._stays(current, index)):
                return current  # within the turn the policy's last pick gave it, or completing its segment
            task = None if self._closed else self._choose(index, current)
        if task is not None and task is not current:
            task.handle.started()
        return task

    def ran(self, task: Admitted, index: int, keep: bool) -> None:
        """``task``'s segment ran on device ``index``: its host thread opens the next one, then it is ready again
        (or, with ``keep``, handed to this device, which waits for it in ``take``). A cancelled task ends here;
        an ended one, or any once the board closed, is left as it is."""
        with self._lock:
            opening, cancelled = self._off_device(task, index, index if keep else None)
            if opening:
                task.host.request()
        if cancelled:
            self.end(task, "cancelled", TaskCancelled(f"task {task.name!r} was cancelled"))

    def requeue(self, task: Admitted) -> None:
        """``task`` is ready again with its segment open (a re-planned task the device had to pass on), unless
        it ended or the board closed."""
        with self._lock:
            if not self._closed and self._tasks.get(task.name) is task:
                task.since = self._next_seq()
                self._push(task)

    def observe(self, task: Admitted, kind: str, seconds: float) -> None:
        """A unit of ``task`` ran for ``seconds``: feeds the remaining-time estimates."""
        with self._lock:
            self._picker.estimator.observe(task.name, kind, seconds)
            task.units += 1

    def observe_many(self, task: Admitted, units: list[tuple[str, float]]) -> None:
        """``observe`` for each (kind, seconds) of ``units`` (a light run's: runtime/worker.py), unless ``task``
        ended meanwhile (its estimates are gone with it)."""
        with self._lock:
            if self._tasks.get(task.name) is task:
                for kind, seconds in units:
                    self._picker.estimator.observe(task.name, kind, seconds)
            task.units += len(units)
            task.inline_units += len(units)

    def replanned(self, task: Admitted) -> None:
        """``task``'s units changed (a re-plan): its measured unit times no longer apply."""
        with self.cond:
            self._picker.estimator.forget(task.name)
            task.left = None

    # -- reading ---------------------------------------------------------------------------------------------
    def held_bytes(self) -> dict[str, int]:
        """Host bytes each admitted task holds, as its own thread last measured them (its tensors may be
        changing now: other threads never read them)."""
        with self.cond:
            states = [(name, task.state) for name, task in self._tasks.items()]
        return {name: state.held_bytes for name, state in states if state is not None}

    def task_stats(self) -> dict[str, dict[str, Any]]:
        """Per task, running or ended: what ``Runtime.stats()["tasks"]`` holds."""
        with self.cond:
            tasks = {name: task.stats() for name, task in self._tasks.items()}
            tasks.update({n: s for n, s in self._finished.items() if n not in tasks})
        return tasks

    def counts(self) -> dict[str, int]:
        """How many tasks are admitted, ready, opening a segment, and ended (with a kept record); how many host
        threads still run (opening, or of ended tasks) and how many devices wait for work: what soak checks read."""
        with self.cond:
            opening = sum(t.opening for t in self._tasks.values())
            return {"admitted": len(self._tasks), "ready": len(self._ready), "opening": opening,
                    "host_busy": opening + sum(h.alive for h in self._left), "finished": len(self._finished),
                    "finished_dropped": self._dropped,
                    "idle_devices": len(self._idle)}

    def run_order(self) -> list[str]:
        """Task names in the order they are expected to get a device (a guess for evicting state): the ready
        queue, longest waiting first, then the tasks whose host thread is opening their next segment."""
        with self.cond:
            return [task.name for _, task in self._ready] + [t.name for t in self._tasks.values() if t.opening]

    def ready(self) -> list[Admitted]:
        """The tasks off the devices: the ready queue in the order they became ready, then those whose host
        thread is opening their next segment."""
        with self.cond:
            return [task for _, task in self._ready] + [t for t in self._tasks.values() if t.opening]

    # -- inside (the caller holds the lock) ------------------------------------------------------------------
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _off_device(self, task: Admitted, index: int, kept_by: int | None) -> tuple[bool, bool]:
        """``task``'s segment ran on device ``index``: (whether it opens its next segment now, with ``kept_by`` the
        device that takes it then; whether it was cancelled, to be ended by the caller)."""
        task.last_device = index
        task.turns += 1
        live = not self._closed and self._tasks.get(task.name) is task
        cancelled = live and task.handle.cancel_requested
        if live and not cancelled:
            task.since, task.opening = self._next_seq(), True
            task.kept_by = kept_by
        return live and not cancelled, cancelled

    def _push(self, task: Admitted) -> None:
        task.left = None  # its next segment is open: its estimate is asked anew
        self._ready.append((task.since, task))
        self.cond.notify_all()  # every waiter: a device waiting for a kept task must not swallow the wake-up

    def _choose(self, index: int, current: Admitted | None = None) -> Admitted | None:
        """Pop the ready task the policy gives device ``index``. ``current``, the task whose segment the device
        is finishing, competes too (as if ready now, last run here): picking it means the device continues with
        it (returned, not popped); then a task set aside for another device (``take_kept``) is not taken from it."""
        idle = sorted(self._idle - {index})
        state = current.state if current is not None else None  # read once: end() clears it (under the lock)
        if state is None or not any(state.remaining().values()):
            current = None  # it ended (failed, cancelled) or its last segment is running: nothing to continue
        ready = [(pos, seq, a) for pos, (seq, a) in enumerate(self._ready)
                 if current is None or a.set_aside in (None, index)]
        self._release_set_aside(index)
        cands = [(seq, a) for _, seq, a in ready] + ([(self._seq + 1, current)] if current is not None else [])
        if not cands:
            return None
        pos = self._picker.pick(self._picker.records(index, cands, current), index, idle)
        task = cands[pos][1] if pos == len(ready) else self._ready.pop(ready[pos][0])[1]
        self._picker.picked(task, index)
        return task

    def _release_set_aside(self, index: int) -> None:
        """Device ``index`` chooses again: what ``take_kept`` set aside for it is anyone's now."""
        for task in self._tasks.values():
            if task.set_aside == index:
                task.set_aside = None
