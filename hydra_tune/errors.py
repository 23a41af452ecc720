"""Exceptions and the one message format every input check uses.

    from hydra_tune.errors import rule_error
    raise rule_error("`epochs >= 1`", "pass a positive number of epochs", epochs=0)
    # ValueError: `epochs >= 1` must hold, but got (epochs=0). Fix: pass a positive number of epochs.
"""
from __future__ import annotations

import traceback


class HydraError(Exception):
    """Base class of the errors hydra_tune raises itself."""


class PlanError(HydraError, ValueError):
    """The model cannot be cut into shards that fit the device budget."""


class TaskCancelled(HydraError):
    """The task was cancelled before it finished (``TaskHandle.cancel()`` or a closed ``train`` iterator)."""


class RuntimeClosed(HydraError):
    """The runtime was closed while the task was still queued or running."""


class EvaluationError(HydraError, RuntimeError):
    """A task's evaluation code failed while it ran: a metric (``ModelTask(metrics=)``) or ``eval_fn`` raised, or
    ``eval_fn`` returned what its contract does not allow; the message names it, the task and the step."""


class NonFiniteLoss(HydraError, FloatingPointError):
    """A training minibatch's loss was NaN or inf under ``ModelTask(nonfinite_loss="fail")`` (the default)."""


def _fmt(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def rule_error(rule: str, fix: str, *, kind: type[Exception] = ValueError, **values: object) -> Exception:
    """Build ``kind("<rule> must hold, but got (k=v, ...). Fix: <fix>.")``."""
    got = ", ".join(f"{k}={_fmt(v)}" for k, v in values.items())
    return kind(f"{rule} must hold, but got ({got}). Fix: {fix}.")


def format_bytes(n: float) -> str:
    """Human-readable bytes: ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024:
            return f"{n:.2f} {unit}"
    return f"{n / 1024:.2f} TiB"


def detach_frames(error: BaseException | None, task: str) -> None:
    """Keep ``error``'s worker traceback as a note naming ``task``, drop its frames: they hold the failed unit's
    device tensors and, through the still-running worker frame (which ``traceback.clear_frames`` cannot clear), the
    task's whole state, for as long as the caller keeps the error (a handle, an Optuna trial's exception)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        if tb is not None:
            if not isinstance(error, TaskCancelled):   # a cancellation's trace says nothing the message does not
                error.add_note(f"Raised in task {task!r} in a hydra_tune device worker:\n"
                               + "".join(traceback.format_tb(tb)).rstrip())
            error.__traceback__ = None
        error = error.__cause__ or error.__context__
