"""The process-wide default runtime and ``train``, the call a trial's code makes.

    hydra_tune.configure(devices=["cpu", "cpu"], device_memory="64MiB")
    for metrics in hydra_tune.train(task):          # submits to the default runtime, streams epoch metrics
        report(metrics)                              # leaving the loop early cancels the task
"""
from __future__ import annotations

import atexit
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from .runtime import Runtime
from .task import ModelTask

_lock = threading.Lock()
_default: Runtime | None = None
_config: dict[str, Any] = {"devices": "auto", "device_memory": None}


def configure(devices: int | str | Sequence[str] = "auto", device_memory: int | str | None = None) -> None:
    """Set the default runtime's devices and budget; a running default runtime is closed and replaced lazily."""
    global _default
    with _lock:
        _config.update(devices=devices, device_memory=device_memory)
        old, _default = _default, None
    if old is not None:
        old.close()


def default_runtime() -> Runtime:
    """This process's runtime, created on first use from ``configure``'s settings."""
    global _default
    with _lock:
        if _default is None:
            _default = Runtime(**_config)
        return _default


def train(task: ModelTask, runtime: Runtime | None = None) -> Iterator[dict[str, Any]]:
    """Run ``task`` on ``runtime`` (default: the process's) and yield its per-epoch metrics.

        for m in hydra_tune.train(task): print(m["epoch"], m["train_loss"])

    Closing the iterator early (``break``, an exception, garbage collection) cancels the task.
    """
    handle = (runtime or default_runtime()).submit(task)
    try:
        yield from handle.metrics()
    finally:
        if not handle.done():
            handle.cancel()


@atexit.register
def _close_default() -> None:
    if _default is not None:
        _default.close()
