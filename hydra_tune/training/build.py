"""Calling a task's factories, and the dtype each precision autocasts to.

    model = build_part(task.model, "model")                  # a factory's error keeps its type and names the part
    train = data_iterable(task.train_data)                   # a data factory runs once; its result is re-iterated
    AUTOCAST_DTYPES[task.precision]                          # None (fp32), torch.bfloat16 or torch.float16

Rules: factories run one at a time per process (``BUILD_LOCK``): trials submit from many threads (Tune's runtime
actor, Optuna's n_jobs), and lazy-import machinery such as transformers' is not thread-safe on first import. Code
that calls a user factory outside ``build_part`` holds the lock too. A data factory returns something iterable
once per epoch (a list or DataLoader), never a one-shot iterator.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from ..errors import HydraError

BUILD_LOCK = threading.RLock()

# precision name -> the dtype forwards (and the loss) autocast to; None: fp32, no autocast
AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_part(factory: Any, what: str, *args: Any) -> Any:
    """Call a user factory under ``BUILD_LOCK``; its error keeps its type and gains which part it was building."""
    try:
        with BUILD_LOCK:
            return factory(*args)
    except Exception as exc:
        message = f"building the task's {what} failed: {type(exc).__name__}: {exc}"
        try:
            wrapped = type(exc)(message)
        except Exception:  # an exception type with a different constructor
            wrapped = HydraError(message)
        raise wrapped from exc


def data_iterable(data: Any) -> Any:
    """What the task iterates each epoch: ``data`` itself, or what its zero-argument factory returns."""
    if callable(data) and not hasattr(data, "__iter__"):
        data = build_part(data, "data (the data factory)")
        if iter(data) is data:
            raise TypeError(f"the data factory returns something iterable once per epoch, but got a one-shot "
                            f"iterator (type={type(data).__name__}). Fix: return a list or DataLoader.")
    return data


def data_length(data: Any) -> int | None:
    """``len(data)``, or None for data without a length."""
    try:
        return int(len(data))
    except TypeError:
        return None
