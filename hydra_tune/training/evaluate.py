"""What a report holds and the whole-model evaluation: the epoch's training metrics, ``eval_fn(model)`` at each
evaluation point, and a metric-driven scheduler's step.

    metrics = epoch_metrics(state, epoch, losses, samples, skipped)   # epoch, train_loss, steps, samples, lr, ...
    metrics.update(run_eval_fn(state, metrics))                       # ModelTask(eval_fn=fn): fn(model) -> dict
    schedule_on_metric(state, metrics)                                # ReduceLROnPlateau.step(metrics[name])

``eval_fn`` contract (``ModelTask(eval_fn=fn)``): at each evaluation point (after every epoch, or with
``eval_every=N`` after every N-th step and the last), after the sharded evaluation of ``eval_data`` and
``metrics`` (when given), ``fn(model)`` is called on the task's host thread with the task's own model: its
parameters are host tensors holding the current weights (a state kept on a device is copied back first, as for a
checkpoint: ``StateHome.on_host``), it is in eval mode (train mode again afterwards) and autograd is off. Its
random draws come from the task's stream, as the plain loop's evaluation draws from the generator its training
then continues from. It returns a dict of new names -> finite numbers (Python int/float or one-element tensors),
merged into the report. Cost: the whole evaluation runs on the host CPU, in the task's host thread (devices
meanwhile run other tasks' units; this task waits), plus the copy of a device-resident state to host memory.
The model must not be changed there: changes to a device-resident state's host copies are not kept.

Rules: a function that raises fails its task with ``EvaluationError`` naming the function, the task, the step
and the epoch (the function's exception is its cause); so does a result that is not such a dict, a key that is
already reported (hydra_tune's own keys, ``eval_loss``, the task's ``metrics``), a non-number or a NaN/inf value.
Other tasks go on. ``EvaluationError`` is also what a metric that raises at run time fails its task with
(metrics.py).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Real
from typing import TYPE_CHECKING, Any

import torch

from ..device.dispatch import UnitMode
from ..device.seeding import seeding_to
from ..errors import EvaluationError, rule_error
from ..task import REPORTED
from .boundary import task_work

if TYPE_CHECKING:
    from .state import TaskState

_RULE = "`eval_fn(model)` runs and returns a dict of new metric names -> finite numbers"


def fn_name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__   # short: the message shows 80 characters a value


def epoch_metrics(state: TaskState, epoch: int, losses: list[float], samples: int, skipped: int) -> dict[str, Any]:
    """The training part of a report: epoch, mean minibatch loss so far, steps, samples, learning rate, and the
    skipped minibatches / loss scale where the task has them."""
    metrics: dict[str, Any] = {
        "epoch": epoch, "train_loss": sum(losses) / len(losses) if losses else math.nan,
        "steps": state.steps, "samples": samples, "lr": state.optimizer.param_groups[0]["lr"]}
    if state.task.nonfinite_loss == "skip_step":
        metrics["skipped_batches"] = skipped
    if state.scaler is not None:
        metrics["loss_scale"] = state.scaler.get_scale()
    return metrics


def empty_eval(task: str, epoch: int | None) -> Exception:
    """An eval set with no batch: its loss and metrics would be no numbers, not 0.0 (the plain loop's mean over
    nothing divides by zero)."""
    return rule_error("`eval_data` yields at least one batch (its mean loss and metrics are over its batches)",
                      "check the eval dataset's length and the DataLoader's batch_size and drop_last, or pass "
                      "eval_data=None to train without evaluation", task=task, epoch=epoch, batches=0)


def schedule_on_metric(state: TaskState, metrics: dict[str, Any]) -> None:
    """After the epoch's evaluation, as the plain loop's ``scheduler.step(val_loss)``: a metric-driven
    scheduler steps with the named metric; ``lr`` then reports the learning rate it left."""
    name = state.task.lr_scheduler_metric
    if state.scheduler is None or name is None:
        return
    state.scheduler.step(metrics[name])
    metrics["lr"] = state.optimizer.param_groups[0]["lr"]


def run_eval_fn(state: TaskState, reported: Mapping[str, Any]) -> dict[str, float]:
    """``state.task.eval_fn(state.model)`` as the module docstring says; {} without one. ``reported``: what the
    report holds so far (its keys may not be returned again)."""
    task = state.task
    fn = task.eval_fn
    if fn is None:
        return {}
    where = {"task": task.name, "eval_fn": fn_name(fn), "step": state.steps, "epoch": state.epoch}
    state.home.flush()  # the whole model as after step t: pending per-shard updates (lazy.py) applied first
    model, rng = state.model, state.rng
    was_training = model.training
    with state.home.on_host(), task_work(task.name), UnitMode(rng.cpu), seeding_to(rng), torch.no_grad():
        model.eval()
        try:
            got = fn(model)
        except EvaluationError as exc:  # a check wrapped around it (the Tune integration's key check) named it
            if hasattr(exc, "add_note"):
                exc.add_note(f"while task {task.name!r} evaluated at step {state.steps} (epoch {state.epoch})")
            raise
        except Exception as exc:
            raise rule_error(_RULE, "fix the function (its error is the cause above); it gets the task's model "
                             "in eval mode on the host", kind=EvaluationError, **where,
                             error=f"{type(exc).__name__}: {exc}") from exc
        finally:
            model.train(was_training)
    return _checked(got, reported, where)


def _checked(got: Any, reported: Mapping[str, Any], where: dict[str, Any]) -> dict[str, float]:
    if not isinstance(got, Mapping):
        raise rule_error(_RULE, "return e.g. {'accuracy': correct / total}", kind=EvaluationError, **where,
                         returned=type(got).__name__)
    out: dict[str, float] = {}
    taken = set(REPORTED) | set(reported)
    for key, value in got.items():
        if not isinstance(key, str) or not key or key in taken:
            raise rule_error(_RULE, f"rename it; reported already: {sorted(taken)}", kind=EvaluationError,
                             **where, key=key)
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
            value = value.item()
        if not isinstance(value, Real) or isinstance(value, torch.Tensor) or not math.isfinite(value):
            shown = value if isinstance(value, Real) else type(value).__name__
            raise rule_error(_RULE, "return a finite Python number (or a one-element tensor) per name",
                             kind=EvaluationError, **where, key=key, value=shown)
        out[key] = value  # type: ignore[assignment]
    return out
