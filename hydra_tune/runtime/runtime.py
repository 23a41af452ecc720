"""The runtime: one per node; owns the devices, admits tasks, and runs every task's units on every device.

    with Runtime(devices=["cpu", "cpu"], device_memory="64MiB", policy="lrtf") as rt:
        handles = [rt.submit(task) for task in tasks]
        print([h.result()["train_loss"] for h in handles], rt.stats()); rt.trace().save("trace.json")

Each device has a worker thread and a copy thread. The worker asks the policy for a ready task, advances the
task's chain to its next segment (a minibatch's F.. L B.. units, or one eval batch) and runs those units back to
back: the device keeps the task's shards and kept activations between them. While a unit runs, the copy thread
prepares the next unit's shard (double buffering); while a segment's last unit runs, it already picks the
device's next task, does that task's host work (optimizer step, data) and copies its first shard. A task runs on
one device at a time; tasks are independent, so every device stays busy while enough tasks are ready. A task's
failure or cancellation ends that task only.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..config import RuntimeConfig
from ..device.devices import Device, resolve_devices
from ..errors import RuntimeClosed, TaskCancelled, detach_frames, rule_error
from ..policy.schedule import POLICIES, Estimator, Ready
from ..task import ModelTask
from ..training.footprint import Footprint
from ..training.replan import is_oom, replan
from ..training.residency import ShardCache
from ..training.segments import Segment, Unit
from ..training.state import TaskState
from .gate import GateHooks, HostGate
from .handle import TaskHandle
from .trace import COPY, Recorder, Trace

__all__ = ["Runtime", "TaskHandle"]


class _Admitted:
    """Runtime-private bookkeeping of one task between segments."""

    def __init__(self, handle: TaskHandle, state: TaskState, order: int) -> None:
        self.handle, self.state, self.order = handle, state, order
        self.chain = state.segments(handle.emit)
        self.segment: Segment | None = None  # taken from the chain, not yet run
        self.footprint: Footprint | None = None  # host bytes admission charged it
        self.last_device: int | None = None
        self.units = 0
        self.turns = 0


class Runtime:
    """Owns the node's devices and runs the units of every admitted task on them.

    The settings are a ``RuntimeConfig``'s (hydra_tune/config.py): pass ``config=`` or its four keywords.
    ``policy``: "lrtf" (Sharded-LRTF with affinity, the default), "fifo" or "round_robin" (policy/schedule.py).
    ``host_memory``: what the admitted tasks' host state may take: None measures it (available memory less a
    reserve, sampled at every admission), a byte count or "64GiB" is a hard budget. A task that does not fit
    waits, a task that could never fit is rejected at submit (policy/admission.py; training/footprint.py).
    """

    def __init__(self, devices: int | str | Sequence[str] = "auto", device_memory: int | str | None = None,
                 *, policy: str = "lrtf", host_memory: int | str | None = None,
                 config: RuntimeConfig | None = None) -> None:
        self.config = RuntimeConfig.of(config, devices=devices, device_memory=device_memory,
                                       host_memory=host_memory, policy=policy)
        self.devices: list[Device] = resolve_devices(self.config.devices, self.config.device_memory)
        self.policy = self.config.policy
        self._pick = POLICIES[self.policy]
        self._cond = threading.Condition()
        self._ready: list[tuple[int, _Admitted]] = []  # (when it became ready, task)
        self._tasks: dict[str, _Admitted] = {}
        self._finished: dict[str, dict[str, Any]] = {}
        self._seq = 0
        self._admitted = 0
        self._closed = False
        self._idle: set[int] = set()
        self._estimator = Estimator()
        self._recorder = Recorder([d.name for d in self.devices], time.perf_counter())
        self._dev_stats = [{"units": 0, "busy_seconds": 0.0, "prefetches": 0, "prefetched_bytes": 0}
                           for _ in self.devices]
        for d in self.devices:
            d.resident = ShardCache()
        self._copiers = [ThreadPoolExecutor(1, thread_name_prefix=f"hydra-copy-{d.name}") for d in self.devices]
        self._workers = [threading.Thread(target=self._work, args=(i,), name=f"hydra-{d.name}", daemon=True)
                         for i, d in enumerate(self.devices)]
        self._started = [threading.Event() for _ in self.devices]
        self._start_errors: list[BaseException] = []
        for w in self._workers:
            w.start()
        for e in self._started:  # device set-up (e.g. CUDA workspaces) is done before any task is planned
            e.wait()
        self._gate = HostGate(self.config.host_memory, self._plan_args(),
                              GateHooks(self._new_handle, self._held_bytes, self._start))
        if self._start_errors:
            self.close()
            raise self._start_errors[0]
        self._gate.start()

    # -- public ---------------------------------------------------------------------------------------------
    def submit(self, task: ModelTask) -> TaskHandle:
        """Admit ``task`` if its host footprint fits: build, measure and plan it here (errors raise now) and queue
        it for the devices. One that does not fit yet waits (status "queued"; built when running tasks have freed
        enough, and errors of that build go to its handle); one that could never fit raises now."""
        if not isinstance(task, ModelTask):
            raise rule_error("`task` is a hydra_tune.ModelTask", "wrap the job in ModelTask(model, optimizer, "
                             "train_data, ...)", kind=TypeError, task=type(task).__name__)
        if self._closed:
            raise RuntimeClosed("the runtime is open, but got (closed=True). Fix: submit to a new Runtime.")
        handle, footprint, state = self._gate.submit(task)
        if handle is not None:
            return handle  # waiting for host memory
        try:
            return self._start(None, task, footprint, state)
        except BaseException:
            self._gate.release(task.name)
            raise

    def footprint(self, task: ModelTask) -> Footprint:
        """``task``'s host footprint on this runtime, estimated on the meta device without submitting it (what a task
        that has to wait is charged; a task whose model cannot be built there is built here to be measured).

            fp = rt.footprint(task); fp.total, fp.parts()              # bytes: params, grads, optimizer, ...
            at_once = rt.host_memory()["free"] // fp.total             # how many such tasks would start now
        """
        return self._gate.footprint(task)[0]

    def host_memory(self) -> dict[str, Any]:
        """Host-memory admission now: ``budget`` (bytes the admitted tasks may take; measured: available memory less
        the reserve plus what they hold), ``measured``, ``admitted_bytes`` (their charged footprints), ``free``,
        ``admitted`` and ``waiting`` (name -> footprint; the waiting ones in the order they will start)."""
        return self._gate.snapshot()

    def stats(self) -> dict[str, Any]:
        """Per device: units run, busy seconds, prefetches, measured peak/current bytes, budget. Per task: shards,
        kept shards, state, host bytes held and the footprint admission charged (tasks waiting for host memory:
        state "queued", ``waiting_for_host_memory``). ``host``: what ``host_memory()`` returns."""
        with self._cond:
            tasks = {name: self._task_stats(a) for name, a in self._tasks.items()}
            tasks.update({n: s for n, s in self._finished.items() if n not in tasks})
            devices = [dict(name=d.name, budget=d.budget, overhead_bytes=d.overhead, peak_bytes=d.peak_bytes(),
                            current_bytes=d.current_bytes(), **self._dev_stats[i]) for i, d in enumerate(self.devices)]
        tasks.update(self._gate.waiting_stats())
        return {"devices": devices, "tasks": tasks, "policy": self.policy, "host": self.host_memory()}

    def trace(self) -> Trace:
        """Every unit and prefetch copy so far: ``.save("trace.json")`` for Perfetto, or ``plot_timeline``."""
        return self._recorder.snapshot()

    def close(self) -> None:
        """Cancel what is still running, stop the workers. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            pending = list(self._tasks.values())
            self._cond.notify_all()
        for w in self._workers:
            if w is not threading.current_thread():
                w.join()
        self._gate.close()
        for c in self._copiers:
            c.shutdown(wait=True)
        for adm in pending:
            self._end(adm, "cancelled", RuntimeClosed(f"the runtime was closed before task {adm.handle.name!r} "
                                                      "finished"))
        for d in self.devices:
            d.resident.clear()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- host-memory admission ------------------------------------------------------------------------------
    def _new_handle(self, name: str) -> TaskHandle:
        return TaskHandle(name, self._cancel)

    def _held_bytes(self) -> dict[str, int]:
        """Host bytes each admitted task holds, as its own thread last measured them (its tensors may be changing
        now: other threads never read them)."""
        with self._cond:
            states = [(name, adm.state) for name, adm in self._tasks.items()]
        return {name: state.held_bytes for name, state in states if state is not None}

    def _plan_args(self) -> tuple[int | None, float | None, bool]:
        """What every task is planned with: the smallest planner budget and copy rate of the devices, and whether
        forwards may keep or offload activations (see Device.releases_graphs)."""
        budgets = [d.plan_budget for d in self.devices if d.plan_budget is not None]
        rates = [d.copy_bandwidth for d in self.devices if d.copy_bandwidth]
        return (min(budgets) if budgets else None, min(rates) if rates else None,
                all(d.releases_graphs for d in self.devices))

    def _start(self, handle: TaskHandle | None, task: ModelTask, footprint: Footprint,
               state: TaskState | None) -> TaskHandle:
        """Build an admitted task (unless built) and queue it for the devices; ``handle``: a waiting task's."""
        if state is None:
            state = TaskState.build(task, *self._plan_args())
        self.devices[0].copier.prepare_host(list(state.model.parameters()) + list(state.model.buffers()))
        if handle is None:
            handle = self._new_handle(task.name)
        handle.attach(state)
        with self._cond:
            if self._closed:
                raise RuntimeClosed(f"the runtime was closed before task {task.name!r} started")
            if handle.cancel_requested:
                raise TaskCancelled(f"task {task.name!r} was cancelled")
            if task.name in self._tasks:
                raise rule_error("task names are unique among running tasks", "give each ModelTask its own "
                                 "`name`", name=task.name)
            shared = [n for n, a in self._tasks.items() if a.state.model is state.model]
            if shared:
                raise rule_error("each running task trains its own model object", "pass a factory "
                                 "(`lambda: MyModel()`) or a fresh module per task", task=task.name,
                                 model_also_in=shared[0])
            self._admitted += 1
            adm = _Admitted(handle, state, self._admitted)
            adm.footprint = footprint
            self._tasks[task.name] = adm
            self._push(adm)
        return handle

    # -- choosing work --------------------------------------------------------------------------------------
    def _push(self, adm: _Admitted) -> None:
        """Make ``adm`` ready (caller holds the lock)."""
        self._seq += 1
        self._ready.append((self._seq, adm))
        self._cond.notify()

    def _choose(self, index: int, current: _Admitted | None = None) -> _Admitted | None:
        """Pop the ready task the policy gives device ``index`` (caller holds the lock). ``current``, the task
        whose segment the device is finishing, competes too (as if ready now, last run here): picking it means
        the device continues with it (returned, not popped). Records are made now, so remaining-time estimates
        include every unit measured so far."""
        idle = sorted(self._idle - {index})
        state = current.state if current is not None else None  # read once: _end clears it (under the lock)
        if state is None or not any(state.remaining().values()):
            current = None  # it ended (failed, cancelled) or its last segment is running: nothing to continue
        cands = list(self._ready) + ([(self._seq + 1, current)] if current is not None else [])
        if not cands:
            return None
        records = [Ready(a.handle.name, seq, index if a is current else a.last_device,
                         self._estimator.remaining(a.handle.name, a.state.remaining()),
                         a.turns + (a is current), a.order) for seq, a in cands]
        pos = self._pick(records, index, idle)
        return cands[pos][1] if pos == len(self._ready) else self._ready.pop(pos)[1]

    def _take(self, index: int) -> _Admitted | None:
        """Block until a task is ready for device ``index`` and its next segment is open; None once closed."""
        while True:
            with self._cond:
                self._idle.add(index)
                self._cond.wait_for(lambda: self._closed or self._ready)
                self._idle.discard(index)
                if self._closed:
                    return None
                adm = self._choose(index)
            if adm is not None and self._open(adm):
                return adm
            adm = None  # it ended: waiting must not keep its handle (a done task's model, an error's frames)

    def _open(self, adm: _Admitted) -> bool:
        """Advance ``adm``'s chain to its next segment (its host work runs here); False if the task ended."""
        if adm.handle.cancel_requested:
            self._end(adm, "cancelled", TaskCancelled(f"task {adm.handle.name!r} was cancelled"))
            return False
        if adm.segment is not None:
            return True  # a re-planned minibatch, open since its out-of-memory
        adm.handle.started()
        try:
            adm.segment = next(adm.chain)
        except StopIteration:
            self._end(adm, "done")
            return False
        except BaseException as exc:  # one task's failure is that task's alone
            self._end(adm, "failed", exc)
            return False
        return True

    def _next_segment(self, index: int, room: int | None, current: _Admitted) -> _Admitted | None:
        """Copy thread, while the device's current segment ends: pick its next task, open its segment and copy
        its first shard in when ``room`` (device bytes free next to the running unit) allows. Returns ``current``
        itself when the policy keeps the device on it (its host work must wait for its segment to end)."""
        with self._cond:
            if self._closed:
                return None
            adm = self._choose(index, current)
        if adm is None or adm is current or not self._open(adm):
            return adm if adm is current else None
        first = adm.segment.units[0]  # type: ignore[union-attr]
        state_bytes = adm.state.plan.shards[first.shard].state_bytes
        if room is None or state_bytes <= room:
            self._prefetch(index, adm, first)
        return adm

    def _prefetch(self, index: int, adm: _Admitted, unit: Unit) -> None:
        t0 = time.perf_counter()
        try:
            nbytes = unit.prefetch(self.devices[index])
        except Exception:  # e.g. out of memory while copying ahead: the unit copies its shard in itself
            self.devices[index].resident.drop(adm.state.execs[unit.shard])
            return
        if nbytes:
            self._recorder.add(index, unit.task, unit.shard, "H2D", t0, time.perf_counter(), nbytes, COPY,
                               unit.segment)
            with self._cond:
                self._dev_stats[index]["prefetches"] += 1
                self._dev_stats[index]["prefetched_bytes"] += nbytes

    # -- workers --------------------------------------------------------------------------------------------
    def _work(self, index: int) -> None:
        device = self.devices[index]
        try:
            device.start()
        except BaseException as exc:  # reported by __init__, which is waiting for this device
            self._start_errors.append(exc)
            return
        finally:
            self._started[index].set()
        adm: _Admitted | None = None  # the device's next task, its segment open
        while True:
            if self._closed:
                return  # close() ends every task still admitted, the one picked for us included
            if adm is None:
                adm = self._take(index)
                if adm is None:
                    return
            try:
                adm = self._run_segment(adm, index, device)
            except BaseException as exc:  # a fault of ours outside the units: fail that task, keep the device
                self._end(adm, "failed", exc)
                adm = None

    def _run_segment(self, adm: _Admitted, index: int, device: Device) -> _Admitted | None:
        """Run the open segment's units in order, each with the next one's shard prefetched; returns the
        device's next task with its segment open (picked by the copy thread during the last unit), if any."""
        segment, state, copier = adm.segment, adm.state, self._copiers[index]
        units = segment.units  # type: ignore[union-attr]
        adm.segment = None
        device.measuring = device.measure((adm.handle.name, segment.key))  # type: ignore[union-attr]
        nxt: Future[_Admitted | None] | None = None
        pending: Future[None] | None = None
        try:
            for j, unit in enumerate(units):
                if adm.handle.cancel_requested:
                    raise TaskCancelled(f"task {adm.handle.name!r} was cancelled")
                if pending is not None:
                    pending.result()
                    pending = None
                device.copier.wait_prefetched()  # the compute stream waits for this unit's prefetched shard
                later = units[j + 1] if j + 1 < len(units) else None
                device.resident.retain([state.execs[u.shard] for u in (unit, later) if u is not None])
                if later is not None:
                    pending = copier.submit(self._prefetch, index, adm, later)
                elif not self._closed:
                    room = None if device.plan_budget is None else device.plan_budget - (
                        state.plan.peak - state.plan.prefetch_bytes)
                    nxt = copier.submit(self._next_segment, index, room, adm)
                t0 = time.perf_counter()
                moved = device.copier.moved()
                unit.run(device)
                t1 = time.perf_counter()
                self._recorder.add(index, unit.task, unit.shard, unit.kind, t0, t1, device.copier.moved() - moved,
                                   segment=unit.segment)
                with self._cond:
                    self._estimator.observe(unit.task, unit.kind, t1 - t0)
                    self._dev_stats[index]["units"] += 1
                    self._dev_stats[index]["busy_seconds"] += t1 - t0
                    adm.units += 1
        except BaseException as exc:
            if pending is not None:
                pending.exception()  # let a prefetch of this task finish before its state is freed
            retry = is_oom(exc) and self._replan(adm, unit, device, exc)
            if not retry:
                self._end(adm, "cancelled" if isinstance(exc, TaskCancelled) else "failed", exc)
            following = nxt.result() if nxt is not None else None
            if not retry:
                return None if following is adm else following
            if following is None or following is adm:
                return adm  # its minibatch, re-planned, runs again here now
            with self._cond:  # the copy thread already opened another task for this device: that one goes first
                self._push(adm)
            return following
        following = nxt.result() if nxt is not None else None
        with self._cond:
            adm.last_device = index
            adm.turns += 1
            if following is not adm and not self._closed and self._tasks.get(adm.handle.name) is adm:
                self._push(adm)
        if following is adm:  # the policy keeps this device on the same task: open its next segment here
            return adm if self._open(adm) else None
        return following

    def _replan(self, adm: _Admitted, unit: Unit, device: Device, exc: BaseException) -> bool:
        """After a device out-of-memory in ``unit``: drop what the attempt held, cut the task smaller and open
        the same minibatch again (``adm.segment``); False when that failed (the task then ended with why)."""
        exc.__traceback__ = None  # its frames hold the failed unit's device tensors
        old = adm.state.execs
        for d in self.devices:
            for ex in old:
                d.resident.drop(ex)
        device.after_oom()
        _, bandwidth, keep = self._plan_args()
        try:
            adm.segment = replan(adm.state, unit, device.name, bandwidth, keep)
        except BaseException as error:  # noqa: BLE001  (a stage that no longer fits: that task's error alone)
            self._end(adm, "failed", error)
            return False
        with self._cond:
            self._estimator.forget(adm.handle.name)  # its units are other units now
        return True

    def _cancel(self, handle: TaskHandle) -> None:
        if self._gate.withdraw(handle, TaskCancelled(f"task {handle.name!r} was cancelled")):
            return  # it was waiting for host memory
        with self._cond:
            handle.cancel_requested = True
            adm = self._tasks.get(handle.name)
            queued = adm is not None and any(a is adm for _, a in self._ready)
            if queued:
                self._ready = [(q, a) for q, a in self._ready if a is not adm]
        if queued:
            self._end(adm, "cancelled", TaskCancelled(f"task {handle.name!r} was cancelled"))

    def _end(self, adm: _Admitted, status: str, error: BaseException | None = None) -> None:
        with self._cond:
            if self._tasks.get(adm.handle.name) is not adm:
                return  # already ended (e.g. finished while the runtime was closing)
            del self._tasks[adm.handle.name]
            self._finished[adm.handle.name] = dict(self._task_stats(adm), state=status)
            self._estimator.forget(adm.handle.name)
        self._gate.release(adm.handle.name)  # before the handle reports the end: its name is free to reuse
        detach_frames(error, adm.handle.name)
        adm.chain.close()
        adm.state.abandon_checkpoints(status)
        adm.state.store.clear()
        for d in self.devices:
            for ex in adm.state.execs:
                d.resident.drop(ex)
            d.forget(adm.handle.name)
        adm.handle.finish(status, error)
        with self._cond:
            adm.state = None  # type: ignore[assignment]  # drop the model, optimizer and store now

    @staticmethod
    def _task_stats(adm: _Admitted) -> dict[str, Any]:
        st = adm.state
        return {"state": adm.handle.status, "shards": [list(ex.names) for ex in st.execs],
                "kept": [i for i in range(len(st.execs)) if st.plan.keeps(i)],
                "offloaded": [i for i in range(len(st.execs)) if st.plan.offloads(i)], "steps": st.steps,
                "epoch": st.epoch, "units": adm.units, "host_bytes": st.held_bytes, "replans": st.replans,
                "predicted_peak": st.plan.peak,
                "host_footprint": adm.footprint.parts() if adm.footprint is not None else None}

