"""Evaluation metrics: per-batch functions over ``(outputs, batch)`` summed over the eval set.

    def accuracy(out, batch):                       # (correct, count): reported as sum(correct) / sum(count)
        return (out.argmax(-1) == batch[1]).sum(), batch[1].numel()
    task = ModelTask(..., eval_data=val, metrics={"accuracy": accuracy})
    sums = MetricSums(task.metrics); sums.add(measure(task.metrics, out, batch)); sums.values()

Contract (``ModelTask.metrics``, a dict name -> fn), for every eval batch, in eval-data order:
  * ``fn(outputs, batch)`` runs inside the last shard's eval unit, on the device that ran it (``outputs`` and
    ``batch`` are the device tensors; no full model on the host), under ``torch.no_grad()``, after the loss, outside
    autocast. Its random draws, if any, come from the task's stream.
  * It returns ``(sum, count)``: the metric is ``Σ sum / Σ count`` over the eval set (accuracy: correct
    predictions and labels), or one value: the metric is ``Σ value`` (a count of errors, a summed loss).
    Each value is a Python int or float, or a one-element tensor (taken with ``.item()``).
  * Sums are Python numbers added in eval-data order, as the plain loop's ``correct += c.item()``, so the
    reported value equals the plain loop's ``correct / total`` exactly. A metric whose counts sum to 0 is NaN.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from numbers import Real
from typing import Any

import torch

from ..errors import EvaluationError, rule_error
from . import host_rng
from .pystate import ModuleState

MetricFn = Callable[[Any, Any], Any]
_RULE = ("a metric returns (sum, count) or one value, each a Python int or float or a one-element tensor "
         "(`metrics` of ModelTask)")
_FIX = ("return e.g. `((out.argmax(-1) == y).sum(), y.numel())` for an accuracy (reported as Σsum / Σcount), or "
        "one summed number such as `(out.argmax(-1) != y).sum()`")


def _number(name: str, value: Any) -> int | float:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return value.item()
    if isinstance(value, Real) and not isinstance(value, torch.Tensor):
        return value  # type: ignore[return-value]
    got = (f"tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__)
    raise rule_error(_RULE, _FIX, kind=TypeError, metric=name, returned=got)


def measure(fns: Mapping[str, MetricFn], outputs: Any, batch: Any, **where: Any) -> dict[str, tuple[Any, Any]]:
    """Each metric on one eval batch, as Python numbers: name -> (sum, count) or (value, None). ``where`` (the
    task, step, epoch and eval batch, given while the task trains): a metric that raises fails the task with
    ``EvaluationError`` naming the metric and them, its exception as the cause."""
    out: dict[str, tuple[Any, Any]] = {}
    for name, fn in fns.items():
        try:
            got = fn(outputs, batch)
        except Exception as exc:
            if not where:
                raise
            raise rule_error("each metric runs on the task's outputs and each eval batch", "fix the metric (its "
                             "error is the cause above) so it runs on `(outputs, batch)` as the model returns them",
                             kind=EvaluationError, metric=name, **where,
                             error=f"{type(exc).__name__}: {exc}") from exc
        if isinstance(got, (tuple, list)):
            if len(got) != 2:
                raise rule_error(_RULE, _FIX, kind=TypeError, metric=name, returned=f"{type(got).__name__} of "
                                 f"{len(got)}")
            out[name] = (_number(name, got[0]), _number(name, got[1]))
        else:
            out[name] = (_number(name, got), None)
    return out


class MetricSums:
    """The eval set's running sums per metric; ``values()`` is what the epoch (or step) reports."""

    def __init__(self, names: Mapping[str, Any] | None) -> None:
        self.sums: dict[str, list[Any]] = {name: [0, 0, False] for name in names or {}}

    def add(self, measured: Mapping[str, tuple[Any, Any]]) -> None:
        for name, (value, count) in measured.items():
            entry = self.sums[name]
            entry[0] += value
            if count is not None:
                entry[1] += count
                entry[2] = True

    def values(self) -> dict[str, float]:
        result: dict[str, float] = {}
        for name, (total, count, ratio) in self.sums.items():
            result[name] = (total / count if count else math.nan) if ratio else total
        return result


def check_metrics_run(task: Any, model: torch.nn.Module, batch: Any, route: Callable[[Any], Any]) -> None:
    """At build: every metric runs once on the sample batch, over the outputs of a copy of the model in eval mode
    (no autograd, a scratch random stream routed by ``route``), and returns what the contract allows; a metric
    that raises fails the task here, naming it, instead of at its first evaluation. Cost: one eval forward and,
    while it runs, a second copy of the model in host memory (a model that cannot be copied: a warning, no check).
    """
    if not task.metrics:
        return
    import copy

    from ..stages.base import call_with_batch

    try:  # the task's model is left as it is (a forward may change its state); the copy lasts this check only
        copied = copy.deepcopy(model).eval()
    except Exception as exc:  # noqa: BLE001 - any copy failure: say so; the metrics are then checked as they run
        import warnings

        warnings.warn(f"hydra_tune could not try the metrics of task {task.name!r} at submit: the model cannot be "
                      f"deep-copied ({type(exc).__name__}: {exc}); a metric that breaks its contract fails the "
                      "task at its first evaluation instead.", stacklevel=3)
        return
    kept = ModuleState.of_callables(list(task.metrics.items()))  # a metric counting its calls: put back after
    with torch.no_grad(), route(torch.Generator().manual_seed(task.seed)), _restoring(kept), host_rng.kept():
        outputs = call_with_batch(copied, batch)
        for name, fn in task.metrics.items():
            try:
                got = fn(outputs, batch)
            except Exception as exc:
                raise rule_error("each metric runs on the task's outputs and a batch", "fix the metric so it "
                                 "runs on `(outputs, batch)` as the model returns them (see the error above)",
                                 task=task.name, metric=name, error=f"{type(exc).__name__}: {exc}") from exc
            measure({name: lambda *_: got}, outputs, batch)


@contextlib.contextmanager
def _restoring(state: ModuleState) -> Iterator[None]:
    try:
        yield
    finally:
        state.restore()
