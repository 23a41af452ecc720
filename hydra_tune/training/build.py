"""Calling a task's factories, and the dtype each precision autocasts to.

    model = build_part(task.model, "model")                  # a factory's error keeps its type and names the part
    AUTOCAST_DTYPES[task.precision]                          # None (fp32), torch.bfloat16 or torch.float16

Rules: factories run one at a time per process (``BUILD_LOCK``): trials submit from many threads (Tune's runtime
actor, Optuna's n_jobs), and lazy-import machinery such as transformers' is not thread-safe on first import. Code
that calls a user factory outside ``build_part`` holds the lock too. Data factories: training/data.py.
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
