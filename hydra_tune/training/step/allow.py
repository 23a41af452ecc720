"""Which optimizers the lazy per-shard step reproduces exactly: an allowlist, and the reason for everything else.

    verdict = check_lazy(optimizer, scaler, model)   # LazyVerdict(lazy=True, reason="torch.optim.AdamW ...")
    if not verdict.lazy: ...                           # one whole optimizer.step() at the step boundary

Rules: lazy only for the exact torch.optim classes below, whose every update reads and writes one parameter, its
gradient and its own ``optimizer.state[p]`` (foreach and fused kernels group tensors by device and dtype only), with
``differentiable=False`` and ``capturable=False`` in every param group, no step pre/post hook (the optimizer's own
or torch's global ones: a hook would run once per shard and see a restricted optimizer), torch's own ``step``
(at most wrapped by an LR scheduler), a ``torch.amp.GradScaler`` or none, and no module that makes sparse
gradients. Everything else gets ``lazy=False`` and a reason naming it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.optim.optimizer as _optimizer_module  # the global step-hook registries live there, without a getter

_LAZY = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
         torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Rprop, torch.optim.ASGD,
         torch.optim.Adadelta)
ALLOWED: frozenset[type] = frozenset(_LAZY)

_WHY_NOT: dict[str, str] = {
    "LBFGS": "LBFGS re-evaluates the loss over all parameters (its step needs a closure) and keeps one flat "
             "state for all of them",
    "SparseAdam": "SparseAdam steps sparse gradients, which the lazy step does not split",
}



@dataclass(frozen=True)
class LazyVerdict:
    """Whether the lazy per-shard step reproduces ``optimizer.step()`` exactly, and why (or why not)."""

    lazy: bool
    reason: str


def _name(cls: type) -> str:
    module = cls.__module__
    if module.startswith("torch.optim"):
        module = "torch.optim"
    return f"{module}.{cls.__qualname__}"


def _type_reason(optimizer: Any) -> str | None:
    cls = type(optimizer)
    if cls in ALLOWED:
        return None
    if cls.__name__ in _WHY_NOT and cls.__module__.startswith("torch.optim"):
        return _WHY_NOT[cls.__name__]
    base = next((b for b in cls.__mro__[1:] if b in ALLOWED), None)
    if base is not None:
        return (f"{_name(cls)} is a subclass of {_name(base)}: its step may read parameters together or differ "
                "from torch's, so only the exact torch class is split per shard")
    if isinstance(optimizer, torch.optim.Optimizer) and cls.__module__.startswith("torch.optim"):
        return f"{_name(cls)} is not on the lazy-step allowlist (not proven to update each parameter on its own)"
    return (f"{_name(cls)} is not a torch.optim optimizer on the lazy-step allowlist (optimizers from other "
            "packages may read all parameters at once)")


def _group_reason(optimizer: Any) -> str | None:
    for i, group in enumerate(optimizer.param_groups):
        if group.get("differentiable", False):
            return (f"param group {i} has differentiable=True: its step builds an autograd graph through all "
                    "parameters")
        if group.get("capturable", False):
            return (f"param group {i} has capturable=True (CUDA-graph stepping): not proven for the lazy step "
                    "here (no CPU test can run it)")
    return None


def _hook_reason(optimizer: Any) -> str | None:
    """Step hooks: torch offers no public getter, so the registries the step wrapper itself reads are checked."""
    if getattr(_optimizer_module, "_global_optimizer_pre_hooks", None):
        return "a global optimizer step pre-hook is registered (torch.optim.optimizer.register_optimizer_step_pre_hook)"
    if getattr(_optimizer_module, "_global_optimizer_post_hooks", None):
        return ("a global optimizer step post-hook is registered "
                "(torch.optim.optimizer.register_optimizer_step_post_hook)")
    if getattr(optimizer, "_optimizer_step_pre_hooks", None):
        return "the optimizer has a step pre-hook (register_step_pre_hook): it would run once per shard"
    if getattr(optimizer, "_optimizer_step_post_hooks", None):
        return "the optimizer has a step post-hook (register_step_post_hook): it would run once per shard"
    return None


def _step_reason(optimizer: Any) -> str | None:
    cls_step = type(optimizer).step
    if not getattr(cls_step, "__module__", "").startswith("torch.optim"):
        return f"{_name(type(optimizer))}.step was replaced ({getattr(cls_step, '__module__', '?')})"
    own = vars(optimizer).get("step")
    # An LR scheduler wraps the bound step to note that it ran (lr_scheduler.py): that wrapper is harmless.
    if own is not None and not (getattr(own, "_wrapped_by_lr_sched", False)
                                and getattr(own, "__wrapped__", None) is cls_step):
        return "optimizer.step was replaced on the instance (a patched step may read all parameters)"
    return None


def _is_torch_scaler(cls: type) -> bool:
    """torch.amp.GradScaler, or one of its deprecated per-device aliases in torch (they only fix the device)."""
    return cls is torch.amp.GradScaler or (issubclass(cls, torch.amp.GradScaler)
                                           and cls.__module__.startswith("torch.")
                                           and cls.__module__.endswith(".amp.grad_scaler"))


def _scaler_reason(scaler: Any) -> str | None:
    if scaler is None or _is_torch_scaler(type(scaler)):
        return None
    return (f"the loss scaler {_name(type(scaler))} is not torch.amp.GradScaler: its unscale/step/update are not "
            "known to split per shard")


def _model_reason(model: Any) -> str | None:
    if model is None:
        return None
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
            return (f"module {name or type(model).__name__!r} makes sparse gradients (sparse=True): SGD/Adagrad "
                    "pick their code path for a whole param group by them, and clipping/unscaling differ")
    return None


def check_lazy(optimizer: Any, scaler: Any = None, model: Any = None) -> LazyVerdict:
    """Whether ``optimizer`` (with ``scaler``, over ``model``) may take the lazy per-shard step exactly.

        check_lazy(torch.optim.AdamW(m.parameters()))        # LazyVerdict(lazy=True, reason=...)
        check_lazy(torch.optim.LBFGS(m.parameters())).reason  # 'LBFGS re-evaluates the loss over all ...'

    Checked now; ``step_shard`` checks the hooks again at every call (one may be registered later)."""
    for reason in (_type_reason(optimizer), _group_reason(optimizer), _hook_reason(optimizer),
                   _step_reason(optimizer), _scaler_reason(scaler), _model_reason(model)):
        if reason is not None:
            return LazyVerdict(False, reason)
    impl = sorted({"fused" if g.get("fused") else "foreach" if g.get("foreach") else
                   "foreach-or-for-loop (foreach=None)" if g.get("foreach") is None else "for-loop"
                   for g in optimizer.param_groups})
    return LazyVerdict(True, f"{_name(type(optimizer))} ({', '.join(impl)}) updates each parameter from its own "
                             "gradient and state: stepped per shard")


def hook_reason(optimizer: Any) -> str | None:
    """The step hook that forbids a per-shard step now, or None (``step_shard`` calls it before each step)."""
    return _hook_reason(optimizer)
