"""The caller's view of one submitted task: metrics as they come, the result, the trained model, cancel.

    handle = runtime.submit(task)
    for metrics in handle.metrics():
        snap = handle.snapshot()                # a copy of the model at the task's next step boundary
        print(metrics["epoch"], metrics["train_loss"], snap.steps)
    model = handle.model()                      # the trained model, in host memory, once the task ended

Two sides. Callers read: ``metrics``, ``result``, ``model``, ``snapshot``, ``checkpoint``, ``cancel``,
``status``, ``done``. ``model()`` is the trained model only: on a task that has not ended it raises at once
(it neither waits nor returns the model of another moment); ``snapshot()`` is the model as of a step boundary.
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

from ..device.threads import release_idle_pool
from ..errors import rule_error
from ..training.boundary import Boundary, Snapshot, in_task_work, take_snapshot

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
    ``attach(state)`` gives the handle the built task: checkpoints and snapshots are served by it, and its model
    is the result.
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
        self._privatize: Callable[[], None] | None = None
        self._final: tuple[int, int] | None = None   # (epoch, steps) of the done task's model
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
        """The trained model (on CPU, host memory) of a task that has ended.

            for m in handle.metrics(): ...              # to the end (or handle.result())
            model = handle.model()

        Rules: the task has ended. On a queued or running task it raises at once (RuntimeError naming the task
        and its status): it never waits and never hands out the model of another moment. For the weights while
        it trains, take ``snapshot()``. A failed or cancelled task raises its own error, as ``result()`` does.
        Done: the model itself (not a copy), every call the same object.
        """
        if not self.done():
            raise self._not_ended()
        self._raise()
        return self._trained()

    def snapshot(self, timeout: float | None = None) -> Snapshot:
        """A copy of the model as of the task's next optimizer-step boundary (or epoch end), with where it stood.

            snap = handle.snapshot(timeout=60)
            accuracy = evaluate(snap.model.eval())      # as the plain loop's model after snap.steps steps

        Served by the task's loop as checkpoints are (training/boundary.py): at the step boundary it stands at,
        if it has not handed out its next minibatch yet, else at its next one; ``snap.steps`` and
        ``snap.epoch_end`` say which (in a metrics loop it may lie past the epoch just reported:
        ``snap.steps == metrics["steps"]`` when it does not). Rules: a done task gives its final model (a copy);
        a failed or cancelled one raises (RuntimeError, from its error); a task still waiting for host memory
        raises (it has no model yet); so does a call from the task's own work (its forward, loss or data, which
        its boundary waits for); ``timeout`` seconds without a boundary raise TimeoutError. Each snapshot is a
        full copy of the model in host memory, not charged to the runtime's host-memory admission.
        """
        if self._status == "done":
            return self._final_snapshot()
        state = self._state
        if self.done() or state is None:
            raise self._no_snapshot()
        self._not_in_own_work("snapshot()")
        return state.request_snapshot().wait(timeout)

    def checkpoint(self, path: str, timeout: float | None = None) -> str:
        """Write an exact checkpoint at the task's next optimizer-step boundary (or epoch end) to ``path``
        (atomically) and return the path; ``ModelTask(..., resume_from=path)`` continues from it."""
        state = self._state
        if state is None or self.done():
            raise self.not_running_error()
        self._not_in_own_work("checkpoint()")
        return state.request_checkpoint(os.fspath(path)).wait(timeout)

    def cancel(self) -> None:
        """Stop the task at its next unit boundary and free its state; a finished task is left as it is."""
        self._on_cancel(self)

    def done(self) -> bool:
        return self._status in ENDED

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the task ends (or ``timeout`` passes); whether it ended. Raises nothing, but refuses to
        wait without a timeout inside the task's own work (its forward, loss or data: that would never end)."""
        if timeout is None:
            self._not_in_own_work("waiting for its end (result(), wait())")
        if self._status not in ENDED:
            release_idle_pool()  # the waiting thread's idle OpenMP team would slow the devices' ops (threads.py)
        with self._cond:
            return self._cond.wait_for(lambda: self._status in ENDED, timeout)

    def watch(self, seen: int = 0, status: str | None = None, timeout: float | None = None) -> Progress:
        """Block until there are metrics past the first ``seen``, the status differs from ``status`` (None: the
        task ends), or ``timeout`` passes; what there is then. Without a timeout, not inside the task's own work."""
        if timeout is None:
            self._not_in_own_work("waiting for its metrics (metrics(), watch())")

        def changed() -> bool:
            return len(self._metrics) > seen or self._status in ENDED or (status is not None and
                                                                           self._status != status)
        if not changed():
            release_idle_pool()
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
                self._privatize = self._state.privatize  # its shared frozen weights copied on first model()
                self._final = (self._state.epoch, self._state.steps)
            self._status, self._error, self._state = status, error, None
            self._cond.notify_all()

    # -- inside ---------------------------------------------------------------------------------------------
    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _trained(self) -> Any:
        """The done task's model (a remote handle fetches it), with private copies of the frozen weights it
        shared with other tasks (training/shared_frozen.py), made on the first call."""
        if self._privatize is not None:  # once: later calls (and one waiting on the first) find nothing to copy
            self._privatize()
        return self._model

    def _final_snapshot(self) -> Snapshot:
        last = self._metrics[-1] if self._metrics else {}
        epoch, steps = self._final or (int(last.get("epoch", 0)), int(last.get("steps", 0)))
        return take_snapshot(self._trained(), Boundary(None, epoch, steps, True))

    def _not_ended(self) -> Exception:
        fix = ("iterate handle.metrics() (or hydra_tune.train(task)) to its end, or call handle.result(), before "
               "model(); for the weights while it trains, take handle.snapshot().model")
        if self.cancel_requested:
            fix = "the task is being cancelled: handle.result() raises TaskCancelled once it stopped"
        return rule_error("the task has ended: model() returns the trained model", fix, kind=RuntimeError,
                          task=self.name, status=self._status)

    def _no_snapshot(self) -> Exception:
        if self.done():
            exc = rule_error("the task is running or done: snapshot() copies its model", "take snapshots before "
                             "it fails or is cancelled (its error is chained below)", kind=RuntimeError,
                             task=self.name, status=self._status, error=repr(self._error))
            exc.__cause__ = self._error
            return exc
        return rule_error("the task is built: snapshot() copies its model", "wait until it runs "
                          "(handle.watch(status='queued')) or for its first metrics", kind=RuntimeError,
                          task=self.name, status=self._status, waiting_for="host memory")

    def _not_in_own_work(self, what: str) -> None:
        if in_task_work(self.name):  # the task's boundary, metrics and end all wait for this very work to return
            raise rule_error(f"{what} is called outside the task's own work", "call it from the thread that "
                             "iterates the task's metrics (or any thread of yours), not from its model's forward, "
                             "its loss or its data iterator, which the task itself is running",
                             kind=RuntimeError, task=self.name, status=self._status,
                             thread=threading.current_thread().name)

    def not_running_error(self) -> RuntimeError:
        """The error of a checkpoint asked of a task that no longer trains (the remote handle raises it too)."""
        return RuntimeError(f"task {self.name!r} is {self._status}: a checkpoint needs a running task. Fix: "
                            "checkpoint before it ends (or keep the returned model).")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self._status})"
