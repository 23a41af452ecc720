"""The prepared optimizer: the user's own optimizer object, its ``step`` checked and counted.

    model, optimizer = hydra_tune.prepare(model, optimizer)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)   # built on it: the real param_groups
    optimizer.step(); sched.step(); optimizer.zero_grad()

Why the same object and not a wrapper: LR schedulers, GradScaler and checkpoint code read and write its
``param_groups`` and ``state`` and check ``isinstance(opt, torch.optim.Optimizer)``; the step reads the gradients
the B units put into ``.grad`` (host memory: driver.py) and updates the parameters the next forward copies, exactly
the plain loop's step. Only ``step`` is replaced (an instance attribute, so a scheduler's own step wrapper still
wraps it): a closure is refused (refusals.py), and each step is counted in the task's stats.
"""
from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from .refusals import refuse_closure

_MARK = "__hydra_tune_prepared__"


def wrap_step(optimizer: torch.optim.Optimizer, counted: Callable[[], None]) -> torch.optim.Optimizer:
    """``optimizer`` with its ``step`` refusing a closure and counting each step (``counted``)."""
    inner = optimizer.step

    def step(self: Any, closure: Any = None) -> Any:
        if closure is not None:
            raise refuse_closure()
        result = inner()
        counted()
        return result

    step.__doc__ = inner.__doc__
    if hasattr(inner, "_wrapped_by_lr_sched"):
        # a scheduler built before prepare wrapped the step (its marker and call flag): ours calls that wrapper,
        # so the scheduler's order check stays true; torch reads this marker by name
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    # a bound method, as LR schedulers expect of optimizer.step (they wrap its __func__)
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
    setattr(optimizer, _MARK, True)
    return optimizer


def is_prepared(optimizer: Any) -> bool:
    return bool(getattr(optimizer, _MARK, False))
