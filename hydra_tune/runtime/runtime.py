"""The runtime: one per node; owns the devices, admits tasks, and runs every task's units on every device.

    with Runtime(devices=["cpu", "cpu"], device_memory="64MiB", policy="lrtf") as rt:
        handles = [rt.submit(task) for task in tasks]
        print([h.result()["train_loss"] for h in handles], rt.stats()); rt.trace().save("trace.json")

A submitted task passes the host gate (gate.py: host-memory admission), is built and planned, and goes on the
board (scheduler.py: the ready queue and the policy). Each task has a host thread (host.py) that opens its next
segment: the plain loop's host work (optimizer step, next batch). Each device has a worker (worker.py): it takes
a ready task, runs that task's next segment (a minibatch's F.. L B.. units, or one eval batch) while its copy
thread works ahead, and hands the task back to its host thread. A task runs on one device at a time; tasks are
independent, so every device stays busy while enough tasks are ready, and a task whose data iterator blocks holds
no device. A task's failure or cancellation ends that task only.
"""
from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch.nn as nn

from ..config import RuntimeConfig
from ..device.devices import Device
from ..device.resolve import resolve_devices
from ..device.threads import set_cpu_threads
from ..errors import RuntimeClosed, TaskCancelled, detach_frames, rule_error
from ..task import ModelTask
from ..training.entry_plan import plan_entries
from ..training.footprint import Footprint
from ..training.shard import ShardExec
from ..training.shared_frozen import SharedFrozen
from ..training.state import TaskState
from .admitted import Admitted
from .gate import GateHooks, HostGate
from .handle import TaskHandle
from .lock_note import LockNote
from .progress import ProgressLog, progress_seconds
from .scheduler import Scheduler
from .trace import Recorder, Trace
from .worker import DeviceWorker, WorkerHooks

__all__ = ["Runtime", "TaskHandle"]

SHARED_POOL = "(shared frozen weights)"  # the admission charge of the pool of shared frozen weights
CLOSE_WAIT = 2.0  # seconds close() waits for ended tasks' host threads before leaving them behind with a warning


class Runtime:
    """Owns the node's devices and runs the units of every admitted task on them.

    The settings are a ``RuntimeConfig``'s (hydra_tune/config.py): pass ``config=`` or its four keywords.
    Threads: a runtime with CPU devices caps torch's intra-op threads at its share of the cores (``device/threads.py``:
    one each when there are as many devices as cores; ``HYDRA_TUNE_CPU_THREADS=n`` sets n); GPU runtimes leave
    the count alone.
    ``policy``: "lrtf" (Sharded-LRTF with affinity, the default), "fifo" or "round_robin" (policy/schedule.py).
    ``host_memory``: what the admitted tasks' host state may take: None measures it (available memory less a
    reserve, sampled at every admission), a byte count or "64GiB" is a hard budget. A task that does not fit
    waits, a task that could never fit is rejected at submit (policy/admission.py; training/footprint.py).
    ``progress``: seconds between one-line status logs (tasks running/queued, devices busy, samples/s, steps/s) on
    the ``hydra_tune.progress`` logger at INFO; None (the default) reads ``HYDRA_TUNE_PROGRESS``, unset means off
    (runtime/progress.py); ``self.progress`` is the interval in use.
    """

    def __init__(self, devices: int | str | Sequence[str] = "auto", device_memory: int | str | None = None,
                 *, policy: str = "lrtf", host_memory: int | str | None = None,
                 config: RuntimeConfig | None = None, progress: float | None = None) -> None:
        self.config = RuntimeConfig.of(config, devices=devices, device_memory=device_memory,
                                       host_memory=host_memory, policy=policy)
        seconds = progress_seconds(progress)   # checked before any device starts
        self.progress = seconds                 # the status-line interval in seconds, None: off
        self.devices: list[Device] = resolve_devices(self.config.devices, self.config.device_memory)
        self._set_threads()
        self.policy = self.config.policy
        self.scheduler = Scheduler(self.policy, self._release, history=self.config.history)
        self._recorder = Recorder([d.name for d in self.devices], time.perf_counter(), limit=self.config.trace_events)
        self._start_devices()
        cpus = [w for w in self._workers if w.device.torch_device.type == "cpu"]
        self._lock_note = LockNote([w.device.name for w in cpus], lambda: [w.unit_seconds() for w in cpus])
        # frozen weights equal across tasks, held once (shared_frozen.py); some kept after their last task
        self.shared = SharedFrozen(retain=self.config.retain_frozen)
        self._gate = HostGate(self.config.host_memory, self._plan,
                              GateHooks(self._new_handle, self.scheduler.held_bytes, self._start, self._room))
        # GPUs measure the memory model on the device itself (profile.py); any CPU stand-in: the CPU profile
        profiled = [d for d in self.devices if d.profile_device() is not None]
        self._gate.profile_on = profiled[0] if len(profiled) == len(self.devices) else None
        self._gate.claim = self.scheduler.check_model_free
        if self._start_errors:
            self.close()
            raise self._start_errors[0]
        self._gate.start()
        self._progress = ProgressLog(self.stats, seconds) if seconds is not None else None

    def _set_threads(self) -> None:
        """Before the workers start (each thread takes torch's count at its first parallel op)."""
        set_cpu_threads(self.devices)

    def _start_devices(self) -> None:
        """One worker per device; returns once every device is set up (e.g. CUDA workspaces measured), so that
        tasks are planned with what the devices really have."""
        started = [threading.Event() for _ in self.devices]
        self._start_errors: list[BaseException] = []

        def on_started(index: int, error: BaseException | None) -> None:
            if error is not None:
                self._start_errors.append(error)
            started[index].set()

        hooks = WorkerHooks(lambda: self._plan, self._drop_copies, on_started,  # planned once devices started
                            residency=self.config.residency == "auto")
        self._workers = [DeviceWorker(i, d, self.scheduler, self._recorder, hooks) for i, d in enumerate(self.devices)]
        for w in self._workers:
            w.start()
        for e in started:
            e.wait()
        self._plan = self._plan_args()

    # -- public ---------------------------------------------------------------------------------------------
    def submit(self, task: ModelTask) -> TaskHandle:
        """Admit ``task`` if its host footprint fits: build, measure and plan it here (errors raise now) and queue
        it for the devices. One that does not fit yet waits (status "queued"; built when running tasks have freed
        enough, and errors of that build go to its handle); one that could never fit raises now."""
        if not isinstance(task, ModelTask):
            raise rule_error("`task` is a hydra_tune.ModelTask", "wrap the job in ModelTask(model, optimizer, "
                             "train_data, ...)", kind=TypeError, task=type(task).__name__)
        if self.scheduler.closed:
            raise RuntimeClosed("the runtime is open, but got (closed=True). Fix: submit to a new Runtime.")
        if isinstance(task.model, nn.Module):  # (before even its meta copy; a factory's model: the build's claim)
            self.scheduler.check_model_free(task.name, task.model)
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
        """Per device: units run, busy seconds, ``unit_cpu_seconds`` (the CPU time, ``time.thread_time``, of the
        threads that ran its units, during them: on a CPU device ``busy_seconds`` less this is time its units waited
        off the CPU, for the interpreter lock beside this process's other threads or for other processes; on a GPU,
        mostly for the GPU), prefetches, measured peak/current bytes, budget; ``copies``
        (bytes host->device "h2d" and device->host "d2h" by category: state, buffers, activations, batches; and
        "syncs"), ``resident_tasks``/``resident_bytes`` (tasks' state held there) and ``evictions``. Per task:
        shards, kept shards, state, host bytes held and the footprint admission charged (tasks waiting for host
        memory: state "queued", ``waiting_for_host_memory``), and ``residency``: where its state is
        (``state_on``), steps taken on the device and on the host and why, evictions, its ``copies`` and
        ``state_bytes_after_first_step`` (moved from its first optimizer step to its last: 0 while it stays
        resident); ended tasks: the newest ``config.history``. ``host``: what ``host_memory()`` returns.
        ``shared_frozen``: the pool of frozen weights held once for several tasks (training/shared_frozen.py):
        ``shared_bytes`` (held once), ``per_task_shared_bytes``, ``saved_bytes`` (what separate copies would hold
        more), ``copied_bytes`` per device, ``hash_seconds``; each task's ``host_footprint["shared"]`` is its
        pooled part (not in its ``total``, charged once to the pool).
        ``history``: ended tasks' records kept and dropped, trace events kept and dropped (both bounded:
        ``RuntimeConfig(history=..., trace_events=...)``)."""
        tasks = self.scheduler.task_stats()
        devices = [dict(name=w.device.name, budget=w.device.budget, overhead_bytes=w.device.overhead,
                        peak_bytes=w.device.peak_bytes(), current_bytes=w.device.current_bytes(), **w.stats())
                   for w in self._workers]
        tasks.update(self._gate.waiting_stats())
        return {"devices": devices, "tasks": tasks, "policy": self.policy, "host": self.host_memory(),
                "shared_frozen": self.shared.stats(),
                "history": self._history()}

    def clock(self) -> float:
        """Seconds now on the clock of ``trace()``'s events (since this runtime started)."""
        return time.perf_counter() - self._recorder.origin

    def trace(self) -> Trace:
        """Every unit and prefetch copy so far: ``.save("trace.json")`` for Perfetto, or ``plot_timeline``."""
        return self._recorder.snapshot()

    def close(self) -> None:
        """Cancel what is still running, stop the workers. Idempotent. Returns once every device stopped, even
        when a task's host work is stuck in its data iterator (or its build, in the gate's thread, is): that
        thread is left behind (it keeps the task's memory until the iterator returns) with a RuntimeWarning
        naming the task."""
        if getattr(self, "_progress", None) is not None:
            self._progress.stop()
        pending = self.scheduler.close()
        if pending is None:
            return  # closed already
        for w in self._workers:
            w.join()
        building = self._gate.close(CLOSE_WAIT)
        for w in self._workers:
            w.shutdown()
        for task in pending:
            self.scheduler.end(task, "cancelled", RuntimeClosed(f"the runtime was closed before task {task.name!r} "
                                                                "finished"))
        for d in self.devices:
            d.resident.clear()
            if d.states is not None:
                d.states.clear()
        self.shared.forget_device_copies()  # the pool's device copies go with the devices
        stuck = [(name, "its host thread is still inside its host work") for name in
                 self.scheduler.wait_hosts(CLOSE_WAIT)]
        stuck += [(building, "its build (which takes a sample batch) is still running")] if building else []
        for name, where in stuck:
            warnings.warn(f"hydra_tune: task {name!r} ended, but {where} {CLOSE_WAIT:g} s after Runtime.close() "
                          "(most likely a `next()` of its data iterator that has not returned): the thread is left "
                          "behind and keeps the task's model, optimizer and batch in memory until that call returns."
                          " Fix: make the data iterable return or raise when it cannot deliver (a timeout on a "
                          "stream or a remote source)", RuntimeWarning, stacklevel=2)

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inside -------------------------------------------------------------------------------------------
    def _history(self) -> dict[str, Any]:
        """What the bounded buffers hold and have dropped (the oldest go first)."""
        counts, events = self.scheduler.counts(), self._recorder.counts()
        return {"ended_kept": counts["finished"], "ended_dropped": counts["finished_dropped"],
                "ended_limit": self.config.history, "trace_events": events["kept"],
                "trace_dropped": events["dropped"], "trace_limit": events["limit"]}

    def _plan_args(self) -> tuple[int | None, float | None, bool]:
        """What every task is planned with: the smallest planner budget and copy rate of the devices, and whether
        forwards may keep or offload activations (see Device.releases_graphs)."""
        budgets = [d.plan_budget for d in self.devices if d.plan_budget is not None]
        rates = [d.copy_bandwidth for d in self.devices if d.copy_bandwidth]
        return (min(budgets) if budgets else None, min(rates) if rates else None,
                all(d.releases_graphs for d in self.devices))

    def _new_handle(self, name: str) -> TaskHandle:
        return TaskHandle(name, self._cancel)

    def _start(self, handle: TaskHandle | None, task: ModelTask, footprint: Footprint,
               state: TaskState | None) -> TaskHandle:
        """Build an admitted task (unless built) and put it on the board; ``handle``: a waiting task's."""
        if state is None:
            state = TaskState.build(task, *self._plan, device=self._gate.profile_on,
                                    claim=self.scheduler.check_model_free)
        footprint = self._share_frozen(task.name, state, footprint)  # pooled weights are pinned there, once
        pooled = state.shares.keys() if state.shares is not None else set()
        self.devices[0].copier.prepare_host([p for p in state.model.parameters() if id(p) not in pooled]
                                            + list(state.model.buffers()))
        state.home.set_optimizer_bytes(footprint.optimizer)  # measured for admission: what its state will hold
        if self.config.residency == "off":
            state.home.disable("residency='off' (RuntimeConfig): its state stays in host memory")
        else:  # a task whose whole state does not fit: shards whose entries do (training/entry_plan.py)
            plan_entries(state, *self._plan, scaler_ok=all(d.steps_loss_scaler for d in self.devices))
        if handle is None:
            handle = self._new_handle(task.name)
        handle.attach(state)
        self.scheduler.admit(handle, state, footprint)
        return handle

    def _share_frozen(self, name: str, state: TaskState, footprint: Footprint) -> Footprint:
        """Put the task's frozen weights in the pool; it is charged the rest, the pool its bytes once."""
        if not self.config.share_frozen:
            return footprint
        shares = state.share_frozen(self.shared, self.devices[0].copier.prepare_host)
        if not shares.params:
            return footprint
        own = replace(footprint, params=max(footprint.params - shares.nbytes, 0), shared=shares.nbytes)
        self._gate.recharge({name: own.total, SHARED_POOL: self.shared.nbytes()})
        return own

    def _room(self, nbytes: int) -> bool:
        """The gate needs ``nbytes`` for a task: drop frozen weights kept after their last task (LRU first)."""
        if not self.shared.evict(nbytes):
            return False
        self._gate.recharge({SHARED_POOL: self.shared.nbytes()})
        return True

    def _cancel(self, handle: TaskHandle) -> None:
        if self._gate.withdraw(handle, TaskCancelled(f"task {handle.name!r} was cancelled")):
            return  # it was waiting for host memory
        queued = self.scheduler.cancel(handle)
        if queued is not None:
            self.scheduler.end(queued, "cancelled", TaskCancelled(f"task {handle.name!r} was cancelled"))

    def _release(self, task: Admitted, status: str, error: BaseException | None) -> None:
        """The board ended ``task``: free what it held (host memory charge, buffers, device copies), then tell its
        handle (after the gate's release: its name is free to reuse)."""
        detach_frames(error, task.name)
        try:
            self._gate.release(task.name)
            task.state.abandon_checkpoints(status)  # the chain and host buffers: the board lets them go after this
            self._drop_copies(task.state.execs)
            # its state back in its model, device bytes freed; if its host thread is inside its step, that thread
            # does it when it lets the task go (TrainingLoop.segments)
            task.state.home.release(wait=CLOSE_WAIT)
            # its model gets private copies of what others still share (a model only its factory made and held:
            # when handle.model() asks for it, the user cannot reach it before); the last holder frees the pool's
            # entries
            lazy = not task.state.model_reachable
            task.state.privatize = self.shared.release(task.name, task.state.model, lazy=lazy)
            self._gate.recharge({SHARED_POOL: self.shared.nbytes()})
        except Exception as exc:  # noqa: BLE001 - its handle is told whatever happens (else result() waits forever)
            status, error = _release_failed(task.name, status, error, exc)
        finally:
            for d in self.devices:
                d.forget(task.name)
            # (once: whether this runtime's CPU devices wait for the interpreter lock; never raises) before the handle
            # is told, so that a warning comes before the result that waits for it
            self._lock_note.check()
            task.handle.finish(status, error)

    def _drop_copies(self, execs: Sequence[ShardExec]) -> None:
        for d in self.devices:
            for ex in execs:
                d.resident.drop(ex)


def _release_failed(name: str, status: str, error: BaseException | None,
                    exc: Exception) -> tuple[str, BaseException | None]:
    """What an ended task's handle is told when giving its state back to its model failed: a task that trained to
    its end fails with that (its model does not hold what it trained); a failed one keeps its own error, noted."""
    if error is None:
        return "failed", exc
    error.add_note(f"hydra_tune: task {name!r}: giving its state back to its model failed too: "
                   f"{type(exc).__name__}: {exc}")
    return status, error
