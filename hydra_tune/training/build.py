"""Calling a task's factories, checking what they built, and the dtype each precision autocasts to.

    model = build_part(task.model, "model")                  # a factory's error keeps its type and names the part
    check_model(task, model); check_optimizer(task, model, optimizer); check_scheduler(task, scheduler)
    AUTOCAST_DTYPES[task.precision]                          # None (fp32), torch.bfloat16 or torch.float16

Rules: factories run one at a time per process (``BUILD_LOCK``): trials submit from many threads (Tune's runtime
actor, Optuna's n_jobs), and lazy-import machinery such as transformers' is not thread-safe on first import. Code
that calls a user factory outside ``build_part`` holds the lock too. Data factories: training/data.py.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

from ..errors import HydraError, rule_error

if TYPE_CHECKING:
    from ..task import ModelTask

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


def check_not_scripted(model: Any, **where: Any) -> None:
    """Refuse a model holding TorchScript modules (``torch.jit.script`` / ``trace``): their parameters live in
    TorchScript's C++ module, and the units bind device copies into the Python modules' parameter slots."""
    import torch

    scripted = [path or "(the model)" for path, m in model.named_modules() if isinstance(m, torch.jit.ScriptModule)]
    if scripted:
        raise rule_error("the model holds no TorchScript module (torch.jit.script / torch.jit.trace): the runtime runs "
                         "each stage over device copies of its parameters, bound into the Python modules", "pass the "
                         "Python module (script or trace it once trained)", kind=TypeError, **where,
                         scripted=scripted[:4] + (["..."] if len(scripted) > 4 else []))


SPARSE_RULE = ("the model's gradients are dense (the runtime moves, lands and steps strided gradients only; "
               "nn.Embedding(sparse=True), EmbeddingBag(sparse=True) or F.embedding(..., sparse=True) make sparse "
               "ones)")
SPARSE_FIX = "use sparse=False (the default) and a dense optimizer (not SparseAdam)"


def check_dense_gradients(model: Any, **where: Any) -> None:
    """Refuse embeddings that make sparse gradients (``sparse=True``)."""
    sparse = [path for path, m in model.named_modules() if getattr(m, "sparse", None) is True
              and any(p.requires_grad for p in m.parameters(recurse=False))]
    if sparse:
        raise rule_error(SPARSE_RULE, SPARSE_FIX, kind=TypeError, **where, sparse=sparse[:4])


def sparse_gradient(grad: Any, **where: Any) -> Exception:
    """The error for a sparse gradient a unit made anyway (a functional sparse embedding)."""
    return rule_error(SPARSE_RULE, SPARSE_FIX, kind=TypeError, **where, layout=str(grad.layout))


def check_model(task: ModelTask, model: Any) -> None:
    """What the model factory built is a module with something to train."""
    import torch.nn as nn

    if not isinstance(model, nn.Module):
        raise rule_error("the `model` factory returns an nn.Module", "return the model instance, e.g. `lambda: "
                         "MyModel(config)` (not the class or a tuple)", kind=TypeError, task=task.name,
                         returned=type(model).__name__)
    check_not_scripted(model, task=task.name)
    check_dense_gradients(model, task=task.name)
    from torch.nn.parameter import is_lazy

    lazy = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if is_lazy(t)]
    if lazy:  # their shapes exist only after a first forward: nothing can be measured, cut or copied before
        raise rule_error("the model's parameters and buffers are initialized (no LazyModule left uninitialized)",
                         "initialize them in the factory with one forward on a sample input (`m = Net(); "
                         "m(sample_x); return m`), or use the non-lazy module (nn.Linear(in, out))",
                         task=task.name, uninitialized=lazy[:4] + (["..."] if len(lazy) > 4 else []))
    # torch keeps a tensor's hooks in these attributes: there is no public reader
    hooked = [n for n, p in model.named_parameters() if getattr(p, "_backward_hooks", None)
              or getattr(p, "_post_accumulate_grad_hooks", None)]
    if hooked:  # the units differentiate device tensors of their own, not the parameter: the hook would never run
        raise rule_error("a ModelTask's parameters carry no gradient hooks (`p.register_hook`, "
                         "`register_post_accumulate_grad_hook`): the runtime's units differentiate their own device "
                         "tensors, so the hook would silently never run", "express it as the task's settings "
                         "(`grad_clip_norm=`, the optimizer's `weight_decay=`) or do it in the optimizer (a "
                         "torch.optim.Optimizer subclass whose step() changes p.grad first)", task=task.name,
                         hooked=hooked[:4] + (["..."] if len(hooked) > 4 else []))
    params = list(model.parameters())
    if not any(p.requires_grad for p in params):
        raise rule_error("the model has at least one parameter to train (requires_grad=True)", "pass a model "
                         "with parameters, and unfreeze the ones to train with `requires_grad_(True)`",
                         task=task.name, model=type(model).__name__, parameters=len(params), trainable=0)


def check_optimizer(task: ModelTask, model: Any, optimizer: Any) -> None:
    """The optimizer must update the runtime's model: parameters of a model built elsewhere would be stepped
    with no gradient ever reaching them. Leaving some of the model's parameters out is allowed, as in torch."""
    import torch

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise rule_error("`optimizer(model)` returns a torch.optim.Optimizer", "return the optimizer itself, e.g. "
                         "`lambda m: torch.optim.AdamW(m.parameters())`", kind=TypeError, task=task.name,
                         returned=type(optimizer).__name__)
    own = {id(p): p for p in model.parameters()}
    given = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [p for p in given if id(p) not in own]
    if foreign:
        raise rule_error("the optimizer's parameters are all parameters of the model it is given",
                         "build it from the factory's argument, `lambda model: torch.optim.AdamW(model.parameters()"
                         ")`, not from a model made outside the factory", task=task.name, foreign=len(foreign),
                         optimizer_params=len(given), first_foreign_shape=tuple(foreign[0].shape))
    if not any(p.requires_grad for p in given):
        raise rule_error("the optimizer updates at least one trainable parameter of the model", "pass the "
                         "parameters to train, e.g. `model.parameters()`", task=task.name,
                         optimizer_params=len(given), trainable=sum(p.requires_grad for p in own.values()))


def check_scheduler(task: ModelTask, scheduler: Any) -> None:
    """A scheduler whose ``step`` needs a metric (``ReduceLROnPlateau.step(metrics)``) is stepped once per epoch
    with ``task.lr_scheduler_metric``, which must then be named; one whose ``step`` takes none is stepped after
    every optimizer step, and a metric passed to it would be taken for an epoch number, so it must not be."""
    if not callable(getattr(scheduler, "step", None)):
        raise rule_error("`lr_scheduler(optimizer)` returns a scheduler with a `step` method", "return the "
                         "scheduler itself, e.g. `lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10)`",
                         kind=TypeError, task=task.name, returned=type(scheduler).__name__)
    needs = _step_needs_argument(scheduler)
    if needs and task.lr_scheduler_metric is None:
        raise rule_error("a scheduler whose `step` takes a metric (ReduceLROnPlateau) is given "
                         "`lr_scheduler_metric`", "name the reported loss it follows, e.g. "
                         "ModelTask(..., lr_scheduler_metric='eval_loss') (with eval_data) or 'train_loss': it is "
                         "then stepped once per epoch, after the evaluation, with that value", task=task.name,
                         scheduler=type(scheduler).__name__, lr_scheduler_metric=None)
    if not needs and task.lr_scheduler_metric is not None:
        raise rule_error("`lr_scheduler_metric` is given only for a scheduler whose `step` takes a metric "
                         "(ReduceLROnPlateau)", "drop lr_scheduler_metric: this scheduler is stepped after every "
                         "optimizer step", task=task.name, scheduler=type(scheduler).__name__,
                         lr_scheduler_metric=task.lr_scheduler_metric)


def _step_needs_argument(scheduler: Any) -> bool:
    """``scheduler.step`` has a required positional parameter (the metric), as ReduceLROnPlateau's has."""
    import inspect

    import torch

    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return True
    try:
        params = inspect.signature(scheduler.step).parameters.values()
    except (AttributeError, TypeError, ValueError):
        return False
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
