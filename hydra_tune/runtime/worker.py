"""One device's worker: a compute thread that runs segments unit by unit, and a copy thread that works ahead.

    worker = DeviceWorker(index, device, board, recorder, hooks); worker.start()
    ...; worker.join(); worker.shutdown()           # after the board closed
    worker.stats()                                   # units, busy seconds, prefetches, prefetched bytes

Rules: the worker takes a task from the board (its segment open) and runs that segment's units back to back, the
device keeping the task's shards and kept activations between them. While a unit runs, the copy thread copies
the next unit's shard in (double buffering); while the segment's last unit runs, it asks the board for the
device's next task, opens that task's segment (its host work) and copies its first shard in when the room next
to the running unit allows. A unit that runs out of device memory has its task re-planned smaller and its
minibatch run again; any other error ends that task only, and the worker goes on.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..device.devices import Device
from ..errors import TaskCancelled
from ..training.replan import is_oom, replan
from ..training.residency import ShardCache
from ..training.segments import Unit
from ..training.shard import ShardExec
from .scheduler import Admitted, Scheduler
from .trace import COPY, Recorder


@dataclass(frozen=True)
class WorkerHooks:
    """What a worker needs beyond its device and the board. ``plan()``: (budget, copy bandwidth, keep) every
    task is planned with, known once all devices started. ``drop_copies(execs)``: forget those shards' copies on
    every device (a re-plan replaces them). ``started(index, error)``: the device's set-up ended (``error`` None
    when it worked)."""

    plan: Callable[[], tuple[int | None, float | None, bool]]
    drop_copies: Callable[[Sequence[ShardExec]], None]
    started: Callable[[int, "BaseException | None"], None]


class DeviceWorker:
    """The threads of device ``index`` (see the module docstring)."""

    def __init__(self, index: int, device: Device, board: Scheduler, recorder: Recorder,
                 hooks: WorkerHooks) -> None:
        self.index, self.device, self.board = index, device, board
        self._recorder, self._hooks = recorder, hooks
        device.resident = ShardCache()
        self._copier = ThreadPoolExecutor(1, thread_name_prefix=f"hydra-copy-{device.name}")
        self._thread = threading.Thread(target=self._work, name=f"hydra-{device.name}", daemon=True)
        self._lock = threading.Lock()
        self._stats = {"units": 0, "busy_seconds": 0.0, "prefetches": 0, "prefetched_bytes": 0}

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        if self._thread is not threading.current_thread() and self._thread.ident is not None:
            self._thread.join()

    def shutdown(self) -> None:
        """After ``join``: stop the copy thread and drop the device's resident copies."""
        self._copier.shutdown(wait=True)
        self.device.resident.clear()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._stats)

    # -- the compute thread ---------------------------------------------------------------------------------
    def _work(self) -> None:
        try:
            self.device.start()
        except BaseException as exc:  # reported to the runtime, which is waiting for this device
            self._hooks.started(self.index, exc)
            return
        self._hooks.started(self.index, None)
        task: Admitted | None = None  # the device's next task, its segment open
        while not self.board.closed:  # close() ends every task still admitted, the one picked for us included
            if task is None:
                task = self.board.take(self.index)
                if task is None:
                    return
            try:
                task = self._run_segment(task)
            except BaseException as exc:  # a fault of ours outside the units: fail that task, keep the device
                self.board.end(task, "failed", exc)
                task = None

    def _run_segment(self, task: Admitted) -> Admitted | None:
        """Run the open segment's units in order; returns the device's next task with its segment open (picked
        by the copy thread during the last unit), if any."""
        segment = task.segment
        task.segment = None
        self.device.measuring = self.device.measure((task.name, segment.key))  # type: ignore[union-attr]
        following: list[Future[Admitted | None]] = []
        failure = self._run_units(task, segment.units, following)  # type: ignore[union-attr]
        if failure is not None:
            return self._after_failure(task, *failure, following)
        nxt = following[0].result() if following else None
        self.board.ran(task, self.index, continues=nxt is task)
        if nxt is task:  # the policy keeps this device on the same task: open its next segment here
            return task if self.board.open_segment(task) else None
        return nxt

    def _run_units(self, task: Admitted, units: Sequence[Unit],
                   following: list[Future[Admitted | None]]) -> tuple[Unit, BaseException] | None:
        """The units, each with the next one's shard prefetched; during the last, the copy thread prepares the
        device's next task (its future goes into ``following``). The unit that raised and its error, if one did."""
        device, state = self.device, task.state
        pending: Future[None] | None = None
        try:
            for j, unit in enumerate(units):
                if task.handle.cancel_requested:
                    raise TaskCancelled(f"task {task.name!r} was cancelled")
                if pending is not None:
                    pending.result()
                    pending = None
                device.copier.wait_prefetched()  # the compute stream waits for this unit's prefetched shard
                later = units[j + 1] if j + 1 < len(units) else None
                device.resident.retain([state.execs[u.shard] for u in (unit, later) if u is not None])
                if later is not None:
                    pending = self._copier.submit(self._prefetch, task, later)
                elif not self.board.closed:
                    room = None if device.plan_budget is None else device.plan_budget - (
                        state.plan.peak - state.plan.prefetch_bytes)
                    following.append(self._copier.submit(self._next_segment, room, task))
                self._run_unit(task, unit)
        except BaseException as exc:
            if pending is not None:
                pending.exception()  # let a prefetch of this task finish before its state is freed
            return unit, exc  # type: ignore[possibly-undefined]  (the loop raised inside, so it is bound)
        return None

    def _run_unit(self, task: Admitted, unit: Unit) -> None:
        moved = self.device.copier.moved()
        t0 = time.perf_counter()
        unit.run(self.device)
        t1 = time.perf_counter()
        self._recorder.add(self.index, unit.task, unit.shard, unit.kind, t0, t1, self.device.copier.moved() - moved,
                           segment=unit.segment)
        self.board.observe(task, unit.kind, t1 - t0)
        with self._lock:
            self._stats["units"] += 1
            self._stats["busy_seconds"] += t1 - t0

    def _after_failure(self, task: Admitted, unit: Unit, exc: BaseException,
                       following: list[Future[Admitted | None]]) -> Admitted | None:
        """``unit`` raised: re-plan after an out-of-memory (the same minibatch runs again), else end the task.
        Returns the device's next task."""
        retry = is_oom(exc) and self._replan(task, unit, exc)
        if not retry:
            self.board.end(task, "cancelled" if isinstance(exc, TaskCancelled) else "failed", exc)
        nxt = following[0].result() if following else None
        if not retry:
            return None if nxt is task else nxt
        if nxt is None or nxt is task:
            return task  # its minibatch, re-planned, runs again here now
        self.board.requeue(task)  # the copy thread already opened another task for this device: that one first
        return nxt

    def _replan(self, task: Admitted, unit: Unit, exc: BaseException) -> bool:
        """After a device out-of-memory in ``unit``: drop what the attempt held, cut the task smaller and open
        the same minibatch again (``task.segment``); False when that failed (the task then ended with why)."""
        exc.__traceback__ = None  # its frames hold the failed unit's device tensors
        self._hooks.drop_copies(task.state.execs)
        self.device.after_oom()
        _, bandwidth, keep = self._hooks.plan()
        try:
            task.segment = replan(task.state, unit, self.device.name, bandwidth, keep)
        except BaseException as error:  # noqa: BLE001  (a stage that no longer fits: that task's error alone)
            self.board.end(task, "failed", error)
            return False
        self.board.replanned(task)
        return True

    # -- the copy thread ------------------------------------------------------------------------------------
    def _next_segment(self, room: int | None, current: Admitted) -> Admitted | None:
        """While ``current``'s last unit runs: pick the device's next task, open its segment and copy its first
        shard in when ``room`` (device bytes free next to the running unit) allows. Returns ``current`` itself
        when the policy keeps the device on it (its host work must wait for its segment to end)."""
        task = self.board.choose_next(self.index, current)
        if task is None or task is current or not self.board.open_segment(task):
            return task if task is current else None
        first = task.segment.units[0]  # type: ignore[union-attr]
        if room is None or task.state.plan.shards[first.shard].state_bytes <= room:
            self._prefetch(task, first)
        return task

    def _prefetch(self, task: Admitted, unit: Unit) -> None:
        t0 = time.perf_counter()
        try:
            nbytes = unit.prefetch(self.device)
        except Exception:  # e.g. out of memory while copying ahead: the unit copies its shard in itself
            self.device.resident.drop(task.state.execs[unit.shard])
            return
        if nbytes:
            self._recorder.add(self.index, unit.task, unit.shard, "H2D", t0, time.perf_counter(), nbytes, COPY,
                               unit.segment)
            with self._lock:
                self._stats["prefetches"] += 1
                self._stats["prefetched_bytes"] += nbytes
