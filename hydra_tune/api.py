"""The process-wide default runtime and ``train``, the call a trial's code makes.

    hydra_tune.configure(devices=["cpu", "cpu"], device_memory="64MiB")
    for metrics in hydra_tune.train(task):          # submits to the default runtime, streams epoch metrics
        report(metrics)                              # leaving the loop early cancels the task
        hydra_tune.save_checkpoint("ckpt.pt")           # exact checkpoint of the task this thread is training
"""
from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .config import RuntimeConfig
from .errors import rule_error
from .runtime.handle import TaskHandle
from .runtime.runtime import Runtime
from .task import ModelTask

_lock = threading.Lock()
_default: Runtime | None = None
_config = RuntimeConfig()
# Per thread: .submit, where its ``train`` sends tasks (set by ``bind``: an Optuna trial's study, a Tune trial's
# node runtime); .handle, the task its latest ``train`` submitted (``current_handle``). Thread-local, so a trial
# thread's record goes with the thread and no other thread can reach (or cancel) it.
_bound = threading.local()


def configure(devices: int | str | Sequence[str] = "auto", device_memory: int | str | None = None,
              host_memory: int | str | None = None, *, policy: str = "lrtf",
              config: RuntimeConfig | None = None) -> None:
    """Set the default runtime's settings (a ``RuntimeConfig``, or its four keywords; validated now); a running
    default runtime is closed and replaced lazily."""
    global _default, _config
    new = RuntimeConfig.of(config, devices=devices, device_memory=device_memory, host_memory=host_memory,
                           policy=policy)
    with _lock:
        _config, old, _default = new, _default, None
    if old is not None:
        old.close()


def default_runtime() -> Runtime:
    """This process's runtime, created on first use from ``configure``'s settings."""
    global _default
    with _lock:
        if _default is None:
            _default = Runtime(config=_config)
        return _default


@contextmanager
def bind(submit: Callable[[ModelTask], TaskHandle]) -> Iterator[None]:
    """Inside the block, this thread's ``train(task)`` (without ``runtime=``) submits through ``submit``.

        with bind(lambda task: study.submit(trial, task)):   # how a trial's code reaches its study's runtime
            value = objective(trial)

    Rules: ``submit`` returns the task's ``TaskHandle``. The block is a scope: inside it ``current_handle`` knows
    only tasks that ``train`` submitted inside it (a pooled thread's next trial never sees the last one's), and
    on exit the thread's previous ``submit`` and handle are back. Blocks nest.
    """
    previous = (getattr(_bound, "submit", None), getattr(_bound, "handle", None), getattr(_bound, "owned", None))
    _bound.submit, _bound.handle, _bound.owned = submit, None, []
    try:
        yield
    finally:
        owned = _bound.owned
        _bound.submit, _bound.handle, _bound.owned = previous
        for handle in owned:  # prepared models of this scope (a pruned or stopped trial): released at once
            _cancel_unfinished(handle)


def train(task: ModelTask, runtime: Runtime | None = None) -> Iterator[dict[str, Any]]:
    """Submit ``task`` to ``runtime`` now and return an iterator of its per-epoch metrics. Without ``runtime``: the
    runtime of the ``bind`` block this thread is in (an Optuna trial's study, a Tune trial's node runtime), else
    the process's default runtime.

        for m in hydra_tune.train(task): print(m["epoch"], m["train_loss"])

    Rules: the task is submitted by this call, not by the first iteration: submit errors raise here, and from here
    on ``current_handle()`` is this task's. Closing the iterator early (``break``, an exception, garbage
    collection, an iterator dropped before its first item) cancels the task.
    """
    try:
        handle = submit(task, runtime)
    except BaseException as exc:  # current_handle() must not return the task of an earlier train() now
        _bound.handle = _NotSubmitted(getattr(task, "name", None), f"{type(exc).__name__}: {exc}")
        raise
    _bound.handle = handle
    metrics = _metrics(handle)
    # a generator never started runs no `finally` when it is collected: this cancels such a task too
    weakref.finalize(metrics, _cancel_unfinished, handle).atexit = False
    return metrics


def submit(task: ModelTask, runtime: Runtime | None = None, scoped: bool = False) -> TaskHandle:
    """Submit ``task`` where ``train`` would (``runtime``, else this thread's ``bind`` block, else the default
    runtime) and return its handle; ``scoped``: the task is cancelled when the ``bind`` block ends (used by
    ``hydra_tune.prepare``: a trial that leaves its objective frees its prepared model at once).

        handle = hydra_tune.api.submit(task)
    """
    bound = getattr(_bound, "submit", None)
    if runtime is not None:
        handle = runtime.submit(task)
    elif bound is not None:
        handle = bound(task)
    else:
        handle = default_runtime().submit(task)
    owned = getattr(_bound, "owned", None)
    if scoped and owned is not None and runtime is None and bound is not None:
        owned.append(handle)
    return handle


def _metrics(handle: TaskHandle) -> Iterator[dict[str, Any]]:
    try:
        yield from handle.metrics()
    finally:
        _cancel_unfinished(handle)


def _cancel_unfinished(handle: TaskHandle) -> None:
    if not handle.done():
        handle.cancel()


class _NotSubmitted:
    """The record of a ``train`` call whose submit raised (``task``'s name and the error, in words)."""

    def __init__(self, task: str | None, error: str) -> None:
        self.task, self.error = task, error


def current_handle() -> TaskHandle:
    """The handle of the task this thread's latest ``train(...)`` submitted (running or ended), from the moment
    ``train`` returns.

        for m in hydra_tune.train(task):
            snap = hydra_tune.current_handle().snapshot()   # the weights as of the task's next step boundary
            report(m, accuracy=evaluate(snap.model.eval()), at_steps=snap.steps)
        model = hydra_tune.current_handle().model()     # the trained model once the loop is through

    Rules: ``model()`` is the trained model of an ended task: inside the loop the task is still running and it
    raises at once; take ``snapshot()`` there (a copy, as of a step boundary: ``snap.steps`` says which; it may
    lie a step or more past the epoch just reported). After a ``train`` call that raised (its submit failed) it
    raises too, naming that error: it never returns the task of an earlier call. The record is this thread's:
    another thread (a pool's worker, an evaluation thread) gets its own or none, so hand it the ``TaskHandle``
    itself.
    """
    handle = getattr(_bound, "handle", None)
    if isinstance(handle, _NotSubmitted):
        raise rule_error("this thread's latest `hydra_tune.train(task)` submitted its task", "handle the error "
                         "that train() raised; current_handle() refers to the task of a train() call that "
                         "returned", kind=RuntimeError, task=handle.task, error=handle.error)
    if handle is None:
        raise rule_error("`hydra_tune.train(task)` was started in this thread before", "call "
                         "hydra_tune.save_checkpoint/current_handle inside the `for metrics in hydra_tune.train(task)` "
                         "loop, or keep the TaskHandle of `runtime.submit(task)`", kind=RuntimeError,
                         thread=threading.current_thread().name)
    return handle


def save_checkpoint(path: str, timeout: float | None = None) -> str | None:
    """Exact checkpoint of the task this thread is training, at its next step boundary (``TaskHandle.checkpoint``);
    the path, or None when the task finished its training first (nothing is left to resume).

        for m in hydra_tune.train(task):
            if hydra_tune.save_checkpoint(os.path.join(d, "task.pt")):   # resume_from=that file continues exactly
                tune.report(m, checkpoint=tune.Checkpoint.from_directory(d))
    """
    handle = current_handle()
    try:
        return handle.checkpoint(path, timeout)
    except RuntimeError:
        try:   # the task may be ending right now: its pending checkpoint is abandoned just before it is marked
            handle.result(timeout=10)
        except Exception:  # noqa: BLE001  (its own error, a timeout: the checkpoint error below is the news)
            pass
        if handle.status == "done":
            return None
        raise


@atexit.register
def _close_default() -> None:
    if _default is not None:
        _default.close()
