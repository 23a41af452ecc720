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
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .errors import rule_error

_names = itertools.count()


def _check_data(arg: str, data: object) -> None:
    if data is None:
        raise rule_error(f"`{arg} is not None`", "pass a DataLoader, a list of batches, or a callable returning one",
                         kind=TypeError, **{arg: data})
    if callable(data) and not hasattr(data, "__iter__"):
        _check_call(arg, data, 0, f"`{arg}` is iterable or a zero-argument callable", "pass a DataLoader or a "
                    "list of batches, or `lambda: make_loader()`")
        return
    if not isinstance(data, Iterable):
        raise rule_error(f"`{arg}` is iterable or a zero-argument callable", "pass a DataLoader or a list of "
                         "batches, or `lambda: make_loader()`", kind=TypeError, **{arg: type(data).__name__})
    # isinstance, not `iter(data) is data`: iter() on a DataLoader draws its base seed from torch's global
    # generator and, with persistent workers, starts them: the user's objects are not touched here.
    if isinstance(data, Iterator):
        raise rule_error(f"`{arg}` can be iterated once per epoch (not a one-shot iterator or generator)",
                         "pass a list or DataLoader, or a factory such as `lambda: my_generator()`",
                         kind=TypeError, **{arg: type(data).__name__})


def _name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _check_call(arg: str, fn: object, n: int, rule: str, fix: str) -> None:
    """A callable the runtime will call with ``n`` positional arguments must accept them: say so now, in the
    caller's code, rather than when the runtime builds the task."""
    import inspect

    try:
        sig = inspect.signature(fn)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # some builtins and C callables have no signature: called as they are
        return
    try:
        sig.bind(*range(n))
    except TypeError:
        raise rule_error(rule, fix, kind=TypeError, **{arg: _name(fn)}, signature=str(sig)) from None


_BATCH_RULE = "each batch is a dict, a non-empty (inputs, target, ...) tuple or list, or a tensor"
_BATCH_FIX = ("make the Dataset or collate_fn return tensors, e.g. {'input_ids': ids, 'labels': ids} (-> "
              "model(**batch)) or (inputs, target) (-> model(inputs)); tokenize text there, and turn a "
              "BatchEncoding or other Mapping into a dict with dict(batch)")


_FINE_BATCHES = (tuple, list, dict)


def check_batch(batch: object, task: str, data: str, batch_in_epoch: int) -> None:
    """Reject what can never be a batch (text, numbers, None, an empty tuple, a non-dict Mapping) with the
    accepted forms; any other object goes to ``model(batch)`` as it is (a custom model's own batch type)."""
    if type(batch) in _FINE_BATCHES and batch:  # the common forms, checked at every minibatch: no ABC test
        return
    from collections.abc import Mapping
    from numbers import Number

    empty = isinstance(batch, (tuple, list)) and not batch
    mapping = isinstance(batch, Mapping) and not isinstance(batch, dict)  # model(**batch) is for dicts only
    if batch is None or isinstance(batch, (str, bytes, Number)) or empty or mapping:
        raise rule_error(_BATCH_RULE, _BATCH_FIX, kind=TypeError, task=task, data=data,
                         batch_in_epoch=batch_in_epoch, type=type(batch).__name__)


def _check_int(arg: str, value: object, minimum: int, fix: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise rule_error(f"`{arg} >= {minimum}` (an int)", fix, **{arg: value})


def _check_factories(model: object, optimizer: object) -> None:
    """The model (or its factory) and the optimizer factory, with their arities."""
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
    if not _is_module(model):
        _check_call("model", model, 0, "`model` is an nn.Module or a zero-argument callable returning one",
                    "pass the module, or a factory such as `lambda: MyModel(config)`")
    _check_call("optimizer", optimizer, 1, "`optimizer` is callable(model) -> torch.optim.Optimizer",
                "take the runtime's copy of the model as the one argument, e.g. "
                "`lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3)`")


def _check_hooks(loss: object, stages: object, lr_scheduler: object) -> None:
    """The optional callables: None, or callable with the arguments the runtime passes."""
    for arg, fn, n, fix in (("loss", loss, 2, "pass `callable(outputs, batch) -> scalar tensor`, or None to "
                             "use `outputs.loss`"),
                            ("stages", stages, 1, "pass `callable(model) -> [module, ...]` (see hydra_tune/"
                             "stages/explicit.py), or None"),
                            ("lr_scheduler", lr_scheduler, 1, "pass e.g. `lambda opt: "
                             "torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)`")):
        if fn is not None and not callable(fn):
            raise rule_error(f"`{arg}` is None or callable", fix, kind=TypeError, **{arg: type(fn).__name__})
        if fn is not None:
            _check_call(arg, fn, n, f"`{arg}` is None or callable with {n} argument{'s' * (n > 1)}", fix)


# The per-epoch metrics a metric-driven scheduler (ReduceLROnPlateau) may follow: the losses the task reports.
_SCHEDULER_METRICS = ("train_loss", "eval_loss")


def _check_scheduler_metric(lr_scheduler: object, metric: object, eval_data: object, metrics: object) -> None:
    """``lr_scheduler_metric`` names a loss or metric this task reports after every epoch, for a scheduler to
    follow (``ReduceLROnPlateau(opt, mode="max")`` on an accuracy)."""
    if metric is None:
        return
    reported = [m for m in _SCHEDULER_METRICS if m != "eval_loss" or eval_data is not None]
    if isinstance(metrics, dict) and eval_data is not None:
        reported += [name for name in metrics if isinstance(name, str)]
    if not isinstance(metric, str) or metric not in reported:
        fix = f"name one of {reported}"
        if metric == "eval_loss":
            fix = "pass eval_data (eval_loss is reported only when the task evaluates), or name 'train_loss'"
        raise rule_error("`lr_scheduler_metric` is None or a loss the task reports after every epoch", fix,
                         lr_scheduler_metric=metric, reported=reported)
    if lr_scheduler is None:
        raise rule_error("`lr_scheduler_metric` is given only with an `lr_scheduler`", "pass e.g. `lr_scheduler="
                         "lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt)`, or drop "
                         "lr_scheduler_metric", lr_scheduler_metric=metric, lr_scheduler=None)


# What every report holds already: a metric may not take one of these names.
REPORTED = ("epoch", "steps", "samples", "lr", "seconds", "train_loss", "eval_loss", "skipped_batches", "loss_scale",
             "task")


def _check_metrics(metrics: object, eval_data: object) -> None:
    """``metrics`` is None or a dict of new names to ``fn(outputs, batch)``, evaluated on eval_data."""
    if metrics is None:
        return
    fix = "pass e.g. metrics={'accuracy': lambda out, b: ((out.argmax(-1) == b[1]).sum(), b[1].numel())}"
    if not isinstance(metrics, dict) or not metrics:
        raise rule_error("`metrics` is None or a non-empty dict of name -> fn(outputs, batch)", fix,
                         kind=TypeError, metrics=type(metrics).__name__ if not isinstance(metrics, dict) else metrics)
    for name, fn in metrics.items():
        if not isinstance(name, str) or not name or name in REPORTED:
            raise rule_error("each metric's name is a non-empty str that is not already reported", "rename it; "
                             f"reported already: {list(REPORTED)}", metric=name)
        if not callable(fn):
            raise rule_error("each metric is callable(outputs, batch)", fix, kind=TypeError, metric=name,
                             fn=type(fn).__name__)
        _check_call(f"metrics[{name!r}]", fn, 2, "each metric is callable(outputs, batch)", fix)
    if eval_data is None:
        raise rule_error("`metrics` are given with `eval_data` (they are computed over the eval set)",
                         "pass eval_data=..., or drop metrics", metrics=list(metrics), eval_data=None)


def _check_eval_fn(eval_fn: object) -> None:
    """``eval_fn`` is None or ``fn(model) -> dict`` (its keys are checked when it returns: training/evaluate.py)."""
    if eval_fn is None:
        return
    fix = "pass e.g. `eval_fn=lambda model: {'accuracy': my_accuracy(model, val_loader)}`"
    if not callable(eval_fn):
        raise rule_error("`eval_fn` is None or callable(model) -> dict of name -> number", fix, kind=TypeError,
                         eval_fn=type(eval_fn).__name__)
    _check_call("eval_fn", eval_fn, 1, "`eval_fn` is None or callable(model) -> dict of name -> number", fix)


def _check_schedule(epochs: object, eval_every: object, lr_scheduler_metric: object) -> None:
    """``epochs`` (None: until stopped) and ``eval_every`` (None: per epoch; N: every N optimizer steps)."""
    # (None, no limit, is in the docstring: this message is the one users of the int form know)
    _check_int("epochs", epochs, 1, "train for at least one epoch (use max_steps to stop earlier)", allow_none=True)
    _check_int("eval_every", eval_every, 1, "pass None to evaluate and report after every epoch, or N to do it "
               "after every N optimizer steps", allow_none=True)
    if eval_every is not None and lr_scheduler_metric is not None:
        raise rule_error("`lr_scheduler_metric` (a scheduler stepped once per epoch on the epoch's evaluation) is "
                         "not combined with `eval_every` (evaluations every N steps, none per epoch)",
                         "drop eval_every to evaluate once per epoch, or use a scheduler stepped per optimizer "
                         "step", eval_every=eval_every, lr_scheduler_metric=lr_scheduler_metric)


def _check_loop(epochs: object, max_steps: object, grad_accumulation: object, grad_clip_norm: object,
                seed: object, name: object) -> None:
    """The training loop's settings: counts, the clip norm, the seed and the name."""
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


def _check_options(precision: object, resume_from: object, resume_hparams: object, nonfinite_loss: object) -> None:
    """Mixed precision, resuming from a checkpoint, and what a non-finite loss does."""
    if precision not in ("fp32", "bf16", "fp16"):
        raise rule_error("`precision` in ('fp32', 'bf16', 'fp16')", "pass 'bf16' or 'fp16' for mixed precision "
                         "(autocast; fp16 adds dynamic loss scaling), 'fp32' for none", precision=precision)
    if resume_from is not None and not isinstance(resume_from, (str, os.PathLike)):
        raise rule_error("`resume_from` is a checkpoint path or None", "pass the path TaskHandle.checkpoint "
                         "returned", kind=TypeError, resume_from=type(resume_from).__name__)
    if resume_hparams not in ("checkpoint", "task"):
        raise rule_error("`resume_hparams` in ('checkpoint', 'task')", "keep 'checkpoint' for an exact resume, "
                         "or 'task' to apply this task's optimizer settings (PBT's explore step)",
                         resume_hparams=resume_hparams)
    if nonfinite_loss not in (None, "fail", "skip_step", "ignore"):
        raise rule_error("`nonfinite_loss` in (None, 'fail', 'skip_step', 'ignore')", "keep None (the default: "
                         "'fail', or under fp16 'ignore' so the GradScaler skips the step) or pick one of those",
                         nonfinite_loss=nonfinite_loss)


class ModelTask:
    """One trial's job: model, optimizer, data, loss and the training-loop settings.

        task = ModelTask(make_gpt2, lambda m: torch.optim.AdamW(m.parameters(), lr=3e-4), loader, epochs=2)
        handle = runtime.submit(task); handle.result()["train_loss"]

    Semantics (the same as the plain PyTorch loop this replaces):
      * batches: a dict -> ``model(**batch)``, a tuple/list ``(inputs, target)`` -> ``model(inputs)``,
        a tensor -> ``model(t)``; ``loss(outputs, batch)`` or, when ``loss`` is None, ``outputs.loss``.
      * ``train_data``/``eval_data``: iterated once per epoch (a list, a DataLoader: its workers, samplers and
        ``generator=`` as in torch), or a zero-argument factory called at the start of each pass and returning
        any iterable, a generator too (hydra_tune/training/data.py). Each pass yields at least one batch: an
        empty train set fails at submit; an empty eval set too, or its task at the evaluation that found it empty
        (its loss and metrics would be no numbers, not 0).
      * ``grad_accumulation=k``: each batch's loss is divided by k; the optimizer steps every k batches and at
        the end of an epoch that leaves gradients pending.
      * ``grad_clip_norm``: ``clip_grad_norm_`` over all parameters before every step.
      * ``lr_scheduler(optimizer)``: stepped once after every optimizer step, or, with
        ``lr_scheduler_metric="eval_loss"`` (or "train_loss"), once per epoch after its evaluation as
        ``scheduler.step(metrics["eval_loss"])`` (``ReduceLROnPlateau``; checked when the task is built: a scheduler
        whose ``step`` needs a metric requires the name, one that takes none refuses it). The reported ``lr`` is
        the learning rate after the epoch's last scheduler step.
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
        exactly as the uninterrupted one would (hydra_tune/training/checkpoint.py). ``resume_hparams="task"``
        (PBT's explore step) instead keeps this task's optimizer hyper-parameters (weight decay, betas, ...) and
        base learning rates: the learning rate keeps its schedule position, scaled by new base / checkpointed base.
      * ``nonfinite_loss``: what a NaN or inf training loss does. "fail": the task fails with ``NonFiniteLoss``
        at that minibatch, before its optimizer step. "skip_step": the minibatch is dropped as the plain loop
        ``if not torch.isfinite(loss): optimizer.zero_grad(); continue`` drops it: no step, the gradients pending
        in its accumulation window are discarded and the window starts again at the next batch; its loss is left
        out of ``train_loss`` and counted in the metric ``skipped_batches``. "ignore": trained on as a plain loop
        without the check would. None (the default) is "fail", except under fp16, where it is "ignore": the
        GradScaler then skips a step whose gradients are inf/NaN and lowers the scale, as torch.amp does.
        Eval losses are reported as they are, never checked.
      * ``metrics={"accuracy": fn}``: ``fn(outputs, batch)`` per eval batch, inside the last shard's eval unit,
        returning ``(sum, count)`` (reported as Σsum / Σcount over the eval set: ``correct / total``) or one value
        (reported as its sum); reported next to ``eval_loss``. Needs ``eval_data``; each metric is tried once on
        the sample batch when the task is built (hydra_tune/training/metrics.py has the contract).
      * ``eval_fn=fn``: ``fn(model) -> {"name": number}`` at each evaluation point, for evaluation code that
        needs the whole model: called on the task's host thread with its model (current weights, in host memory,
        eval mode, no grad), after ``eval_data``'s evaluation; its values join the report. A function that raises,
        or returns a reported name or a NaN/inf, fails the task with ``EvaluationError`` naming it and the step
        (hydra_tune/training/evaluate.py has the contract and the cost).
      * ``eval_every=N``: evaluate (with eval_data) and report after every N-th optimizer step (counted over all
        epochs) and after the last step, instead of after every epoch; ``train_loss`` is then the mean of the
        epoch's minibatch losses so far. Not with ``lr_scheduler_metric`` (that steps per epoch).
      * ``epochs=None``: no epoch limit: the task trains until ``max_steps``, or, without it, until it is stopped
        (Tune's ``stop``/ASHA, an Optuna pruner, ``TaskHandle.cancel``, leaving the ``train()`` loop); its
        ``result()`` never comes otherwise.
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
        lr_scheduler_metric: str | None = None,
        grad_clip_norm: float | None = None,
        grad_accumulation: int = 1,
        seed: int = 0,
        name: str | None = None,
        stages: Callable[[Any], Any] | None = None,
        precision: str = "fp32",
        resume_from: str | None = None,
        resume_hparams: str = "checkpoint",
        nonfinite_loss: str | None = None,
        metrics: dict[str, Callable[[Any, Any], Any]] | None = None,
        eval_every: int | None = None,
        eval_fn: Callable[[Any], dict[str, float]] | None = None,
    ) -> None:
        _check_factories(model, optimizer)
        _check_data("train_data", train_data)
        if eval_data is not None:
            _check_data("eval_data", eval_data)
        _check_hooks(loss, stages, lr_scheduler)
        _check_scheduler_metric(lr_scheduler, lr_scheduler_metric, eval_data, metrics)
        _check_schedule(epochs, eval_every, lr_scheduler_metric)
        _check_metrics(metrics, eval_data)
        _check_eval_fn(eval_fn)
        _check_loop(epochs, max_steps, grad_accumulation, grad_clip_norm, seed, name)
        _check_options(precision, resume_from, resume_hparams, nonfinite_loss)
        self.model = model
        self.optimizer = optimizer
        self.train_data = train_data
        self.loss = loss
        self.eval_data = eval_data
        self.epochs = epochs
        self.max_steps = max_steps
        self.lr_scheduler = lr_scheduler
        self.lr_scheduler_metric = lr_scheduler_metric
        self.grad_clip_norm = None if grad_clip_norm is None else float(grad_clip_norm)
        self.grad_accumulation = grad_accumulation
        self.seed = seed
        self.name = name if name is not None else f"task-{next(_names)}"
        self.stages = stages
        self.precision = precision
        self.resume_from = None if resume_from is None else os.fspath(resume_from)
        self.resume_hparams = resume_hparams
        # fp16 overflow (a batch beyond 65504 makes the loss inf or NaN) is torch.amp's GradScaler's to handle:
        # by default it skips that step and lowers the scale, as in the plain AMP loop.
        self.nonfinite_loss = nonfinite_loss or ("ignore" if precision == "fp16" else "fail")
        self.metrics = dict(metrics) if metrics else {}
        self.eval_every = eval_every
        self.eval_fn = eval_fn

    def __repr__(self) -> str:
        return (f"ModelTask(name={self.name!r}, epochs={self.epochs}, max_steps={self.max_steps}, "
                f"grad_accumulation={self.grad_accumulation}, grad_clip_norm={self.grad_clip_norm}, seed={self.seed})")


def _is_module(obj: object) -> bool:
    import torch

    return isinstance(obj, torch.nn.Module)


def _is_optimizer(obj: object) -> bool:
    import torch

    return isinstance(obj, torch.optim.Optimizer)
