"""Modules with torch's inference fast path take it inside a unit exactly when the plain loop would.

    fast = fast_path_modules(stage.module)          # once per stage (ShardExec): its nn.MultiheadAttention & co.
    with native_scope(fast, device, stage.name):    # around the stage's call in a unit
        carry = stage.module(carry)

Why: ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` and ``nn.TransformerEncoder`` run a fused kernel in
eval mode without autograd, unless ``torch.overrides.has_torch_function`` says True, which any torch-function mode
on the thread's stack makes it say. A measured unit's ``OutermostCall`` (draws.py) and the light router
(``dispatch.RandomRouter``: every CUDA unit, a CPU unit's drawing stages) are such modes, so under them these
modules took their composite path: other kernels, other rounding. The first evaluation of a model with
``nn.MultiheadAttention`` read 1e-7 off the plain loop's, and a frozen eval-mode encoder in front of a trained
head moved the head's weights (tests/test_fast_path.py).

Rules (nothing silently wrong):
- around a stage holding such a module in eval mode (torch's fast path enabled), the unit's own function modes,
  ours only and only those at the top of the stack, are set aside for the stage's call: the module sees the stack
  the plain loop has. In training mode nothing changes (no fast path then; its dropout needs the router);
- those modules draw nothing in eval mode, but the stage's other modules may. While our modes are aside, a draw
  is routed by the measured unit's UnitMode (a dispatch mode, still active: exact); with no UnitMode active, the
  global generator's state is compared before and after the call, and if it moved (or is lent: not known
  unmoved), ``Device.unrouted_draw`` raises: a CPU device runs that task counted from then on (UnitMode routes
  every draw) and reruns the minibatch, exact; a CUDA device raises the error, naming the fix.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from . import dispatch
from .draws import OutermostCall

if TYPE_CHECKING:
    from .devices import Device

_NULL = contextlib.nullcontext()
_OWN = (OutermostCall, dispatch.RandomRouter)


def fast_path_types() -> tuple[type[nn.Module], ...]:
    """The torch modules whose forward takes a fused inference path unless a torch-function mode is active."""
    return nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder


def fast_path_modules(module: nn.Module) -> tuple[nn.Module, ...]:
    """Every module of ``module`` (itself included) of a ``fast_path_types`` class or a subclass of one."""
    kinds = fast_path_types()
    return tuple(m for m in module.modules() if isinstance(m, kinds))


def native_scope(fast: tuple[nn.Module, ...], device: Device, stage: str) -> contextlib.AbstractContextManager[Any]:
    """Around stage ``stage``'s call, ``fast`` its ``fast_path_modules``: our function modes set aside while one
    of them is in eval mode (see the module docstring); else nothing."""
    if not fast or all(m.training for m in fast) or not torch.backends.mha.get_fastpath_enabled():
        return _NULL
    return _OwnModesAside(device, stage)


class _OwnModesAside:
    """``native_scope``'s block: pops our modes off the top of the function-mode stack, pushes them back after."""

    __slots__ = ("device", "stage", "modes", "guarded", "before")

    def __init__(self, device: Device, stage: str) -> None:
        self.device, self.stage = device, stage
        self.modes: list[Any] = []
        self.guarded = False
        self.before: bytes | None = None

    def __enter__(self) -> None:
        while torch._C._len_torch_function_stack():
            top = torch._C._get_function_stack_at(torch._C._len_torch_function_stack() - 1)
            if not isinstance(top, _OWN):
                break
            self.modes.append(torch._C._pop_torch_function_stack())
        # a measured unit's UnitMode routes any draw itself; else the global generator must not move meanwhile
        self.guarded = bool(self.modes) and not any(isinstance(m, dispatch.UnitMode)
                                                     for m in _get_current_dispatch_mode_stack())
        if self.guarded:
            self.before = dispatch.global_rng_state()

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        for mode in reversed(self.modes):
            torch._C._push_on_torch_function_stack(mode)
        if kind is not None or not self.guarded:
            return
        if not dispatch.unmoved(self.before):
            raise self.device.unrouted_draw(self.stage)
