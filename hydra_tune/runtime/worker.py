"""One device's worker: a compute thread that runs segments unit by unit, and a copy thread that works ahead.

    worker = DeviceWorker(index, device, board, recorder, hooks); worker.start()
    ...; worker.join(); worker.shutdown()           # after the board closed
    worker.stats()                                   # units, busy and CPU seconds, prefetches, prefetched bytes

Rules: the worker takes a task from the board (its segment open) and runs that segment's units back to back, the
device keeping the task's shards and kept activations between them. While a unit runs, the copy thread copies
the next unit's shard in (double buffering); while the segment's last unit runs, it asks the board for the
device's next task (one whose segment is open already) and copies its first shard in when the room next to the
running unit allows. When a segment starts, the device's StateCache (training/state_cache.py) makes room for the
task's units by evicting other tasks' state, and moves the task's own parameters, gradients and optimizer state
onto the device when they fit beside its units, to stay there; a task whose whole state does not fit keeps
per-shard entries, which its units move in themselves (``StateHome.use``; the worker tells the cache which shards
its units left read: ``StateCache.using``). Every copy and wait counts for the task whose work
it is. No host work of a task (its optimizer step, its next batch) runs on these threads: the
task's own host thread does it between its segments (scheduler.py, host.py), so a data iterator that blocks never
holds a device. A unit that runs out of device memory has its task re-planned smaller and its minibatch run
again; any other error ends that task only, and the worker goes on.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..device.devices import Device
from ..device.quiet import UnroutedDraw
from ..device.threads import adopt_thread_count, release_idle_pool
from ..errors import TaskCancelled
from ..training.light_run import LightRun, RunHooks, Span
from ..training.measure_class import measure_key
from ..training.replan import is_oom, replan
from ..training.residency import ShardCache
from ..training.segments import Unit
from ..training.shard import ShardExec
from ..training.state_cache import StateCache
from .admitted import Admitted
from .light_scope import LightScope
from .scheduler import Scheduler
from .trace import COPY, Recorder

# A device kept on a task opens its next segment itself (no hand-off) when the task's last opening took less than
# this many seconds (and its host work is light: TaskState.light_host_work); a longer one runs in its host thread.
INLINE_OPEN = 0.02

Following = list[tuple["Admitted | None", "Future[None] | None"]]  # the device's next task, the copy of its 1st shard


@dataclass(frozen=True)
class WorkerHooks:
    """What a worker needs beyond its device and the board. ``plan()``: (budget, copy bandwidth, keep) every
    task is planned with, known once all devices started. ``drop_copies(execs)``: forget those shards' copies on
    every device (a re-plan replaces them). ``started(index, error)``: the device's set-up ended (``error`` None
    when it worked). ``residency``: tasks' state may stay on the device (RuntimeConfig.residency "auto")."""

    plan: Callable[[], tuple[int | None, float | None, bool]]
    drop_copies: Callable[[Sequence[ShardExec]], None]
    started: Callable[[int, "BaseException | None"], None]
    residency: bool = True


class DeviceWorker:
    """The threads of device ``index`` (see the module docstring)."""

    def __init__(self, index: int, device: Device, board: Scheduler, recorder: Recorder,
                 hooks: WorkerHooks) -> None:
        self.index, self.device, self.board = index, device, board
        self._recorder, self._hooks = recorder, hooks
        device.resident = ShardCache()
        device.states = StateCache(device, index, board.run_order) if hooks.residency else None
        self._copier = ThreadPoolExecutor(1, thread_name_prefix=f"hydra-copy-{device.name}")
        self._thread = threading.Thread(target=self._work, name=f"hydra-{device.name}", daemon=True)
        self._lock = threading.Lock()
        self._stats = {"units": 0, "busy_seconds": 0.0, "unit_cpu_seconds": 0.0, "prefetches": 0,
                       "prefetched_bytes": 0}
        if device.units_any_thread:  # a prepared task's own thread may run its segments here (lend.py)
            board.add_lender(index, self.run_lent)

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        if self._thread is not threading.current_thread() and self._thread.ident is not None:
            self._thread.join()

    def shutdown(self) -> None:
        """After ``join``: stop the copy thread and drop the device's resident copies."""
        self._copier.shutdown(wait=True)
        self.device.resident.clear()
        if self.device.states is not None:
            self.device.states.clear()

    def unit_seconds(self) -> tuple[float, float]:
        """(busy seconds, ``unit_cpu_seconds``) so far: the worker's lock only (lock_note.py reads it as tasks end)."""
        with self._lock:
            return self._stats["busy_seconds"], self._stats["unit_cpu_seconds"]

    def stats(self) -> dict[str, Any]:
        """Units, busy seconds and the CPU seconds of the threads that ran them (``unit_cpu_seconds``), prefetches;
        bytes copied each way by category and syncs (``copies``); the tasks' state held on the device and
        evictions."""
        with self._lock:
            out: dict[str, Any] = dict(self._stats)
        states = self.device.states
        out.update(states.stats() if states is not None else {"resident_tasks": 0, "resident_bytes": 0,
                                                              "evictions": 0})
        out["copies"] = self.device.copier.counts.snapshot()
        if self.device.quiet is not None:  # units run with no random-number routing, and their reruns (quiet.py)
            out["unrouted"] = dict(self.device.quiet.counts)
        return out

    # -- the compute thread ---------------------------------------------------------------------------------
    def _work(self) -> None:
        adopt_thread_count()
        try:
            self.device.start(elsewhere=[lambda fn: self._copier.submit(fn).result()])  # the copy thread warms too
        except BaseException as exc:  # reported to the runtime, which is waiting for this device
            self._hooks.started(self.index, exc)
            return
        self._hooks.started(self.index, None)
        task: Admitted | None = None  # the device's next task, its segment open (kept: being opened)
        kept = False
        while not self.board.closed:  # close() ends every task still admitted, the one picked for us included
            try:
                if kept:  # the policy kept the device on this task: its host thread is opening the next segment
                    task = self.board.take_kept(self.index, task)  # type: ignore[arg-type]
                if task is None:  # waiting holds no task (a done task's model, an error's frames)
                    # an idle device's OpenMP team would slow other threads' torch ops (threads.py): let it go
                    task = self.board.take(self.index, on_idle=release_idle_pool)
            except BaseException as exc:  # a fault of the board or policy: fail the tasks, never leave them waiting
                self._board_failed(exc)
                task, kept = None, False
                continue
            if task is None:
                return
            try:
                task, kept = self._run_segment(task)
            except BaseException as exc:  # a fault of ours outside the units: fail that task, keep the device
                self.board.end(task, "failed", exc)
                task, kept = None, False

    def _board_failed(self, exc: BaseException) -> None:
        error = RuntimeError(f"hydra_tune's scheduler failed on device {self.device.name} while choosing its next "
                             f"task ({type(exc).__name__}: {exc}); every admitted task was failed rather than left "
                             "waiting. This is a bug in hydra_tune: please report it with this traceback.")
        error.__cause__ = exc
        self.board.fail_all(error)
        time.sleep(0.05)  # a fault that repeats with no task admitted must not spin this thread

    def _run_segment(self, task: Admitted) -> tuple[Admitted | None, bool]:
        """Run the open segment's units in order; returns the device's next task with its segment open (picked
        during the last unit), if any, and whether it is this task kept on the device (its next segment is
        being opened)."""
        segment = task.segment
        task.segment = None
        if segment.handover:  # no units: this device, the policy's pick, opens the task's next segment (loop.py)
            if self._inline(task):
                return self._open_here(task, picked=True), False
            self.board.ran(task, self.index, True)
            return task, True
        following: Following = []
        failure = self._run_open(task, segment, following)
        if failure is not None:
            return self._after_failure(task, *failure, following), False
        keep = bool(following) and following[0][0] is task
        if keep and self._inline(task):  # its short host work runs here: no hand-off to its host thread and back
            return self._open_here(task), False
        self.board.ran(task, self.index, keep)  # its host thread opens its next segment from now
        nxt = self._following(following)
        return (task, True) if keep else (nxt, False)

    def _run_open(self, task: Admitted, segment: Any, following: Following | None) -> tuple[Unit, BaseException] | None:
        """``segment``'s units with the task's state made room for on the device (``_run_units``)."""
        self.device.measuring = self.device.measure(measure_key(task.state, segment.key, self.device), task.name)
        states, home = self.device.states, task.state.home
        if states is not None:
            with self.device.copier.charged_to(home.counts):
                states.begin(home, task.state.plan.peak)
        try:
            failure = self._run_units(task, segment.units, following, segment.follows)
        finally:
            if states is not None:
                states.end(home)
        if failure is None:
            self.device.segment_done()  # what it counted holds for the runtime's other devices too (measured.py)
        return failure

    def run_lent(self, task: Admitted, segment: Any) -> bool:
        """Run ``task``'s open ``segment`` in the calling thread, to which the board lent this device (lend.py;
        this device's thread waits meanwhile): as its own segments, re-planned or rerun as they are, without
        picking the device's next task. Whether it ran (False: the task ended, with why)."""
        while True:
            failure = self._run_open(task, segment, None)
            if failure is None:
                return True
            unit, exc = failure
            retry = (is_oom(exc) and self._replan(task, unit, exc)) or (isinstance(exc, UnroutedDraw)
                                                                        and self._rerun(task, exc))
            if not retry:  # (one that failed to re-plan ended already: end() leaves it alone)
                self.board.end(task, "cancelled" if isinstance(exc, TaskCancelled) else "failed", exc)
                return False
            segment, task.segment = task.segment, None  # the same minibatch again, here

    def _open_here(self, task: Admitted, picked: bool = False) -> Admitted | None:
        """Open kept ``task``'s next segment in this thread; its loop first trains here the minibatches it may,
        while the policy keeps the device on it (training/light_run.py). ``picked``: the policy gave the device to
        the task just now (a handed-over task), so its first minibatch is its turn's whatever the turn's length."""
        scope = LightScope(self, task)
        light = LightRun(self.device, lambda granted: self.board.keeps(task, self.index, granted),
                         RunHooks(scope.begin, scope.end), picked)
        try:
            with task.state.inline(light):
                return self.board.open_here(task, self.index, spent=lambda: light.seconds)
        finally:
            light.finish()

    def ran_light(self, task: Admitted, spans: list[Span]) -> None:
        """A light run's units (``LightScope.end``, light_scope.py): into the trace, the unit times and this device's
        counts."""
        for kind, segment, t0, t1, nbytes, _ in spans:
            self._recorder.add(self.index, task.name, 0, kind, t0, t1, nbytes, segment=segment)
        busy = [(kind, t1 - t0) for kind, _, t0, t1, _, _ in spans]
        self.board.observe_many(task, busy)
        with self._lock:
            self._stats["units"] += len(spans)
            self._stats["busy_seconds"] += sum(b for _, b in busy)
            self._stats["unit_cpu_seconds"] += sum(span[5] for span in spans)

    @staticmethod
    def _inline(task: Admitted) -> bool:
        """Whether the device, kept on ``task``, opens its next segment itself: its host work is light
        (``TaskState.light_host_work``) and its last opening took under ``INLINE_OPEN`` seconds (the device
        would wait for it anyway)."""
        return task.open_seconds < INLINE_OPEN and task.state.light_host_work()

    def _run_units(self, task: Admitted, units: Sequence[Unit], following: Following | None,
                   follows: bool = False) -> tuple[Unit, BaseException] | None:
        """The units, each with the next one's shard prefetched; during the last, the device's next task is picked
        (``follows``: the task's next segment completes this one, Segment.follows) and the copy thread copies its
        first shard in (both go into ``following``; None: no pick, a lent run). The unit that raised and its
        error, if one did."""
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
                if device.states is not None:  # which of its entries are read now and next (state_cache.py)
                    device.states.using(state.home, [u.shard for u in units[j:]])
                if later is not None:
                    if self._copies(task, later):
                        pending = self._copier.submit(self._prefetch, task, later)
                elif following is not None and not self.board.closed:
                    following.append(self._next_task(task, follows))
                self._run_unit(task, unit)
        except BaseException as exc:
            if pending is not None:
                pending.exception()  # let a prefetch of this task finish before its state is freed
            return unit, exc  # type: ignore[possibly-undefined]  (the loop raised inside, so it is bound)
        return None

    def _run_unit(self, task: Admitted, unit: Unit) -> None:
        moved = self.device.copier.moved()
        t0, cpu = time.perf_counter(), time.thread_time()
        with self.device.copier.charged_to(task.state.home.counts):
            unit.run(self.device)
        t1, cpu = time.perf_counter(), time.thread_time() - cpu
        self._recorder.add(self.index, unit.task, unit.shard, unit.kind, t0, t1, self.device.copier.moved() - moved,
                           segment=unit.segment)
        self.board.observe(task, unit.kind, t1 - t0)
        with self._lock:
            self._stats["units"] += 1
            self._stats["busy_seconds"] += t1 - t0
            self._stats["unit_cpu_seconds"] += cpu

    def _after_failure(self, task: Admitted, unit: Unit, exc: BaseException,
                       following: Following) -> Admitted | None:
        """``unit`` raised: re-plan after an out-of-memory (the same minibatch runs again), else end the task.
        Returns the device's next task."""
        retry = (is_oom(exc) and self._replan(task, unit, exc)) or (isinstance(exc, UnroutedDraw)
                                                                    and self._rerun(task, exc))
        if not retry:
            self.board.end(task, "cancelled" if isinstance(exc, TaskCancelled) else "failed", exc)
        nxt = self._following(following)
        if not retry:
            return None if nxt is task else nxt
        if nxt is None or nxt is task:
            return task  # its minibatch, re-planned, runs again here now
        self.board.requeue(task)  # another task was picked for this device already: that one first
        return nxt

    def _replan(self, task: Admitted, unit: Unit, exc: BaseException) -> bool:
        """After a device out-of-memory in ``unit``: drop what the attempt held, cut the task smaller and open
        the same minibatch again (``task.segment``); False when that failed (the task then ended with why)."""
        exc.__traceback__ = None  # its frames hold the failed unit's device tensors
        self._hooks.drop_copies(task.state.execs)
        home = task.state.home
        resident = home.held_bytes()
        home.release("its state left the device after an out-of-memory; it is back when it fits the re-plan")
        if self.device.states is not None:
            self.device.states.after_oom()  # per-shard entries off here: the device holds less than said
        self.device.after_oom()
        _, bandwidth, keep = self._hooks.plan()
        try:
            task.segment = replan(task.state, unit, self.device.name, bandwidth, keep, resident)
        except BaseException as error:  # noqa: BLE001  (a stage that no longer fits: that task's error alone)
            self.board.end(task, "failed", error)
            return False
        self.board.replanned(task)
        return True

    def _rerun(self, task: Admitted, exc: BaseException) -> bool:
        """A unit run without routing drew random numbers (device/quiet.py): the same minibatch runs again from
        its start, on the same plan, routed; False when that failed (the task then ended with why)."""
        exc.__traceback__ = None  # its frames hold the unit's device tensors
        self._hooks.drop_copies(task.state.execs)
        try:
            task.segment = task.state.retry(task.state.plan, replanned=False)
        except BaseException as error:  # noqa: BLE001  (e.g. a forward that changed a tensor attribute in place)
            self.board.end(task, "failed", error)
            return False
        return True

    def _next_task(self, current: Admitted, follows: bool = False) -> tuple[Admitted | None, Future[None] | None]:
        """As ``current``'s last unit starts: the device's next task (its segment open; ``current`` itself when
        the policy keeps the device on it or its next segment completes this one, ``follows``; None when nothing
        is ready), and the copy thread's copy of its first shard."""
        task = self.board.choose_next(self.index, current, follows)
        if task is None or task is current:
            return task, None
        states = self.device.states
        if states is not None:
            states.prefetched(task.state.home)  # its state, if here, is not evicted before it runs
        segment = task.segment
        if segment is None or segment.handover or not self._copies(task, segment.units[0]):
            return task, None
        plan, budget = current.state.plan, self.device.plan_budget
        held = states.total() if states is not None else 0
        room = None if budget is None else budget - held - (plan.peak - plan.prefetch_bytes)
        return task, self._copier.submit(self._next_segment, room, task)

    def _copies(self, task: Admitted, unit: Unit) -> bool:
        """Whether preparing ``unit`` ahead may copy anything: not when its shard's state is here and it has no
        buffers (a resident single-shard task), so the copy thread is not woken for nothing (a hand-off each
        way per segment, about as long as a small model's unit on a busy machine)."""
        return unit.kind == "B" or bool(task.state.execs[unit.shard].moving(self.device))

    @staticmethod
    def _following(following: Following) -> Admitted | None:
        """The device's next task picked during the last unit, once its first shard's copy ended."""
        if not following:
            return None
        task, copying = following[0]
        if copying is not None:
            copying.result()
        return task

    # -- the copy thread ------------------------------------------------------------------------------------
    def _next_segment(self, room: int | None, task: Admitted) -> None:
        """While another task's last unit runs: copy the first shard of ``task``, the device's next, in when
        ``room`` (device bytes free next to the running unit) allows."""
        first = task.segment.units[0]  # type: ignore[union-attr]
        if room is None or task.state.plan.shards[first.shard].state_bytes <= room:
            self._prefetch(task, first)

    def _prefetch(self, task: Admitted, unit: Unit) -> None:
        t0 = time.perf_counter()
        try:
            with self.device.copier.charged_to(task.state.home.counts):
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

