"""The prepared model: an ``nn.Module`` standing for the user's model, whose calls run on the shared runtime.

    model, optimizer = hydra_tune.prepare(model, optimizer)
    out = model(x)                                   # units on the runtime's devices; out on x's device
    model.train(); model.eval(); model.parameters()  # the user's model's own
    torch.save(model.state_dict(), "m.pt")           # the same keys and tensors as the unprepared model's
    model.module                                     # the user's model itself (its weights back in host memory)
    copy.deepcopy(model); torch.save(model, "m.pt")  # copies / saves the user's model (a plain module)

Why a proxy and not the model itself: calling the model must submit units instead of running its forward in the
user's thread, while everything else (parameters, buffers, modes, state dicts, attributes like ``model.config``)
must be the user's model's own so that clipping, optimizers, schedulers and saving behave as in the plain loop.
The user's model is not a submodule of the proxy (its state dict keys stay unprefixed): every reader delegates.

Rules: what changes the model's tensors' dtype or identity is refused (refusals.py); device moves are accepted
and change nothing (the runtime places the shards; outputs come back on the inputs' device); hooks on the proxy
are refused, and so is ``torch.compile`` of it.
"""
from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from .refusals import refuse_compile, refuse_dtype, refuse_register
from .runner import Runner


class PreparedModel(nn.Module):
    """The user's model, called through the runtime (see the module docstring)."""

    def __init__(self, model: nn.Module, runner: Runner) -> None:
        super().__init__()
        # plain attributes, not submodules: the state dict and parameters are the user's model's, unprefixed
        object.__setattr__(self, "_hydra_model", model)
        object.__setattr__(self, "_hydra_runner", runner)
        self.training = model.training

    @property
    def module(self) -> nn.Module:
        """The user's model (its weights written back to host memory; calling it runs a plain forward here)."""
        self._hydra_runner.access.to_host()
        return self._hydra_model

    @property
    def task(self) -> Any:
        """The runtime's ``TaskHandle`` of this model (None before the first call)."""
        return self._hydra_runner.handle

    def release(self) -> None:
        """End this model's task now (its state and board entry are freed); a later call raises."""
        self._hydra_runner.driver.release()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._hydra_runner.forward(args, kwargs)

    @property
    def forward(self) -> Any:  # type: ignore[override]
        # torch.compile reads `.forward` of the module it wraps (torch._dynamo): refused there, kept for calls
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("torch._dynamo") or caller.startswith("torch.compiler"):
            raise refuse_compile()
        return self.__call__

    def compile(self, *args: Any, **kwargs: Any) -> None:
        raise refuse_compile()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_hydra_model"), name)

    def __deepcopy__(self, memo: dict) -> nn.Module:
        # an EMA copy, a best-model copy: the user's model (a plain, unprepared module), as the plain loop's copy
        self._hydra_runner.access.to_host()
        return copy.deepcopy(self._hydra_model, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # torch.save(model): saved as the user's model, loaded as a plain module (copy.copy of it: the standard
        # library's, so loading needs no hydra_tune)
        self._hydra_runner.access.to_host()
        return copy.copy, (self._hydra_model,)

    def __repr__(self) -> str:
        return f"Prepared({self._hydra_model!r})"

    # -- the user's model's own tensors ------------------------------------------------------------------------
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        self._hydra_runner.access.flush()  # their values as after the last step (pending per-shard updates)
        return self._hydra_model.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        self._hydra_runner.access.flush()
        return self._hydra_model.named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return self._hydra_model.buffers(recurse)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return self._hydra_model.named_buffers(*args, **kwargs)

    def children(self) -> Iterator[nn.Module]:
        return self._hydra_model.children()

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        return self._hydra_model.named_children()

    def modules(self) -> Iterator[nn.Module]:
        return self._hydra_model.modules()

    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        return self._hydra_model.named_modules(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self._hydra_runner.access.to_host()  # the user's model's own host tensors, current
        return self._hydra_model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        if assign:  # new tensors: the optimizer and the plan hold the old ones
            raise refuse_dtype("model.load_state_dict(..., assign=True)")
        self._hydra_runner.access.to_host()  # copied into the host tensors; they move in again at the next call
        return self._hydra_model.load_state_dict(state_dict, strict=strict)

    def train(self, mode: bool = True) -> "PreparedModel":
        self._hydra_model.train(mode)
        self.training = mode
        return self

    def eval(self) -> "PreparedModel":
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # as optimizer.zero_grad(): the gradients pending updates still need are held for them (access.py)
        self._hydra_runner.access.zero_grad(self._hydra_model.zero_grad, set_to_none)

    def requires_grad_(self, requires_grad: bool = True) -> "PreparedModel":
        self._hydra_model.requires_grad_(requires_grad)
        return self

    # -- moves and casts ---------------------------------------------------------------------------------------
    def to(self, *args: Any, **kwargs: Any) -> "PreparedModel":
        # torch's own parser of .to()'s arguments (device, dtype, non_blocking, memory_format)
        _, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None:
            raise refuse_dtype(f"model.to({dtype})")
        return self  # the runtime places the shards; outputs come back on the inputs' device

    def cuda(self, device: Any = None) -> "PreparedModel":
        return self

    def cpu(self) -> "PreparedModel":
        return self

    def half(self) -> "PreparedModel":
        raise refuse_dtype("model.half()")

    def float(self) -> "PreparedModel":
        raise refuse_dtype("model.float()")

    def double(self) -> "PreparedModel":
        raise refuse_dtype("model.double()")

    def bfloat16(self) -> "PreparedModel":
        raise refuse_dtype("model.bfloat16()")

    # -- hooks ---------------------------------------------------------------------------------------------------
    def register_forward_hook(self, *args: Any, **kwargs: Any) -> Any:
        raise refuse_register("register_forward_hook")

    def register_forward_pre_hook(self, *args: Any, **kwargs: Any) -> Any:
        raise refuse_register("register_forward_pre_hook")

    def register_full_backward_hook(self, *args: Any, **kwargs: Any) -> Any:
        raise refuse_register("register_full_backward_hook")

    def register_full_backward_pre_hook(self, *args: Any, **kwargs: Any) -> Any:
        raise refuse_register("register_full_backward_pre_hook")

    def register_backward_hook(self, *args: Any, **kwargs: Any) -> Any:
        raise refuse_register("register_backward_hook")
