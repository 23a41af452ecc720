"""The Python state of a shard's modules: what a forward may change besides parameters and buffers, taken before
it so that a recomputing backward replays the forward as it first ran and a retried minibatch starts over.

    before = ModuleState.take(modules)     # before a forward
    out = run(...)
    if before.changed():                   # the forward rebound an attribute, grew a list, counted in a hook
        now = ModuleState.take(modules); before.restore(); replay(...); now.restore()

What counts as state: every attribute of a module that is not torch's own bookkeeping (``training``, the
parameter/buffer/submodule dicts, the hook dicts), the attributes of callable hook objects and the closure cells
of hook functions (a ``nonlocal`` counter), for forward and backward hooks alike, and one level down the
attributes of plain user objects held there (``self.schedule.step += 1``).

Rules: an attribute rebound (``self.calls += 1``, ``self.temp = ...``, a new attribute) and the contents of a
list, dict, set or deque attribute are put back exactly (containers in place: references to them stay valid);
a tensor attribute that is not a buffer and was changed in place (``self.t.add_(1)``), or a container longer
than 10,000 items changed in place (compared by length only: copying it every unit would cost), cannot be put
back: ``inplace()`` names it and the caller refuses to go on. State the snapshot does not see (objects nested
deeper, elements inside containers, module-level globals) is the user's to keep out of ``forward``.
"""
from __future__ import annotations

import collections
import copy
import functools
import itertools
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

_TORCH_OWN = frozenset(nn.Module().__dict__)  # torch's bookkeeping of every module, and ``training``
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_CONTAINERS = (list, dict, set, collections.deque, bytearray)
_MISSING = object()
_BIG = 10_000  # a container longer than this is compared by its length only (copying it every unit costs)
_NOT_STATE = (nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType, types.MethodType,
              types.BuiltinFunctionType, functools.partial)


class _Cell:
    """A closure cell seen as a one-entry dict, so that cells and ``__dict__``s are read and written alike."""

    def __init__(self, cell: Any) -> None:
        self.cell = cell

    def items(self) -> Iterable[tuple[str, Any]]:
        try:
            return [("<cell>", self.cell.cell_contents)]
        except ValueError:  # an empty cell
            return []

    def get(self, key: str, default: Any) -> Any:
        return dict(self.items()).get(key, default)

    def __setitem__(self, key: str, value: Any) -> None:
        self.cell.cell_contents = value

    def __delitem__(self, key: str) -> None:
        del self.cell.cell_contents


def _plain_object(value: Any) -> bool:
    """A user object whose attributes are state too (a schedule object a forward steps), not torch's or code."""
    return (hasattr(value, "__dict__") and not isinstance(value, _NOT_STATE)
            and not type(value).__module__.startswith("torch"))


def _holders(modules: Iterable[nn.Module]) -> list[tuple[str, Any, frozenset[str]]]:
    """(name, mapping, keys to skip) for every place of state: module ``__dict__``s, hook objects, hook cells,
    and the attributes of plain objects held there (one level down)."""
    out: list[tuple[str, Any, frozenset[str]]] = []
    seen: set[int] = set()

    def add(name: str, mapping: Any, skip: frozenset[str] = frozenset(), nested: bool = True) -> None:
        key = id(mapping.cell) if isinstance(mapping, _Cell) else id(mapping)
        if key in seen:
            return
        seen.add(key)
        out.append((name, mapping, skip))
        if nested:
            for k, v in list(mapping.items()):
                if k not in skip and _plain_object(v):
                    add(f"{name}.{k}", vars(v), nested=False)

    for m in modules:
        mname = type(m).__name__
        add(mname, m.__dict__, _TORCH_OWN)
        for hook in itertools.chain.from_iterable(getattr(m, d, {}).values() for d in _HOOK_DICTS):
            fn = hook.__func__ if isinstance(hook, types.MethodType) else hook
            if isinstance(hook, types.MethodType) and not isinstance(hook.__self__, nn.Module):
                add(f"{mname} hook {type(hook.__self__).__name__}", vars(hook.__self__))
            if isinstance(fn, types.FunctionType):
                for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
                    add(f"{mname} hook {fn.__name__}.{var}", _Cell(cell))
            elif hasattr(fn, "__dict__") and not isinstance(fn, nn.Module):
                add(f"{mname} hook {type(fn).__name__}", vars(fn))
    return out


def _contents(value: Any) -> Any:
    """What an in-place change is detected by: a container's shallow copy, a tensor's version, else None."""
    if isinstance(value, torch.Tensor):
        return value._version  # torch's in-place counter: there is no public accessor
    if isinstance(value, _CONTAINERS):
        return copy.copy(value) if len(value) <= _BIG else len(value)
    return None


def _same_contents(old: Any, value: Any) -> bool:
    if isinstance(value, torch.Tensor) or isinstance(old, int):  # a version, or a big container's length
        return (value._version if isinstance(value, torch.Tensor) else len(value)) == old
    if isinstance(value, (list, collections.deque)):
        return len(old) == len(value) and all(a is b for a, b in zip(old, value))
    if isinstance(value, dict):
        return old.keys() == value.keys() and all(old[k] is value[k] for k in old)
    if isinstance(value, _CONTAINERS):
        return old == value
    return True


def _put_contents(value: Any, old: Any) -> None:
    """Give a container back its old contents in place."""
    if isinstance(value, (list, bytearray)):
        value[:] = old
    elif isinstance(value, collections.deque):
        value.clear()
        value.extend(old)
    elif isinstance(value, (dict, set)):
        value.clear()
        value.update(old)


class ModuleState:
    """The Python state of some modules at one moment (see the module docstring for what counts)."""

    def __init__(self, entries: list[tuple[str, Any, frozenset[str], dict[str, tuple[Any, Any]]]]) -> None:
        self._entries = entries  # (holder name, mapping, keys to skip, {key: (value, contents)})

    @classmethod
    def take(cls, modules: Iterable[nn.Module]) -> ModuleState:
        entries = []
        for name, mapping, skip in _holders(modules):
            entries.append((name, mapping, skip, {k: (v, _contents(v)) for k, v in list(mapping.items())
                                                  if k not in skip}))
        return cls(entries)

    def _changes(self) -> Iterable[tuple[str, Any, str, Any, Any]]:
        """(holder, mapping, key, how, recorded) for each entry that differs now: how is "rebound", "added",
        "contents" or "inplace" (a tensor changed in place)."""
        for name, mapping, skip, keys in self._entries:
            for k, (value, contents) in keys.items():
                now = mapping.get(k, _MISSING)
                if now is not value:
                    yield name, mapping, k, "rebound", (value, contents)
                elif not _same_contents(contents, value):
                    how = "inplace" if isinstance(contents, int) else "contents"  # old contents: gone / kept
                    yield name, mapping, k, how, (value, contents)
            for k, _ in list(mapping.items()):
                if k not in keys and k not in skip:
                    yield name, mapping, k, "added", None

    def changed(self) -> bool:
        """Whether anything differs from the snapshot now."""
        return next(iter(self._changes()), None) is not None

    def changed_names(self) -> list[str]:
        """``Holder.attr`` of every attribute that differs now from the snapshot, sorted."""
        return sorted(f"{name}.{k}" for name, _, k, _, _ in self._changes())

    def inplace(self) -> list[str]:
        """``Holder.attr`` of each attribute changed in place beyond repair since the snapshot: a tensor that is
        not a buffer, or a container longer than ``_BIG``."""
        return [f"{name}.{k}" for name, _, k, how, _ in self._changes() if how == "inplace"]

    def settle(self, to_host: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace each tensor bound to an attribute since the snapshot (a forward's EMA, a hook's computed weight)
        by ``to_host(tensor)``: between units the model holds host tensors only, as a model trained on the CPU
        does, and nothing stays on a device outside its plan. A tensor held anywhere in the snapshot already
        (one attribute assigned another) stays as it is; parameters too."""
        known = {id(v) for *_, keys in self._entries for v, _ in keys.values()}
        for _, mapping, k, how, _ in list(self._changes()):
            if how in ("rebound", "added"):
                now = mapping.get(k, _MISSING)
                if isinstance(now, torch.Tensor) and not isinstance(now, nn.Parameter) and id(now) not in known:
                    mapping[k] = to_host(now)

    def restore(self) -> None:
        """Put back every rebound attribute and container contents; drop attributes added since (a tensor changed
        in place stays as it is: see ``inplace``)."""
        for _, mapping, k, how, recorded in list(self._changes()):
            if how == "added":
                del mapping[k]
            elif how == "rebound":
                value, contents = recorded
                mapping[k] = value
                if not isinstance(contents, int) and not _same_contents(contents, value):
                    _put_contents(value, contents)
            elif how == "contents":
                _put_contents(recorded[0], recorded[1])
