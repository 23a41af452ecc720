"""The loss a training unit backpropagates: the task's ``loss(outputs, batch)``, else the model's ``outputs.loss``.

    loss = model_loss(task.loss, outputs, batch)         # a floating-point scalar tensor, or a clear error

Rule: the loss is a floating-point tensor with one element (not ``.item()``, not a number), so that it can be
scaled and backpropagated like the plain loop's.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import rule_error

LossFn = Callable[[Any, Any], torch.Tensor]


def check_loss(loss: object, where: str) -> torch.Tensor:
    """``loss`` when it is a floating-point scalar tensor; else the rule it breaks, naming ``where`` it came from."""
    if not isinstance(loss, torch.Tensor):
        raise rule_error("the loss is a tensor", "return the loss tensor itself (not `.item()` or a number), or "
                         "give the model labels so `outputs.loss` is set", kind=TypeError, source=where,
                         type=type(loss).__name__)
    if loss.numel() != 1 or not loss.is_floating_point():
        raise rule_error("the loss is a floating-point scalar (numel == 1) tensor", "reduce it to one number, e.g. "
                         "`.mean()`, and keep it floating point", source=where, shape=tuple(loss.shape),
                         dtype=loss.dtype)
    if torch.is_grad_enabled() and not loss.requires_grad:  # (a training loss: evaluation runs under no_grad)
        raise rule_error("a training loss is computed from the model's outputs (it requires grad)", "return the "
                         "loss tensor itself, not `.detach()`ed or rebuilt with torch.tensor(...) from numbers",
                         source=where, requires_grad=False)
    return loss


def model_loss(loss_fn: LossFn | None, outputs: Any, batch: Any) -> torch.Tensor:
    """``loss_fn(outputs, batch)`` when the task gives one, else the outputs' ``loss`` (attribute or dict key)."""
    if loss_fn is not None:
        return check_loss(loss_fn(outputs, batch), "the task's `loss`")
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, dict):
        loss = outputs.get("loss")
    if loss is None:
        raise rule_error("`loss` is given or the model's outputs carry `.loss`", "pass ModelTask(loss=lambda "
                         "outputs, batch: ...) or include labels in the batch", outputs=type(outputs).__name__,
                         loss=None)
    return check_loss(loss, "the model's `outputs.loss`")


def nonfinite_policy(task: Any, value: float, **where: Any) -> bool:
    """What ``task.nonfinite_loss`` does with a NaN/inf training loss ``value``: raise ("fail", naming ``where``
    it happened), drop the minibatch ("skip_step": False) or train on it ("ignore": True)."""
    from ..errors import NonFiniteLoss

    policy = task.nonfinite_loss
    if policy == "fail":
        fix = ("lower the learning rate, clip gradients (grad_clip_norm=1.0), check that batch for inf/NaN "
               "inputs or labels that are all ignored (-100)")
        if task.precision == "fp16":
            fix += ", use precision='bf16' (fp16 overflows above 65504) or leave nonfinite_loss=None"
        raise rule_error("the training loss is finite (nonfinite_loss='fail')", fix + ", or pass "
                         "nonfinite_loss='skip_step' to drop such batches ('ignore' trains on them)",
                         kind=NonFiniteLoss, task=task.name, **where, loss=value)
    return policy != "skip_step"
