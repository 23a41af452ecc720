"""The runtime: one per node; owns the devices, admits tasks, and runs every task's units on every device.

    with Runtime(devices=["cpu", "cpu"], device_memory="64MiB") as rt:
        handles = [rt.submit(task) for task in tasks]
        print([h.result()["train_loss"] for h in handles], rt.stats())

One worker thread per device loops: take the ready task the policy picks, advance its unit chain by one unit
(host-side work included), run that unit on the device, make the task ready again. A task runs on at most one
device at a time and may move between units; tasks are independent, so all devices stay busy while enough tasks
are ready. A task's failure or cancellation ends that task only.
"""
from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

from ._dispatch import UnitMode
from .devices import Device, resolve_devices
from .errors import RuntimeClosed, TaskCancelled, rule_error
from .program import TaskState, Unit
from .schedule import POLICIES, Ready
from .task import ModelTask

_STATES = ("queued", "running", "done", "failed", "cancelled")


class TaskHandle:
    """The caller's view of a submitted task: metrics as they come, the result, the trained model, cancel."""

    def __init__(self, runtime: "Runtime", state: TaskState) -> None:
        self.name = state.task.name
        self._runtime = runtime
        self._state: TaskState | None = state
        self._cond = threading.Condition()
        self._metrics: list[dict[str, Any]] = []
        self._status = "queued"
        self._error: BaseException | None = None
        self._model: Any = None
        self.cancel_requested = False

    @property
    def status(self) -> str:
        return self._status

    def metrics(self) -> Iterator[dict[str, Any]]:
        """Per-epoch metrics as they are produced; raises the task's error (or TaskCancelled) at the end."""
        i = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self._metrics) > i or self._status in _STATES[2:])
                fresh, ended = self._metrics[i:], self._status in _STATES[2:]
            yield from fresh
            i += len(fresh)
            if ended and i == len(self._metrics):
                self._raise()
                return

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """Block until the task ends; the last epoch's metrics, or the task's error re-raised."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._status in _STATES[2:], timeout):
                raise TimeoutError(f"task {self.name!r} still {self._status} after {timeout} s")
        self._raise()
        return dict(self._metrics[-1]) if self._metrics else {}

    def model(self) -> Any:
        """The trained model (on CPU, host memory) once the task is done."""
        self.result()
        return self._model

    def cancel(self) -> None:
        """Stop the task at its next unit boundary and free its state; a finished task is left as it is."""
        self._runtime._cancel(self)

    def done(self) -> bool:
        return self._status in _STATES[2:]

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _finish(self, status: str, error: BaseException | None = None) -> None:
        with self._cond:
            if self._status in _STATES[2:]:
                return
            if status == "done" and self._state is not None:
                self._model = self._state.model
            self._status, self._error, self._state = status, error, None
            self._cond.notify_all()

    def _set_running(self) -> None:
        with self._cond:
            if self._status == "queued":
                self._status = "running"

    def _emit(self, metrics: dict[str, Any]) -> None:
        with self._cond:
            self._metrics.append(dict(metrics, task=self.name))
            self._cond.notify_all()

    def __repr__(self) -> str:
        return f"TaskHandle({self.name!r}, {self._status})"


class _Admitted:
    """Runtime-private bookkeeping of one task between units."""

    def __init__(self, handle: TaskHandle, state: TaskState) -> None:
        self.handle, self.state = handle, state
        self.chain: Iterator[Unit] = state.units(handle._emit)
        self.last_device: int | None = None
        self.units = 0


class Runtime:
    """Owns the node's devices and runs the units of every admitted task on them."""

    def __init__(self, devices: int | str | Sequence[str] = "auto", device_memory: int | str | None = None,
                 *, policy: str = "fifo") -> None:
        if policy not in POLICIES:
            raise rule_error(f"`policy` in {sorted(POLICIES)}", "pick one of those names", policy=policy)
        self.devices: list[Device] = resolve_devices(devices, device_memory)
        self._pick = POLICIES[policy]
        self._cond = threading.Condition()
        self._ready: list[tuple[Ready, _Admitted]] = []
        self._tasks: dict[str, _Admitted] = {}
        self._finished: dict[str, dict[str, Any]] = {}
        self._seq = 0
        self._closed = False
        self._dev_stats = [{"units": 0, "busy_seconds": 0.0} for _ in self.devices]
        self._workers = [threading.Thread(target=self._work, args=(i,), name=f"hydra-{d.name}", daemon=True)
                         for i, d in enumerate(self.devices)]
        self._started = [threading.Event() for _ in self.devices]
        self._start_errors: list[BaseException] = []
        for w in self._workers:
            w.start()
        for e in self._started:  # device set-up (e.g. CUDA workspaces) is done before any task is planned
            e.wait()
        if self._start_errors:
            self.close()
            raise self._start_errors[0]

    # -- public ---------------------------------------------------------------------------------------------
    def submit(self, task: ModelTask) -> TaskHandle:
        """Build, measure and plan ``task`` here (errors raise now), then queue it for the devices."""
        if not isinstance(task, ModelTask):
            raise rule_error("`task` is a hydra_tune.ModelTask", "wrap the job in ModelTask(model, optimizer, "
                             "train_data, ...)", kind=TypeError, task=type(task).__name__)
        if self._closed:
            raise RuntimeClosed("the runtime is open, but got (closed=True). Fix: submit to a new Runtime.")
        budgets = [d.plan_budget for d in self.devices if d.plan_budget is not None]
        state = TaskState.build(task, min(budgets) if budgets else None)
        self.devices[0].copier.prepare_host(list(state.model.parameters()) + list(state.model.buffers()))
        handle = TaskHandle(self, state)
        with self._cond:
            if task.name in self._tasks:
                raise rule_error("task names are unique among running tasks", "give each ModelTask its own "
                                 "`name`", name=task.name)
            shared = [n for n, a in self._tasks.items() if a.state.model is state.model]
            if shared:
                raise rule_error("each running task trains its own model object", "pass a factory "
                                 "(`lambda: MyModel()`) or a fresh module per task", task=task.name,
                                 model_also_in=shared[0])
            adm = _Admitted(handle, state)
            self._tasks[task.name] = adm
            self._push(adm)
        return handle

    def stats(self) -> dict[str, Any]:
        """Per device: units run, busy seconds, measured peak/current bytes, budget. Per task: shards, state."""
        with self._cond:
            tasks = {name: self._task_stats(a) for name, a in self._tasks.items()}
            tasks.update({n: s for n, s in self._finished.items() if n not in tasks})
            devices = [dict(name=d.name, budget=d.budget, overhead_bytes=d.overhead, peak_bytes=d.peak_bytes(),
                            current_bytes=d.current_bytes(), **self._dev_stats[i]) for i, d in enumerate(self.devices)]
        return {"devices": devices, "tasks": tasks}

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
        for adm in pending:
            self._end(adm, "cancelled", RuntimeClosed(f"the runtime was closed before task {adm.handle.name!r} "
                                                      "finished"))

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- workers --------------------------------------------------------------------------------------------
    def _push(self, adm: _Admitted) -> None:
        self._seq += 1
        self._ready.append((Ready(adm.handle.name, self._seq, adm.last_device), adm))
        self._cond.notify()

    def _work(self, index: int) -> None:
        device = self.devices[index]
        try:
            device.start()
        except BaseException as exc:  # reported by __init__, which is waiting for this device
            self._start_errors.append(exc)
            return
        finally:
            self._started[index].set()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._ready)
                if self._closed:
                    return
                pos = self._pick([r for r, _ in self._ready], index)
                _, adm = self._ready.pop(pos)
            self._advance(adm, index, device)

    def _advance(self, adm: _Admitted, index: int, device: Device) -> None:
        if adm.handle.cancel_requested:
            self._end(adm, "cancelled", TaskCancelled(f"task {adm.handle.name!r} was cancelled"))
            return
        adm.handle._set_running()
        try:
            with UnitMode(adm.state.rng.cpu):  # host work between units draws from the task's stream
                unit = next(adm.chain)
            t0 = time.perf_counter()
            unit.run(device)
            busy = time.perf_counter() - t0
        except StopIteration:
            self._end(adm, "done")
            return
        except BaseException as exc:  # one task's failure is that task's alone
            self._end(adm, "failed", exc)
            return
        with self._cond:
            self._dev_stats[index]["units"] += 1
            self._dev_stats[index]["busy_seconds"] += busy
            adm.units += 1
            adm.last_device = index
            if not self._closed:
                self._push(adm)

    def _cancel(self, handle: TaskHandle) -> None:
        with self._cond:
            handle.cancel_requested = True
            adm = self._tasks.get(handle.name)
            queued = adm is not None and any(a is adm for _, a in self._ready)
            if queued:
                self._ready = [(r, a) for r, a in self._ready if a is not adm]
        if queued:
            self._end(adm, "cancelled", TaskCancelled(f"task {handle.name!r} was cancelled"))

    def _end(self, adm: _Admitted, status: str, error: BaseException | None = None) -> None:
        with self._cond:
            if self._tasks.get(adm.handle.name) is not adm:
                return  # already ended (e.g. finished while the runtime was closing)
            del self._tasks[adm.handle.name]
            self._finished[adm.handle.name] = dict(self._task_stats(adm), state=status)
        if error is not None and error.__traceback__ is not None:
            # The traceback's frames hold the failed unit's device tensors: drop their locals, keep the trace.
            traceback.clear_frames(error.__traceback__)
        adm.chain.close()
        adm.state.store.clear()
        adm.handle._finish(status, error)
        adm.state = None  # type: ignore[assignment]  # drop the model, optimizer and store now

    @staticmethod
    def _task_stats(adm: _Admitted) -> dict[str, Any]:
        st = adm.state
        return {"state": adm.handle.status, "shards": [list(ex.names) for ex in st.execs], "steps": st.steps,
                "epoch": st.epoch, "units": adm.units, "host_bytes": st.host_bytes(),
                "predicted_peak": st.plan.peak}
