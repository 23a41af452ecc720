"""What callers ask of a running task at its step boundaries, served by its loop: exact checkpoints and snapshots.

    requests = BoundaryRequests("trial-3")
    ck = requests.ask_checkpoint("ckpt/trial-3.pt")       # any thread; ck.wait() returns the path
    sn = requests.ask_snapshot()                           # any thread; sn.wait() returns a Snapshot
    requests.reach(state, Boundary(position, epoch=2, steps=40, epoch_end=False))   # the loop, after a step
    requests.leave(state)                                  # the loop, before the model next changes
    requests.finish(state.model, Boundary(None, epoch=3, steps=60, epoch_end=True))  # the loop trains no more
    requests.end("failed")                                 # the task ended otherwise (or was let go)

Rules: a request is served with the task as it stands at a step boundary (after an optimizer step, or at an
epoch's end after its evaluation), by the loop's own thread, so nothing changes the model while it is copied or
written. The task stands at a boundary until the loop hands out its next minibatch (training or evaluation): a
request asked in that time is served before the hand-out, with that boundary; one asked later waits for the next
boundary. When the loop trains no more (``finish``), waiting checkpoints fail (nothing is left to resume) and
snapshots get the final model, as do snapshots asked afterwards (served at once, in the asking thread: nothing
changes the model any more). Once the task ended otherwise (``end``: failed, cancelled), every waiting request
and every later one fails at once: none can wait forever for a boundary that will not come. Nor can the task's
own work (its model's forward, its loss, its data iterator: ``task_work``) wait for its own boundary or end:
``in_task_work(name)`` tells the handle to refuse that at once instead of hanging.
"""
from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.nn as nn

from ..errors import rule_error
from .checkpoint import Position, capture, save

if TYPE_CHECKING:
    from .state import TaskState


_work = threading.local()   # .task: the name of the task whose work (a unit, a data fetch) this thread runs


class task_work:  # noqa: N801  (used as a function: ``with task_work(name):``)
    """This thread runs ``task``'s own work inside the block (the loop wraps its units and data fetches)."""

    __slots__ = ("task", "_outer")

    def __init__(self, task: str) -> None:
        self.task = task

    def __enter__(self) -> None:
        self._outer = getattr(_work, "task", None)
        _work.task = self.task

    def __exit__(self, *exc: object) -> None:
        _work.task = self._outer


def in_task_work(task: str) -> bool:
    """Whether this thread is running ``task``'s own work now: waiting there for the task would never end."""
    return getattr(_work, "task", None) == task


@dataclass(frozen=True)
class Boundary:
    """Where a task stands at a step boundary: the checkpoint ``position`` (None at its end: nothing is left to
    resume), the epoch being trained (at an epoch end: the one just finished), the optimizer steps taken, and
    whether the epoch's last step and its evaluation are done (the state its metrics were emitted in)."""

    position: Position | None
    epoch: int
    steps: int
    epoch_end: bool


@dataclass(frozen=True)
class Snapshot:
    """A task's model as of one of its step boundaries: a copy the caller owns, and where the task stood.

        snap = handle.snapshot()                          # at the task's next step boundary (or epoch end)
        accuracy = evaluate(snap.model.eval())            # as the plain loop's model after snap.steps steps
        if snap.steps == metrics["steps"]: ...            # the weights those epoch metrics were emitted with

    ``model``: ``copy.deepcopy`` of the task's host model (CPU): parameters, buffers and Python attributes, in the
    mode the loop left it in (``train``); nothing done to it reaches the task, and it is not charged to the
    runtime's host-memory admission. ``epoch``: the epoch being trained (at an epoch end, the one just finished);
    ``steps``: optimizer steps taken; ``epoch_end``: taken after the epoch's last step and its evaluation.
    """

    model: nn.Module
    epoch: int
    steps: int
    epoch_end: bool


def take_snapshot(model: nn.Module, where: Boundary) -> Snapshot:
    """A deep copy of ``model`` labelled with ``where``; a model ``copy.deepcopy`` cannot copy raises a rule
    error (the request fails, the task goes on)."""
    try:
        copied = copy.deepcopy(model)
    except Exception as exc:  # noqa: BLE001  (TypeError, PicklingError, RecursionError, a user's __deepcopy__)
        raise rule_error("the model copies with copy.deepcopy (a snapshot is a copy the caller owns)",
                         "keep locks, threads, open files and generators out of the model's attributes, or "
                         "write handle.checkpoint(path) and load its 'model' state_dict into a model you build",
                         kind=TypeError, model=type(model).__name__, error=f"{type(exc).__name__}: {exc}"
                         ) from exc
    return Snapshot(copied, where.epoch, where.steps, where.epoch_end)


class BoundaryRequest:
    """One request to a task (``what``: "checkpoint 'path'" or "snapshot"); ``wait`` returns what it produced
    (the checkpoint's path, a Snapshot) or raises why it was not served."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._done = threading.Event()
        self._result: tuple[Any, BaseException | None] = (None, None)

    def finish(self, value: Any, error: BaseException | None) -> None:
        self._result = (value, error)
        self._done.set()

    def settle(self, produce: Callable[[], Any]) -> None:
        """Finish with ``produce()``, or with the error it raised (the request fails, never the task)."""
        try:
            value = produce()
        except BaseException as exc:  # noqa: BLE001  (a full disk, a model that does not copy: the asker's news)
            self.finish(None, exc)
            return
        self.finish(value, None)

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done.wait(timeout):
            raise TimeoutError(f"no step boundary within {timeout} s for {self.what}")
        value, error = self._result
        if error is not None:
            raise error
        return value


class BoundaryRequests:
    """The checkpoints and snapshots asked of one task and not yet served (see the module docstring)."""

    def __init__(self, task: str) -> None:
        self.task = task
        self._lock = threading.Lock()
        self._checkpoints: list[tuple[BoundaryRequest, str]] = []
        self._snapshots: list[BoundaryRequest] = []
        self._standing: Boundary | None = None   # the boundary the model still stands at (reach .. leave)
        self._final: tuple[nn.Module, Boundary] | None = None   # the model once the loop trains no more
        self._ended: str | None = None           # why the task trains no more

    # -- any thread -----------------------------------------------------------------------------------------
    def ask_checkpoint(self, path: str) -> BoundaryRequest:
        """A checkpoint written to ``path`` at the task's next step boundary (or epoch end)."""
        req = BoundaryRequest(f"checkpoint {path!r}")
        with self._lock:
            ended = self._ended
            if ended is None:
                self._checkpoints.append((req, path))
        if ended is not None:  # asked after the last chance to serve it
            req.finish(None, self._late(ended, "checkpoint"))
        return req

    def ask_snapshot(self) -> BoundaryRequest:
        """A Snapshot of the model at the task's next step boundary (or epoch end; its final model once done)."""
        req = BoundaryRequest("snapshot")
        with self._lock:
            ended, final = self._ended, self._final
            if ended is None:
                self._snapshots.append(req)
        if final is not None:  # the loop is through: its model changes no more, copy it here
            req.settle(lambda: take_snapshot(*final))
        elif ended is not None:
            req.finish(None, self._late(ended, "snapshot"))
        return req

    def waiting(self) -> bool:
        """Whether a checkpoint or snapshot is asked and not yet served (read without the lock: a hint)."""
        return bool(self._checkpoints or self._snapshots)

    # -- the task's loop ------------------------------------------------------------------------------------
    def reach(self, state: TaskState, where: Boundary) -> None:
        """The task stands at a step boundary: serve what was asked, and what is asked until ``leave``."""
        with self._lock:
            self._standing = where
        self._serve(state, where)

    def leave(self, state: TaskState) -> None:
        """The loop is about to change the model (it hands out a minibatch): serve what was asked while it stood
        at the last boundary; from now on requests wait for the next one."""
        with self._lock:
            where, self._standing = self._standing, None
        if where is not None:
            self._serve(state, where)

    def finish(self, model: nn.Module, where: Boundary) -> None:
        """The loop trains no more and ``model`` is final: waiting snapshots get it (and later ones), waiting
        checkpoints fail."""
        with self._lock:
            self._final, self._ended, self._standing = (model, where), self._ended or "finished", None
            snapshots, self._snapshots = self._snapshots, []
            checkpoints, self._checkpoints = self._checkpoints, []
        for req in snapshots:
            req.settle(lambda: take_snapshot(model, where))
        for req, _ in checkpoints:
            req.finish(None, self._late("finished", "checkpoint"))

    def end(self, why: str) -> None:
        """Fail every waiting request, and any asked from now on (snapshots of a finished loop excepted)."""
        with self._lock:
            self._ended, self._standing = self._ended or why, None
            waiting = [r for r, _ in self._checkpoints] + self._snapshots
            self._checkpoints, self._snapshots = [], []
        for req in waiting:
            req.finish(None, self._late(why, req.what.split()[0]))

    # -- inside ---------------------------------------------------------------------------------------------
    def _serve(self, state: TaskState, where: Boundary) -> None:
        with self._lock:
            snapshots, self._snapshots = self._snapshots, []
            checkpoints, self._checkpoints = self._checkpoints, []
        if not (snapshots or checkpoints):
            return
        home = getattr(state, "home", None)  # where its state is (training/resident.py); serving reads the model
        if home is not None:
            home.flush()  # pending per-shard updates (lazy.py) first: the model and optimizer as after the step
        try:
            with home.on_host() if home is not None else contextlib.nullcontext():  # resident: host copies
                self._produce(state, where, snapshots, checkpoints)
        except BaseException as exc:  # noqa: BLE001  (copying the state home failed: the askers' news, not the task's)
            for req in snapshots + [r for r, _ in checkpoints]:
                if not req._done.is_set():
                    req.finish(None, exc)

    def _produce(self, state: TaskState, where: Boundary, snapshots: list[BoundaryRequest],
                 checkpoints: list[tuple[BoundaryRequest, str]]) -> None:
        for req in snapshots:
            req.settle(lambda: take_snapshot(state.model, where))
        for req, path in checkpoints:
            position = where.position
            if position is None:
                req.finish(None, self._late("finished", "checkpoint"))
            else:
                req.settle(lambda path=path, position=position: save(capture(state, position), path))

    def _late(self, why: str, what: str) -> RuntimeError:
        return RuntimeError(f"task {self.task!r} {why} before a {what} could be taken")
