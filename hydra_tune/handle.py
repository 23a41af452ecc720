"""The caller's view of one submitted task: metrics as they come, the result, the trained model, cancel.

    handle = runtime.submit(task)
    for metrics in handle.metrics(): print(metrics["epoch"], metrics["train_loss"])
    model = handle.model()                      # the trained model, in host memory
"""
from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .program import TaskState
    from .runtime import Runtime

STATES = ("queued", "running", "done", "failed", "cancelled")
ENDED = STATES[2:]


class TaskHandle:
    """The caller's view of a submitted task: metrics as they come, the result, the trained model, cancel."""

    def __init__(self, runtime: "Runtime", state: TaskState | None, name: str | None = None) -> None:
        self.name = state.task.name if state is not None else name  # no state yet: waiting for host memory
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
                self._cond.wait_for(lambda: len(self._metrics) > i or self._status in ENDED)
                fresh, ended = self._metrics[i:], self._status in ENDED
            yield from fresh
            i += len(fresh)
            if ended and i == len(self._metrics):
                self._raise()
                return

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """Block until the task ends; the last epoch's metrics, or the task's error re-raised."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._status in ENDED, timeout):
                raise TimeoutError(f"task {self.name!r} still {self._status} after {timeout} s")
        self._raise()
        return dict(self._metrics[-1]) if self._metrics else {}

    def model(self) -> Any:
        """The trained model (on CPU, host memory) once the task is done."""
        self.result()
        return self._model

    def checkpoint(self, path: str, timeout: float | None = None) -> str:
        """Write an exact checkpoint at the task's next optimizer-step boundary (or epoch end) to ``path``
        (atomically) and return the path; ``ModelTask(..., resume_from=path)`` continues from it."""
        state = self._state
        if state is None or self.done():
            raise RuntimeError(f"task {self.name!r} is {self._status}: a checkpoint needs a running task. Fix: "
                               "checkpoint before it ends (or keep the returned model).")
        return state.request_checkpoint(os.fspath(path)).wait(timeout)

    def cancel(self) -> None:
        """Stop the task at its next unit boundary and free its state; a finished task is left as it is."""
        self._runtime._cancel(self)

    def done(self) -> bool:
        return self._status in ENDED

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _finish(self, status: str, error: BaseException | None = None) -> None:
        with self._cond:
            if self._status in ENDED:
                return
            if status == "done" and self._state is not None:
                self._model = self._state.model
            self._status, self._error, self._state = status, error, None
            self._cond.notify_all()

    def _set_running(self) -> None:
        with self._cond:
            if self._status == "queued":
                self._status = "running"
                self._cond.notify_all()   # the node server forwards the start to its client

    def _emit(self, metrics: dict[str, Any]) -> None:
        with self._cond:
            self._metrics.append(dict(metrics, task=self.name))
            self._cond.notify_all()

    def __repr__(self) -> str:
        return f"TaskHandle({self.name!r}, {self._status})"
