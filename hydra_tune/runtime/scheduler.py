"""The runtime's task board: admitted tasks, the ready queue, and which task each device runs next.

    board = Scheduler("lrtf", on_end=cleanup)      # on_end(task, status, error): free what an ended task held
    task = board.admit(handle, state, footprint)   # queued for the devices
    task = board.take(device_index)                # blocks; the task's next segment is open (task.segment)
    board.ran(task, device_index, continues=False) # its segment ran: ready again
    board.end(task, "failed", error)               # once per task; later calls do nothing

Rules: a task is in the ready queue or on one device, never both, so it runs on one device at a time. The policy
(policy/schedule.py) picks among the ready tasks with remaining-time estimates that include every unit measured
so far. Opening a segment advances the task's chain: the host work before it (data, the optimizer step) runs in
the thread that opens it. A task's failure or cancellation ends that task only. One lock (``cond``) guards the
board; ``on_end`` runs outside it.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..errors import RuntimeClosed, TaskCancelled, rule_error
from ..policy.schedule import POLICIES, Estimator, Ready
from ..training.footprint import Footprint
from ..training.segments import Segment
from ..training.state import TaskState
from .handle import TaskHandle


class Admitted:
    """One admitted task between its segments: its handle, state, chain of segments and scheduling record."""

    def __init__(self, handle: TaskHandle, state: TaskState, order: int, footprint: Footprint | None) -> None:
        self.handle, self.state, self.order, self.footprint = handle, state, order, footprint
        self.chain = state.segments(handle.emit)
        self.segment: Segment | None = None  # taken from the chain, not yet run
        self.last_device: int | None = None
        self.units = 0
        self.turns = 0

    @property
    def name(self) -> str:
        return self.handle.name

    def stats(self) -> dict[str, Any]:
        """What ``Runtime.stats()`` reports for this task (read under the board's lock)."""
        st = self.state
        return {"state": self.handle.status, "shards": [list(ex.names) for ex in st.execs],
                "kept": [i for i in range(len(st.execs)) if st.plan.keeps(i)],
                "offloaded": [i for i in range(len(st.execs)) if st.plan.offloads(i)], "steps": st.steps,
                "epoch": st.epoch, "units": self.units, "host_bytes": st.held_bytes, "replans": st.replans,
                "predicted_peak": st.plan.peak,
                "host_footprint": self.footprint.parts() if self.footprint is not None else None}


EndHook = Callable[[Admitted, str, "BaseException | None"], None]


class Scheduler:
    """Admitted tasks and the ready queue of one runtime (see the module docstring)."""

    def __init__(self, policy: str, on_end: EndHook) -> None:
        self.policy = policy
        self._pick = POLICIES[policy]
        self._on_end = on_end
        self.cond = threading.Condition()
        self._ready: list[tuple[int, Admitted]] = []  # (when it became ready, task)
        self._tasks: dict[str, Admitted] = {}
        self._finished: dict[str, dict[str, Any]] = {}
        self._seq = 0
        self._admitted = 0
        self._closed = False
        self._idle: set[int] = set()
        self._estimator = Estimator()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- tasks in and out -------------------------------------------------------------------------------------
    def admit(self, handle: TaskHandle, state: TaskState, footprint: Footprint | None) -> Admitted:
        """Queue a built task for the devices; raises if the board is closed, the task was cancelled, or its name
        or model is already running."""
        name = handle.name
        with self.cond:
            if self._closed:
                raise RuntimeClosed(f"the runtime was closed before task {name!r} started")
            if handle.cancel_requested:
                raise TaskCancelled(f"task {name!r} was cancelled")
            if name in self._tasks:
                raise rule_error("task names are unique among running tasks", "give each ModelTask its own "
                                 "`name`", name=name)
            shared = [n for n, a in self._tasks.items() if a.state.model is state.model]
            if shared:
                raise rule_error("each running task trains its own model object", "pass a factory "
                                 "(`lambda: MyModel()`) or a fresh module per task", task=name,
                                 model_also_in=shared[0])
            self._admitted += 1
            task = Admitted(handle, state, self._admitted, footprint)
            self._tasks[name] = task
            self._push(task)
        return task

    def end(self, task: Admitted, status: str, error: BaseException | None = None) -> None:
        """End ``task`` (done, failed, cancelled): off the board, its record kept for ``stats``, then ``on_end``;
        its state is let go last. A task that already ended is left alone."""
        with self.cond:
            if self._tasks.get(task.name) is not task:
                return  # already ended (e.g. finished while the runtime was closing)
            del self._tasks[task.name]
            self._finished[task.name] = dict(task.stats(), state=status)
            self._estimator.forget(task.name)
        self._on_end(task, status, error)
        with self.cond:
            task.state = None  # type: ignore[assignment]  # drop the model, optimizer and store now

    def cancel(self, handle: TaskHandle) -> Admitted | None:
        """Mark ``handle``'s task cancelled; if it is waiting in the ready queue, take it out and return it (the
        caller ends it). A task on a device stops at its next unit boundary."""
        with self.cond:
            handle.cancel_requested = True
            task = self._tasks.get(handle.name)
            if task is None or not any(a is task for _, a in self._ready):
                return None
            self._ready = [(q, a) for q, a in self._ready if a is not task]
        return task

    def close(self) -> list[Admitted] | None:
        """Stop handing out work (waiting devices wake up and get None); the tasks still admitted, or None when
        the board was closed already."""
        with self.cond:
            if self._closed:
                return None
            self._closed = True
            self.cond.notify_all()
            return list(self._tasks.values())

    # -- devices asking for work ----------------------------------------------------------------------------
    def take(self, index: int) -> Admitted | None:
        """Block until a task is ready for device ``index`` and its next segment is open; None once closed."""
        while True:
            with self.cond:
                self._idle.add(index)
                self.cond.wait_for(lambda: self._closed or self._ready)
                self._idle.discard(index)
                if self._closed:
                    return None
                task = self._choose(index)
            if task is not None and self.open_segment(task):
                return task
            task = None  # it ended: waiting must not keep its handle (a done task's model, an error's frames)

    def choose_next(self, index: int, current: Admitted) -> Admitted | None:
        """For device ``index``, finishing ``current``'s segment: the task it runs next, popped from the ready
        queue, or ``current`` itself when the policy keeps the device on it; None when nothing is ready or the
        board is closed."""
        with self.cond:
            return None if self._closed else self._choose(index, current)

    def open_segment(self, task: Admitted) -> bool:
        """Advance ``task``'s chain to its next segment (its host work runs here, in the caller's thread);
        False if the task ended (cancelled, finished, or its host work failed)."""
        if task.handle.cancel_requested:
            self.end(task, "cancelled", TaskCancelled(f"task {task.name!r} was cancelled"))
            return False
        if task.segment is not None:
            return True  # a re-planned minibatch, open since its out-of-memory
        task.handle.started()
        try:
            task.segment = next(task.chain)
        except StopIteration:
            self.end(task, "done")
            return False
        except BaseException as exc:  # one task's failure is that task's alone
            self.end(task, "failed", exc)
            return False
        return True

    def ran(self, task: Admitted, index: int, continues: bool) -> None:
        """``task``'s segment ran on device ``index``. ``continues``: that device opens its next segment now;
        otherwise the task is ready again (unless it ended or the board closed)."""
        with self.cond:
            task.last_device = index
            task.turns += 1
        if not continues:
            self.requeue(task)

    def requeue(self, task: Admitted) -> None:
        """``task`` is ready again (a re-planned task the device had to pass on), unless it ended or the board
        closed."""
        with self.cond:
            if not self._closed and self._tasks.get(task.name) is task:
                self._push(task)

    def observe(self, task: Admitted, kind: str, seconds: float) -> None:
        """A unit of ``task`` ran for ``seconds``: feeds the remaining-time estimates."""
        with self.cond:
            self._estimator.observe(task.name, kind, seconds)
            task.units += 1

    def replanned(self, task: Admitted) -> None:
        """``task``'s units changed (a re-plan): its measured unit times no longer apply."""
        with self.cond:
            self._estimator.forget(task.name)

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
        """How many tasks are admitted, ready, and ended (with a kept record), and how many devices wait for
        work: what soak checks read."""
        with self.cond:
            return {"admitted": len(self._tasks), "ready": len(self._ready), "finished": len(self._finished),
                    "idle_devices": len(self._idle)}

    def ready(self) -> list[Admitted]:
        """The tasks in the ready queue, in the order they became ready."""
        with self.cond:
            return [task for _, task in self._ready]

    # -- inside (the caller holds the lock) ------------------------------------------------------------------
    def _push(self, task: Admitted) -> None:
        self._seq += 1
        self._ready.append((self._seq, task))
        self.cond.notify()

    def _choose(self, index: int, current: Admitted | None = None) -> Admitted | None:
        """Pop the ready task the policy gives device ``index``. ``current``, the task whose segment the device
        is finishing, competes too (as if ready now, last run here): picking it means the device continues with
        it (returned, not popped)."""
        idle = sorted(self._idle - {index})
        state = current.state if current is not None else None  # read once: end() clears it (under the lock)
        if state is None or not any(state.remaining().values()):
            current = None  # it ended (failed, cancelled) or its last segment is running: nothing to continue
        cands = list(self._ready) + ([(self._seq + 1, current)] if current is not None else [])
        if not cands:
            return None
        records = [Ready(a.name, seq, index if a is current else a.last_device,
                         self._estimator.remaining(a.name, a.state.remaining()),
                         a.turns + (a is current), a.order) for seq, a in cands]
        pos = self._pick(records, index, idle)
        return cands[pos][1] if pos == len(self._ready) else self._ready.pop(pos)[1]
