"""The prepared model: an ``nn.Module`` standing for the user's model, whose calls run on the shared runtime.

    model, optimizer = hydra_tune.prepare(model, optimizer)
    out = model(x)                                   # units on the runtime's devices; out on x's device
    model.train(); model.eval(); model.parameters()  # the user's model's own
    torch.save(model.state_dict(), "m.pt")           # the same keys and tensors as the unprepared model's
    model.module                                     # the user's model itself (its weights back in host memory)
    model.hydra_task                                 # its TaskHandle (``model.task`` too, unless the model has one)
    copy.deepcopy(model); torch.save(model, "m.pt")  # copies / saves the user's model (a plain module)

Why a proxy and not the model itself: calling the model must submit units instead of running its forward in the
user's thread, while everything else (parameters, buffers, modes, state dicts, attributes like ``model.config``)
must be the user's model's own so that clipping, optimizers, schedulers and saving behave as in the plain loop.
The user's model is not a submodule of the proxy (its state dict keys stay unprefixed): every reader delegates.

Rules: what changes the model's tensors' dtype or identity is refused (refusals.py): a cast that changes a dtype,
assigning or registering a module, parameter or buffer; device moves, and casts to the dtype every floating tensor
has already, are accepted and change nothing (the runtime places the shards; outputs come back on the inputs'
device); hooks on the proxy are refused, and so is ``torch.compile`` of it. Any other attribute set on the proxy
is set on the user's model (``model.temperature = 2.0`` reaches its forward, as in the plain loop), and a
container model (``nn.Sequential``, ``nn.ModuleList``) is indexed, measured and iterated as the user's:
``model[0]`` is its first module.
"""
from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from .optimizer import direct
from .refusals import refuse_compile, refuse_dtype, refuse_register, refuse_replace, refuse_shared_load
from .runner import Runner

# the proxy's own attributes: torch's module bookkeeping (set by nn.Module.__init__) and ``training``
_OWN = frozenset(nn.Module().__dict__)


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
        """The user's model (its weights written back to host memory; calling it runs a plain forward here); a
        model with a ``module`` of its own (a wrapper's inner module) gets that, as without ``prepare``."""
        model = self._hydra_model
        if _has_own(model, "module"):
            return getattr(model, "module")
        self._hydra_runner.access.to_host()
        return model

    @property
    def task(self) -> Any:
        """The runtime's ``TaskHandle`` of this model (None before the first call); a model with a ``task`` of its
        own (a multi-task model's current task) gets that, as without ``prepare`` (then use ``hydra_task``)."""
        model = self._hydra_model
        return getattr(model, "task") if _has_own(model, "task") else self.hydra_task

    @property
    def hydra_task(self) -> Any:
        """The runtime's ``TaskHandle`` of this model, whatever attributes the model has (None before the first
        call)."""
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

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            super().__setattr__(name, value)
            model = self.__dict__.get("_hydra_model")  # (None while nn.Module.__init__ sets the proxy up)
            if name == "training" and model is not None:  # ``model.training = False``: the top module's flag too
                model.training = value
            return
        model = self._hydra_model
        if isinstance(value, (nn.Module, nn.Parameter)) or _holds(model, name):
            raise refuse_replace(f"model.{name} = {type(value).__name__}(...)")
        setattr(model, name, value)  # (the forward reads the user's model: it sees it, as in the plain loop)

    def __delattr__(self, name: str) -> None:
        model = self._hydra_model
        if name in _OWN or _holds(model, name):
            raise refuse_replace(f"del model.{name}")
        delattr(model, name)

    # -- a container model's protocol (nn.Sequential, nn.ModuleList, nn.ModuleDict): the user's model's -------------
    def __getitem__(self, index: Any) -> Any:
        return self._hydra_model[index]

    def __setitem__(self, index: Any, value: Any) -> None:
        raise refuse_replace("model[...] = module")

    def __delitem__(self, index: Any) -> None:
        raise refuse_replace("del model[...]")

    def __len__(self) -> int:
        return len(self._hydra_model)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._hydra_model)

    def __contains__(self, item: Any) -> bool:
        return item in self._hydra_model

    def __bool__(self) -> bool:
        return bool(self._hydra_model)  # (a module without __len__ is true; an empty Sequential is not)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(dir(self._hydra_model)))

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
        access = self._hydra_runner.access
        access.to_host()  # the user's model's own host tensors, current
        out = self._hydra_model.state_dict(*args, **kwargs)
        access.exported(out.values())  # aliases of those: the state stays there while the loop holds them
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        if assign:  # new tensors: the optimizer and the plan hold the old ones
            raise refuse_dtype("model.load_state_dict(..., assign=True)")
        self._hydra_runner.access.to_host()  # copied into the host tensors; they move in again at the next call
        shared = self._hydra_runner.shared_frozen()
        if not shared:
            return self._hydra_model.load_state_dict(state_dict, strict=strict)
        return _load_beside_shared(self._hydra_model, state_dict, strict, shared)

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
            self._same_dtype(dtype, f"model.to({dtype})")
        return self  # the runtime places the shards; outputs come back on the inputs' device

    def cuda(self, device: Any = None) -> "PreparedModel":
        return self

    def cpu(self) -> "PreparedModel":
        return self

    def half(self) -> "PreparedModel":
        return self._same_dtype(torch.float16, "model.half()")

    def float(self) -> "PreparedModel":
        return self._same_dtype(torch.float32, "model.float()")

    def double(self) -> "PreparedModel":
        return self._same_dtype(torch.float64, "model.double()")

    def bfloat16(self) -> "PreparedModel":
        return self._same_dtype(torch.bfloat16, "model.bfloat16()")

    def type(self, dst_type: Any) -> "PreparedModel":
        raise refuse_dtype(f"model.type({dst_type})")

    def to_empty(self, *args: Any, **kwargs: Any) -> "PreparedModel":
        raise refuse_replace("model.to_empty(...)")

    def _same_dtype(self, dtype: torch.dtype, call: str) -> "PreparedModel":
        """A cast that changes nothing (every floating tensor has ``dtype`` already: ``model.float()`` of an fp32
        model) is the model itself; one that would change a tensor is refused."""
        with direct():  # reads dtypes, not values: no pending update is applied for it (guard.py)
            tensors = [*self._hydra_model.parameters(), *self._hydra_model.buffers()]
            changes = any(t.is_floating_point() and t.dtype != dtype for t in tensors)
        if changes:
            raise refuse_dtype(call)
        return self

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

    # -- the user's model's own, for what runs outside the forward -----------------------------------------------
    def apply(self, fn: Any) -> "PreparedModel":
        # ``fn`` on the user's model and every submodule (on the proxy, its top module was never visited)
        self._hydra_runner.access.flush()  # as a read of the weights: their values as after the last step
        self._hydra_model.apply(fn)
        return self

    def register_state_dict_pre_hook(self, *args: Any, **kwargs: Any) -> Any:
        return self._hydra_model.register_state_dict_pre_hook(*args, **kwargs)  # state_dict() is the model's

    def register_state_dict_post_hook(self, *args: Any, **kwargs: Any) -> Any:
        return self._hydra_model.register_state_dict_post_hook(*args, **kwargs)

    def register_load_state_dict_pre_hook(self, *args: Any, **kwargs: Any) -> Any:
        return self._hydra_model.register_load_state_dict_pre_hook(*args, **kwargs)

    def register_load_state_dict_post_hook(self, *args: Any, **kwargs: Any) -> Any:
        return self._hydra_model.register_load_state_dict_post_hook(*args, **kwargs)

    def share_memory(self) -> "PreparedModel":
        raise refuse_replace("model.share_memory()")  # new storages under the tensors the runtime holds

    # -- new modules and tensors: the runtime planned the ones the model had ----------------------------------------
    def register_buffer(self, name: str, *args: Any, **kwargs: Any) -> None:
        raise refuse_replace(f"model.register_buffer({name!r}, ...)")

    def register_parameter(self, name: str, *args: Any, **kwargs: Any) -> None:
        raise refuse_replace(f"model.register_parameter({name!r}, ...)")

    def add_module(self, name: str, *args: Any, **kwargs: Any) -> None:
        raise refuse_replace(f"model.add_module({name!r}, ...)")

    def register_module(self, name: str, *args: Any, **kwargs: Any) -> None:
        raise refuse_replace(f"model.register_module({name!r}, ...)")

    def set_submodule(self, target: str, *args: Any, **kwargs: Any) -> None:
        raise refuse_replace(f"model.set_submodule({target!r}, ...)")


def _load_beside_shared(model: nn.Module, state_dict: Any, strict: bool, shared: dict[str, torch.Tensor]) -> Any:
    """``model.load_state_dict`` for a model holding weights with other tasks (frozen, equal: one tensor for all):
    an entry equal to such a weight is left out (writing it, even with its own values, would read as a write into
    the others' weight); one with other values is refused (it would change every holder's); ``strict`` keeps its
    meaning for the rest."""
    changed = [k for k, v in state_dict.items() if k in shared and not torch.equal(v.to(shared[k].device),
                                                                                  shared[k].detach())]
    if changed:
        raise refuse_shared_load(changed)
    rest = {k: v for k, v in state_dict.items() if k not in shared}
    result = model.load_state_dict(rest, strict=False)
    missing = [k for k in result.missing_keys if k not in state_dict]
    if strict and (missing or result.unexpected_keys):
        lines = ([f"Missing key(s) in state_dict: {', '.join(repr(k) for k in missing)}."] if missing else []) + (
            [f"Unexpected key(s) in state_dict: {', '.join(repr(k) for k in result.unexpected_keys)}."]
            if result.unexpected_keys else [])
        raise RuntimeError(f"Error(s) in loading state_dict for {type(model).__name__}:\n\t" + "\n\t".join(lines))
    return type(result)(missing, result.unexpected_keys)


def _has_own(model: nn.Module, name: str) -> bool:
    """Whether the user's model has an attribute ``name`` of its own (plain, submodule, tensor or its class's)."""
    return name in vars(model) or _holds(model, name) or hasattr(type(model), name)


def _holds(model: nn.Module, name: str) -> bool:
    """Whether ``name`` is one of ``model``'s own submodules, parameters or buffers."""
    return name in model._modules or name in model._parameters or name in model._buffers
