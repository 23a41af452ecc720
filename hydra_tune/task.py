"""ModelTask: the validated description of one trial's training job.

    task = ModelTask(lambda: nn.Sequential(nn.Linear(8, 8)), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                     train_data=[(torch.randn(4, 8), torch.randn(4, 8))], loss=lambda out, b: F.mse_loss(out, b[1]))
    for metrics in hydra_tune.train(task): print(metrics)

A task holds factories and plain settings, never live device state, so it can be shipped to the runtime that
builds and trains it. Every argument is checked here, at construction, so mistakes surface in the caller's code.
"""
from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable
from typing import Any

from .errors import rule_error

_names = itertools.count()


def _check_data(arg: str, data: object) -> None:
    if data is None:
        raise rule_error(f"`{arg} is not None`", "pass a DataLoader, a list of batches, or a callable returning one",
                         kind=TypeError, **{arg: data})
    if callable(data) and not hasattr(data, "__iter__"):
        return
    if not isinstance(data, Iterable):
        raise rule_error(f"`{arg}` is iterable or a zero-argument callable", "pass a DataLoader or a list of "
                         "batches, or `lambda: make_loader()`", kind=TypeError, **{arg: type(data).__name__})
    if iter(data) is data:  # type: ignore[call-overload]
        raise rule_error(f"`{arg}` can be iterated once per epoch (not a one-shot iterator or generator)",
                         "pass a list or DataLoader, or a factory such as `lambda: my_generator()`",
                         kind=TypeError, **{arg: type(data).__name__})


def _check_int(arg: str, value: object, minimum: int, fix: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise rule_error(f"`{arg} >= {minimum}` (an int)", fix, **{arg: value})


class ModelTask:
    """One trial's job: model, optimizer, data, loss and the training-loop settings.

        task = ModelTask(make_gpt2, lambda m: torch.optim.AdamW(m.parameters(), lr=3e-4), loader, epochs=2)
        handle = runtime.submit(task); handle.result()["train_loss"]

    Semantics (the same as the plain PyTorch loop this replaces):
      * batches: a dict -> ``model(**batch)``, a tuple/list ``(inputs, target)`` -> ``model(inputs)``,
        a tensor -> ``model(t)``; ``loss(outputs, batch)`` or, when ``loss`` is None, ``outputs.loss``.
      * ``grad_accumulation=k``: each batch's loss is divided by k; the optimizer steps every k batches and at
        the end of an epoch that leaves gradients pending.
      * ``grad_clip_norm``: ``clip_grad_norm_`` over all parameters before every step.
      * ``lr_scheduler(optimizer)``: stepped once after every optimizer step.
      * ``max_steps``: training stops after that many optimizer steps (over all epochs).
      * ``seed``: the task's own RNG stream; ``torch.manual_seed(seed)`` before the plain loop gives the same
        model init (for a factory), dropout masks and data order.
      * ``stages(model) -> [module, ...]``: where the runtime may cut a model it cannot cut by itself (or define
        ``model.hydra_stages()``); see hydra_tune/stages/explicit.py for the contract.
      * ``precision``: "bf16"/"fp16" run forwards and the loss under ``torch.autocast`` (parameters, gradients
        and optimizer state stay fp32 in host memory); "fp16" also scales the loss with a per-task
        ``torch.amp.GradScaler`` whose unscale/step/update run with the optimizer step (an inf/nan step is
        skipped for that task only; metrics report ``loss_scale``).
      * ``resume_from``: a file written by ``TaskHandle.checkpoint``; the task continues from there and ends
        exactly as the uninterrupted one would (hydra_tune/checkpoint.py). ``resume_hparams="task"`` (PBT's
        explore step) instead keeps this task's optimizer hyper-parameters (weight decay, betas, ...) and base
        learning rates: the learning rate keeps its schedule position, scaled by new base / checkpointed base.
    """

    def __init__(
        self,
        model: Any,
        optimizer: Callable[[Any], Any],
        train_data: Any,
        *,
        loss: Callable[[Any, Any], Any] | None = None,
        eval_data: Any = None,
        epochs: int = 1,
        max_steps: int | None = None,
        lr_scheduler: Callable[[Any], Any] | None = None,
        grad_clip_norm: float | None = None,
        grad_accumulation: int = 1,
        seed: int = 0,
        name: str | None = None,
        stages: Callable[[Any], Any] | None = None,
        precision: str = "fp32",
        resume_from: str | None = None,
        resume_hparams: str = "checkpoint",
    ) -> None:
        if not callable(model):  # an nn.Module is callable too
            raise rule_error("`model` is an nn.Module or a zero-argument callable returning one",
                             "pass the module, or a factory such as `lambda: MyModel(config)`",
                             kind=TypeError, model=type(model).__name__)
        if _is_optimizer(optimizer):
            raise rule_error("`optimizer` is a factory `callable(model) -> torch.optim.Optimizer`",
                             "pass e.g. `lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3)` so the "
                             "optimizer is built over the runtime's copy of the model",
                             kind=TypeError, optimizer=type(optimizer).__name__)
        if not callable(optimizer):
            raise rule_error("`optimizer` is callable(model) -> torch.optim.Optimizer",
                             "pass e.g. `lambda model: torch.optim.SGD(model.parameters(), lr=0.1)`",
                             kind=TypeError, optimizer=type(optimizer).__name__)
        _check_data("train_data", train_data)
        if eval_data is not None:
            _check_data("eval_data", eval_data)
        for arg, fn, fix in (("loss", loss, "pass `callable(outputs, batch) -> scalar tensor`, or None to use "
                              "`outputs.loss`"),
                             ("stages", stages, "pass `callable(model) -> [module, ...]` (see hydra_tune/stages/"
                              "explicit.py), or None"),
                             ("lr_scheduler", lr_scheduler, "pass e.g. `lambda opt: "
                              "torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)`")):
            if fn is not None and not callable(fn):
                raise rule_error(f"`{arg}` is None or callable", fix, kind=TypeError, **{arg: type(fn).__name__})
        _check_int("epochs", epochs, 1, "train for at least one epoch (use max_steps to stop earlier)")
        _check_int("max_steps", max_steps, 1, "pass None for no limit, or a positive number of optimizer steps",
                   allow_none=True)
        _check_int("grad_accumulation", grad_accumulation, 1, "pass 1 for a step every batch, k for every k batches")
        if grad_clip_norm is not None and (isinstance(grad_clip_norm, bool)
                                           or not isinstance(grad_clip_norm, (int, float)) or not grad_clip_norm > 0):
            raise rule_error("`grad_clip_norm > 0` (or None)", "pass a positive max norm such as 1.0, or None",
                             grad_clip_norm=grad_clip_norm)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise rule_error("`seed` is an int", "pass an integer seed", kind=TypeError, seed=seed)
        if name is not None and not isinstance(name, str):
            raise rule_error("`name` is a str or None", "pass a short label such as 'lr=3e-4'", kind=TypeError,
                             name=name)
        self.model = model
        self.optimizer = optimizer
        self.train_data = train_data
        self.loss = loss
        self.eval_data = eval_data
        self.epochs = epochs
        self.max_steps = max_steps
        self.lr_scheduler = lr_scheduler
        self.grad_clip_norm = None if grad_clip_norm is None else float(grad_clip_norm)
        self.grad_accumulation = grad_accumulation
        self.seed = seed
        self.name = name if name is not None else f"task-{next(_names)}"
        self.stages = stages
        if precision not in ("fp32", "bf16", "fp16"):
            raise rule_error("`precision` in ('fp32', 'bf16', 'fp16')", "pass 'bf16' or 'fp16' for mixed precision "
                             "(autocast; fp16 adds dynamic loss scaling), 'fp32' for none", precision=precision)
        self.precision = precision
        if resume_from is not None and not isinstance(resume_from, (str, os.PathLike)):
            raise rule_error("`resume_from` is a checkpoint path or None", "pass the path TaskHandle.checkpoint "
                             "returned", kind=TypeError, resume_from=type(resume_from).__name__)
        self.resume_from = None if resume_from is None else os.fspath(resume_from)
        if resume_hparams not in ("checkpoint", "task"):
            raise rule_error("`resume_hparams` in ('checkpoint', 'task')", "keep 'checkpoint' for an exact resume, "
                             "or 'task' to apply this task's optimizer settings (PBT's explore step)",
                             resume_hparams=resume_hparams)
        self.resume_hparams = resume_hparams

    def __repr__(self) -> str:
        return (f"ModelTask(name={self.name!r}, epochs={self.epochs}, max_steps={self.max_steps}, "
                f"grad_accumulation={self.grad_accumulation}, grad_clip_norm={self.grad_clip_norm}, seed={self.seed})")


def _is_optimizer(obj: object) -> bool:
    import torch

    return isinstance(obj, torch.optim.Optimizer)
