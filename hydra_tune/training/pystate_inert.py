"""Units whose modules can change no Python state, so that they need no snapshot of it (pystate.py).

    inert = inert_modules(shard_modules)    # once per shard: None unless every module is of the classes below
    if still_inert(inert): ...              # before a unit: no hook and no attribute added since, so no snapshot

Rules: only torch.nn classes whose forward changes no Python attribute of theirs (state they do change lives in
buffers) qualify; a hook on any of the modules, a global module hook, or an attribute added since
``inert_modules`` ends it (a hook's closure may keep state), and the unit takes its snapshot as any other.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch.nn as nn
from torch.nn.modules import module as torch_module  # torch keeps the global module hooks there

# torch.nn classes whose forward changes no Python attribute of theirs (state they do change lives in buffers): a
# unit over modules of these classes alone, with no hooks and no attribute added since, needs no snapshot (by name:
# a class this torch release lacks is left out)
_INERT = frozenset(getattr(nn, name) for name in (
    "Linear", "Identity", "Bilinear", "ReLU", "ReLU6", "LeakyReLU", "GELU", "SiLU", "Tanh", "Sigmoid", "Softmax",
    "LogSoftmax", "ELU", "Mish", "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "LayerNorm",
    "GroupNorm", "RMSNorm", "Embedding", "Conv1d", "Conv2d", "Conv3d", "MaxPool1d", "MaxPool2d", "AvgPool1d",
    "AvgPool2d", "AdaptiveAvgPool2d", "Flatten", "Unflatten", "Sequential", "ModuleList", "ModuleDict", "BatchNorm1d",
    "BatchNorm2d", "BatchNorm3d") if hasattr(nn, name))


def inert_modules(modules: Iterable[nn.Module]) -> list[tuple[nn.Module, int]] | None:
    """``(module, its __dict__ size)`` for each of ``modules`` when all are of the inert torch.nn classes (their
    forwards change no Python attribute), else None: what ``still_inert`` checks before a unit."""
    out = [(m, len(m.__dict__)) for m in modules]
    return out if all(type(m) in _INERT for m, _ in out) else None


def still_inert(inert: list[tuple[nn.Module, int]] | None) -> bool:
    """Whether a unit over these modules can change no Python state: no hooks on them (nor global ones) and no
    attribute added since ``inert_modules`` (a snapshot around it would always find it unchanged)."""
    if inert is None or _global_hooks():
        return False
    for m, size in inert:
        if (len(m.__dict__) != size or m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or m._backward_pre_hooks):
            return False
    return True


def _global_hooks() -> bool:
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
                or torch_module._global_backward_hooks or torch_module._global_backward_pre_hooks)
