"""Declared stages checked at submit: run in order on the sample batch they must compute exactly what the model's
own forward computes, each from its input alone, and leave the model's state as the forward leaves it.

    check_stages(model, cut, batch, route=UnitMode, seed=task.seed)   # None, or a ValueError naming the rule

Why: a declared list that leaves out what ``forward`` does between two modules (``[m.fc1, m.fc2]`` when forward is
``fc2(relu(fc1(x)))``) would train another model than the user's, silently. Rules checked, in this order:
  * every stage runs on the previous one's output (an exception there names the stage);
  * each stage computes from its input, the parameters and buffers alone: run again on a fresh copy of its module
    (nothing an earlier stage left on an attribute) it gives the same output bit for bit; the runtime runs stages
    as separate units, recomputes them for the backward and passes gradients only through the carry;
  * the last output equals ``model(...)``'s bit for bit (tensors, dtypes, containers; ``.loss`` included, so the
    task's ``loss(outputs, batch)`` gets the same input); on a difference the error names the first stage boundary
    where the stages part from what forward passes between those modules, and the max abs difference;
  * the buffers and plain attributes (numbers, strings, tensors) of the model's modules end equal;
  * no parameter is changed in place (the runtime trains on device copies: such a change would be lost).
All in training mode and, for a task that evaluates, again in eval mode (the model switched as the runtime
switches it; stage modules that are not the model's follow it, explicit.py). Only declared stages (family
"explicit") are checked: nn.Sequential is cut exactly as its forward runs it, and the transformers families are
tested per family. How: on copies of the model (parameters and buffers copy-on-write:
no bytes until written), without autograd, on the CPU, under a scratch random stream from ``seed`` routed by
``route`` (the same draws for every run) with Python's and numpy's random states put back; the user's model, its
train/eval mode, its gradients, the task's random stream and the global ones are left as they were. A model that
cannot be deep-copied is not checked, with a warning.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import random
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn

from ..errors import rule_error
from .base import ModelStages, call_with_batch

Route = Callable[[torch.Generator], Any]   # a generator -> a context routing CPU random ops to it (UnitMode)

_RULE = "the declared stages, run in order on the sample batch, reproduce the model's own forward output exactly"
_FIX = ("declare every module forward calls, in order, so that nothing forward computes is left out between, "
        "before or after them (put it in a stage, e.g. the activation between two layers: `nn.Sequential(m.fc1, "
        "nn.ReLU())`), in `stages=` or a `hydra_stages()` method on the model; or declare no stages (the model "
        "then trains as one stage)")


class _Runs:
    """Runs code without autograd, from one random state: a scratch torch generator (routed by ``route``) and
    Python's and numpy's streams; ``state()`` after a run is where the next stage starts, ``close()`` puts the
    Python and numpy streams back as the user had them."""

    def __init__(self, route: Route, seed: int, autocast: torch.dtype | None) -> None:
        self.route, self.autocast = route, autocast
        self.gen = torch.Generator()
        numpy = sys.modules.get("numpy")  # only when the process uses it: never imported here
        self.np = numpy.random if numpy is not None else None
        self.saved = self.state()
        self.start = (torch.Generator().manual_seed(seed).get_state(), *self.saved[1:])

    def state(self) -> tuple[Any, ...]:
        return self.gen.get_state(), random.getstate(), self.np.get_state() if self.np is not None else None

    def _set(self, state: tuple[Any, ...]) -> None:
        self.gen.set_state(state[0])
        random.setstate(state[1])
        if self.np is not None:
            self.np.set_state(state[2])

    @contextlib.contextmanager
    def run(self, state: tuple[Any, ...] | None = None) -> Iterator[None]:
        self._set(self.start if state is None else state)
        precision = (torch.autocast("cpu", dtype=self.autocast) if self.autocast is not None
                     else contextlib.nullcontext())
        with torch.no_grad(), precision, self.route(self.gen):
            yield

    def close(self) -> None:
        self._set(self.saved)


def check_stages(model: nn.Module, cut: ModelStages, batch: Any, route: Route, seed: int,
                 autocast: torch.dtype | None = None, task: str = "", evaluate: bool = True) -> None:
    """Raise a ValueError (rule, values, fix) when ``cut``'s declared stages do not compute exactly what
    ``model`` computes on ``batch``, in training mode and (``evaluate``) in eval mode; nothing for the other
    families. See the module docstring for the rules."""
    if cut.family != "explicit":
        return
    modules = [s.module for s in cut.stages]
    try:
        copies = [_copy(model, modules, train) for train in (True, True, False, False)[:4 if evaluate else 2]]
    except Exception as exc:  # noqa: BLE001 - any copy failure: say so, train unchecked
        warnings.warn(f"hydra_tune could not check the declared stages of task {task!r} against the model's "
                      f"forward: the model cannot be deep-copied ({type(exc).__name__}: {exc}). They train as "
                      "declared: make sure they run every module forward calls, in order.", stacklevel=3)
        return
    runs = _Runs(route, seed, autocast)
    try:
        for i in range(0, len(copies), 2):
            (ref, _), (seq, seq_modules) = copies[i:i + 2]
            with runs.run():
                expected = call_with_batch(ref, _clone(batch))  # each run gets its own batch and inputs
            got = _run_stages(cut, seq_modules, model if i == 0 else None, batch, runs, task)
            _check_parameters(ref, seq, task)
            diff = _difference(expected, got)
            if diff is not None:
                last = f"after the last stage {len(cut.stages) - 1} ({cut.stages[-1].name}): {diff[0]}"
                at, max_abs = _first_boundary(model, cut, batch, runs, train=i == 0) or (last, diff[1])
                raise rule_error(_RULE, _FIX, task=task, first_difference=at if i == 0 else f"in eval mode, {at}",
                                 max_abs_diff=max_abs)
            _check_state(ref, seq, task)
    finally:
        runs.close()


def _check_parameters(ref: nn.Module, seq: nn.Module, task: str) -> None:
    # torch's in-place counter (no public accessor): the copies start at 0, any write bumps it
    changed = [n for n, p in [*ref.named_parameters(), *seq.named_parameters()] if p._version]
    if changed:
        raise rule_error("the model's forward changes no parameter in place", "change parameters only through "
                         "the optimizer (the runtime trains on device copies of them: an in-place change in "
                         "forward would be lost), or compute the changed value as a new tensor", task=task,
                         parameter=changed[0])


def _copy(model: nn.Module, modules: list[nn.Module], train: bool = True) -> tuple[nn.Module, list[nn.Module]]:
    """A copy of ``model`` with the stage modules (which reference its submodules): same sharing, own tensors;
    the model copy in training or eval mode, as the runtime switches it (``model.train()``/``eval()``)."""
    copied, stage_modules = copy.deepcopy((model, modules), _tensor_memo([model, *modules]))
    copied.train(train)
    return copied, stage_modules


def _fresh(module: nn.Module, model: nn.Module) -> nn.Module:
    """A copy of the user's (never run) stage ``module``: no state an earlier stage left. The model's tensors are
    in the memo too: a stage may reference the model outside its own module tree."""
    return copy.deepcopy(module, _tensor_memo([model, module]))


# Copy-on-write where torch has it: a copy costs no bytes until a forward writes into it (BatchNorm's statistics).
_cheap_clone = getattr(torch, "_lazy_clone", torch.clone)


def _tensor_memo(modules: list[nn.Module]) -> dict[int, Any]:
    """deepcopy's memo, preset so that parameters and buffers are copied cheaply (ties kept: one copy each)."""
    memo: dict[int, Any] = {}
    for m in modules:
        for t in [*m.parameters(), *m.buffers()]:
            if id(t) not in memo:
                c = _cheap_clone(t.detach())
                memo[id(t)] = nn.Parameter(c, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else c
    return memo


def _run_stages(cut: ModelStages, seq_modules: list[nn.Module], model: nn.Module | None, batch: Any, runs: _Runs,
                task: str) -> Any:
    """The stages in order on one copy; with the user's ``model``, each also alone on a fresh copy of its module,
    from the same input and random state. Returns the last output."""
    carry, state = cut.prepare(_clone(batch)), None
    for k, (stage, module) in enumerate(zip(cut.stages, seq_modules)):
        where, inp, start = f"stage {k} ({stage.name}){'' if model is not None else ' in eval mode'}", carry, state
        with runs.run(start):
            try:
                carry = module(_clone(inp))  # a stage may change its input in place
            except Exception as exc:
                raise rule_error("each declared stage runs on the previous stage's output", _FIX, task=task,
                                 stage=where, error=f"{type(exc).__name__}: {exc}") from exc
        state = runs.state()
        if model is None:
            continue
        alone = _fresh(cut.stages[k].module, model)
        with runs.run(start):
            try:
                again = alone(_clone(inp))
            except Exception as exc:
                raise _captured(task, where, f"{type(exc).__name__}: {exc}") from exc
        diff = _difference(carry, again)
        if diff is not None:
            raise _captured(task, where, diff[1])
    return carry


def _captured(task: str, where: str, got: object) -> Exception:
    return rule_error(
        "each declared stage computes from its input alone (the previous stage's output), the parameters and "
        "buffers: run again on a fresh copy of its module it gives the same output", "pass what a later stage "
        "needs in the output of the earlier one (e.g. return a tuple or dict) instead of keeping it on a module "
        "attribute: the runtime runs stages as separate units, recomputes them for the backward and passes "
        "gradients only through stage outputs", task=task, stage=where, alone=got)


def _check_state(ref: nn.Module, seq: nn.Module, task: str) -> None:
    """The model's buffers and plain attributes after its forward equal those after the stages."""
    for (name, a), (_, b) in zip(ref.named_modules(), seq.named_modules()):
        for key, value in _state(a):
            diff = _difference(value, _attr(b, key))
            if diff is not None:
                raise rule_error(
                    "the declared stages change the model's buffers and attributes as its forward does", "let a "
                    "stage's module make the change (forward's own code outside the stage modules runs in no "
                    "stage, e.g. `self.calls += 1` in the model's forward: move it into a submodule a stage "
                    "holds)", task=task, state=f"{name}.{key}" if name else key, max_abs_diff=diff[1])


_MODULE_KEYS = frozenset(vars(nn.Module())) | {"training"}


def _state(module: nn.Module) -> Iterator[tuple[str, Any]]:
    for key, value in module.named_buffers(recurse=False):
        yield key, value
    for key, value in vars(module).items():
        if key not in _MODULE_KEYS and isinstance(value, (bool, int, float, str, torch.Tensor)):
            yield key, value


def _attr(module: nn.Module, key: str) -> Any:
    buffers = dict(module.named_buffers(recurse=False))
    return buffers[key] if key in buffers else vars(module).get(key, _MISSING)


_MISSING = object()


# -- where the stages part from the forward (only when the outputs differ) -------------------------------------
def _first_boundary(model: nn.Module, cut: ModelStages, batch: Any, runs: _Runs,
                    train: bool) -> tuple[str, float] | None:
    """The first stage boundary where the stages' values differ from what forward passes to (or gets from) the
    same modules: the model runs on a fresh copy with every call of those modules recorded."""
    modules = [s.module for s in cut.stages]
    ref, ref_modules = _copy(model, modules, train)
    calls: dict[int, list[list[Any]]] = {id(m): [] for m in ref_modules}  # per call: [args, kwargs, output]
    hooks = []
    for m in {id(m): m for m in ref_modules}.values():
        hooks.append(m.register_forward_pre_hook(_record_inputs(calls[id(m)]), with_kwargs=True))
        hooks.append(m.register_forward_hook(_record_output(calls[id(m)])))
    with runs.run():
        call_with_batch(ref, _clone(batch))
    for h in hooks:
        h.remove()
    seq_modules = _copy(model, modules, train)[1]
    carry, state, seen = cut.prepare(_clone(batch)), None, {}
    for k, (stage, module) in enumerate(zip(cut.stages, seq_modules)):
        j = seen[id(ref_modules[k])] = seen.get(id(ref_modules[k]), -1) + 1
        with runs.run(state):
            out = module(_clone(carry))
        state = runs.state()
        recorded = calls[id(ref_modules[k])]
        if j < len(recorded):
            args, kwargs, result = recorded[j]
            if len(args) != 1 or kwargs:
                return (f"stage {k} ({stage.name}) gets 1 input, forward calls it with {len(args)} args, "
                        f"{len(kwargs)} kwargs", math.nan)
            diff = _difference(args[0], carry)
            if diff is not None:
                before = f"stage {k - 1} ({cut.stages[k - 1].name}) and " if k else "the batch and "
                return f"between {before}stage {k} ({stage.name})", diff[1]
            diff = _difference(result, out)
            if diff is not None:
                return f"inside stage {k} ({stage.name})", diff[1]
        carry = out
    return None


def _record_inputs(calls: list[list[Any]]) -> Callable[..., None]:
    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        calls.append([*_clone((args, kwargs)), _MISSING])  # before the module may change them in place
    return record


def _record_output(calls: list[list[Any]]) -> Callable[..., None]:
    def record(module: nn.Module, args: tuple, output: Any) -> None:
        open_calls = [c for c in calls if c[2] is _MISSING]
        open_calls[-1][2] = _clone(output)  # the innermost call still open: this one
    return record


def _clone(tree: Any) -> Any:
    from torch.utils._pytree import tree_map  # torch's own pytree walk: there is no public one

    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


# -- exact comparison -------------------------------------------------------------------------------------------
def _difference(a: Any, b: Any, path: str = "output") -> tuple[str, float] | None:
    """None when ``a`` and ``b`` are the same bit for bit (NaN equal to NaN), else (where, max abs difference;
    NaN when they differ in structure, type, shape or dtype)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path} ({type(a).__name__} vs {type(b).__name__})", math.nan
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{path} ({a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)})", math.nan
        return _tensor_difference(a, b, path)
    if type(a) is not type(b):
        return f"{path} ({type(a).__name__} vs {type(b).__name__})", math.nan
    if isinstance(a, Mapping):
        if list(a.keys()) != list(b.keys()):
            return f"{path} (keys {list(a.keys())} vs {list(b.keys())})", math.nan
        pairs = [(f"{path}[{k!r}]", a[k], b[k]) for k in a]
    elif isinstance(a, (tuple, list)):
        if len(a) != len(b):
            return f"{path} (length {len(a)} vs {len(b)})", math.nan
        pairs = [(f"{path}[{i}]", x, y) for i, (x, y) in enumerate(zip(a, b))]
    elif dataclasses.is_dataclass(a):
        pairs = [(f"{path}.{f.name}", getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)]
    else:
        return _plain_difference(a, b, path)
    for p, x, y in pairs:
        diff = _difference(x, y, p)
        if diff is not None:
            return diff
    return None


def _tensor_difference(a: torch.Tensor, b: torch.Tensor, path: str) -> tuple[str, float] | None:
    if torch.equal(a, b):
        return None
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    x, y = a.detach().cpu().double(), b.detach().cpu().double()
    both_nan = torch.isnan(x) & torch.isnan(y)
    gap = (x - y).abs().masked_fill(both_nan, 0.0).nan_to_num(nan=math.inf)
    worst = float(gap.max()) if gap.numel() else 0.0
    return (path, worst) if worst != 0.0 or not torch.equal(torch.isnan(x), torch.isnan(y)) else None


def _plain_difference(a: Any, b: Any, path: str) -> tuple[str, float] | None:
    if a is b or a is _MISSING or b is _MISSING:
        return None if a is b else (f"{path} (missing)", math.nan)
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return None
    try:
        same = bool(a == b)
    except Exception:  # noqa: BLE001 - an object without a usable ==: its type was compared
        return None
    return None if same else (f"{path} ({_short(a)} vs {_short(b)})", math.nan)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 20 else text[:17] + "..."
