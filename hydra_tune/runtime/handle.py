"""The caller's view of one submitted task: metrics as they come, the result, the trained model, cancel.

    handle = runtime.submit(task)
    for metrics in handle.metrics(): print(metrics["epoch"], metrics["train_loss"])
    model = handle.model()                      # the trained model, in host memory

Two sides. Callers read: ``metrics``, ``result``, ``model``, ``checkpoint``, ``cancel``, ``status``, ``done``.
Whoever runs the task writes, in this order: ``started`` (a device takes it first), ``emit`` (each epoch's
metrics), ``finish`` (once: done, failed or cancelled; later calls are ignored). ``watch`` lets a forwarder
(the node server) follow a handle without polling.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..training.state import TaskState

STATES = ("queued", "running", "done", "failed", "cancelled")
ENDED = STATES[2:]


@dataclass(frozen=True)
class Progress:
    """What ``TaskHandle.watch`` saw: metrics after the ones already seen, the status, and the error once ended."""

    fresh: list[dict[str, Any]]
    status: str
    error: BaseException | None

    @property
    def ended(self) -> bool:
        return self.status in ENDED


class TaskHandle:
    """The caller's view of a submitted task: metrics as they come, the result, the trained model, cancel.

    ``on_cancel(handle)`` is how ``cancel`` reaches whoever runs the task (the runtime; a node connection).
    ``attach(state)`` gives the handle the built task: checkpoints are served by it, and its model is the result.
    """

    def __init__(self, name: str, on_cancel: Callable[["TaskHandle"], None]) -> None:
        self.name = name
        self._on_cancel = on_cancel
        self._state: TaskState | None = None
        self._cond = threading.Condition()
        self._metrics: list[dict[str, Any]] = []
        self._status = "queued"
        self._error: BaseException | None = None
        self._model: Any = None
        self.cancel_requested = False

    @property
    def status(self) -> str:
        return self._status

    @property
    def error(self) -> BaseException | None:
        """The task's error (``TaskCancelled`` when cancelled) once it ended; None before and when done."""
        return self._error

    # -- the caller's side ------------------------------------------------------------------------------------
    def metrics(self) -> Iterator[dict[str, Any]]:
        """Per-epoch metrics as they are produced; raises the task's error (or TaskCancelled) at the end."""
        seen = 0
        while True:
            progress = self.watch(seen)
            yield from progress.fresh
            seen += len(progress.fresh)
            if progress.ended:  # nothing is emitted after the end: every metric is out
                self._raise()
                return

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """Block until the task ends; the last epoch's metrics, or the task's error re-raised."""
        if not self.wait(timeout):
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
            raise self._not_running()
        return state.request_checkpoint(os.fspath(path)).wait(timeout)

    def cancel(self) -> None:
        """Stop the task at its next unit boundary and free its state; a finished task is left as it is."""
        self._on_cancel(self)

    def done(self) -> bool:
        return self._status in ENDED

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the task ends (or ``timeout`` passes); whether it ended. Raises nothing."""
        with self._cond:
            return self._cond.wait_for(lambda: self._status in ENDED, timeout)

    def watch(self, seen: int = 0, status: str | None = None, timeout: float | None = None) -> Progress:
        """Block until there are metrics past the first ``seen``, the status differs from ``status`` (None: the
        task ends), or ``timeout`` passes; what there is then."""
        def changed() -> bool:
            return len(self._metrics) > seen or self._status in ENDED or (status is not None and
                                                                           self._status != status)
        with self._cond:
            self._cond.wait_for(changed, timeout)
            return Progress(list(self._metrics[seen:]), self._status, self._error)

    # -- the side that runs the task ------------------------------------------------------------------------
    def attach(self, state: TaskState) -> None:
        """The task is built: ``state`` serves its checkpoints and holds its model."""
        self._state = state

    def started(self) -> None:
        """A device took the task for the first time: queued -> running (watchers are told)."""
        with self._cond:
            if self._status == "queued":
                self._status = "running"
                self._cond.notify_all()

    def emit(self, metrics: dict[str, Any]) -> None:
        """One epoch's metrics, labelled with the task's name."""
        with self._cond:
            self._metrics.append(dict(metrics, task=self.name))
            self._cond.notify_all()

    def finish(self, status: str, error: BaseException | None = None) -> None:
        """The task ended (``status`` in done, failed, cancelled); the first call counts. Done: the attached
        state's model becomes the result. The state itself is let go (its optimizer, its buffers)."""
        if status not in ENDED:
            raise ValueError(f"a task ends as one of {ENDED}, not {status!r}")
        with self._cond:
            if self._status in ENDED:
                return
            if status == "done" and self._state is not None:
                self._model = self._state.model
            self._status, self._error, self._state = status, error, None
            self._cond.notify_all()

    # -- inside ---------------------------------------------------------------------------------------------
    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _not_running(self) -> RuntimeError:
        return RuntimeError(f"task {self.name!r} is {self._status}: a checkpoint needs a running task. Fix: "
                            "checkpoint before it ends (or keep the returned model).")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self._status})"
