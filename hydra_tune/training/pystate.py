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

Rules: an attribute rebound (``self.calls += 1``, ``self.temp = ...``, a new attribute), the contents of a
list, dict, set or deque attribute and the state of a ``torch.Generator`` attribute (a module drawing with its own
generator: ``torch.rand(..., generator=self.gen)``) are put back exactly (in place: references stay valid);
a tensor attribute that is not a buffer and was changed in place (``self.t.add_(1)``), or a container longer
than 10,000 items changed in place (compared by length only: copying it every unit would cost), cannot be put
back: ``inplace()`` names it and the caller refuses to go on. State the snapshot does not see (objects nested
deeper, elements inside containers, module-level globals) is the user's to keep out of ``forward``.

For checkpoints (checkpoint.py) the state of a whole model is taken by module path (``ModuleState.of_model``,
every container copied whatever its length; ``of_objects`` for samplers and optimizers): ``changes()`` lists what
differs since, addressed so that ``put`` finds the same place in another build of the model (the module's path,
then the plain object or hook holding the attribute: hooks by their position in their dict), and
``hooks_changed()`` tells where hooks were registered or removed since. A dataset a sampler holds is not its state
(nor any torch Dataset held by a module).
"""
from __future__ import annotations

import copy
import functools
import itertools
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.utils.data import Dataset

from .names import shared_name
from .pystate_values import BIG, CONTAINERS, KeptTensors, contents_of, put_contents, same_contents, shared_key

_TORCH_OWN = frozenset(nn.Module().__dict__)  # torch's bookkeeping of every module, and ``training``
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_MISSING = object()
NO_VALUES: dict = {}  # places with no values share it (kept snapshots, layouts; never written: values are read only)
_SCALARS = (int, float, bool, str, type(None))  # values with no contents to compare and no attributes of state
_NOT_STATE = (nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType, types.MethodType,
              types.BuiltinFunctionType, functools.partial, Dataset)


class _Cell:
    """A closure cell seen as a one-entry dict keyed by its variable's name, so that cells and ``__dict__``s are
    read and written alike."""

    def __init__(self, cell: Any, var: str) -> None:
        self.cell, self.var = cell, var

    def items(self) -> Iterable[tuple[str, Any]]:
        try:
            return [(self.var, self.cell.cell_contents)]
        except ValueError:  # an empty cell
            return []

    def get(self, key: str, default: Any) -> Any:
        return dict(self.items()).get(key, default)

    def __setitem__(self, key: str, value: Any) -> None:
        self.cell.cell_contents = value

    def __delitem__(self, key: str) -> None:
        del self.cell.cell_contents


@functools.cache
def _optimizer_own() -> frozenset[str]:
    """torch's own attributes of an optimizer (its state and param_groups travel in its state_dict)."""
    return frozenset(vars(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)))


def _own_keys(obj: Any) -> frozenset[str]:
    """The attributes of ``obj`` that are torch's bookkeeping, not state a user's code keeps."""
    if isinstance(obj, nn.Module):
        return _TORCH_OWN
    return _optimizer_own() if isinstance(obj, torch.optim.Optimizer) else frozenset()


class _Holder:
    """One place of state: ``name`` for messages (``Type`` or ``Type hook fn``), where it is in the model
    (``module``: its label, ``prefix``: the attribute path to the holder inside it, "" for the module itself), the
    mapping and the keys to skip; ``owner``: the object whose ``__dict__`` ``mapping`` is (None: a closure cell).
    Read only once made (slots, not a tuple: a task keeps one per module for its life, ~24 bytes less each)."""

    __slots__ = ("name", "module", "prefix", "mapping", "skip", "owner")

    def __init__(self, name: str, module: str, prefix: str, mapping: Any, skip: frozenset[str],
                 owner: Any = None) -> None:
        self.name, self.module, self.prefix, self.mapping, self.skip, self.owner = (name, module, prefix, mapping,
                                                                                   skip, owner)


def _plain_object(value: Any) -> bool:
    """A user object whose attributes are state too (a schedule object a forward steps), not torch's or code."""
    return (hasattr(value, "__dict__") and not isinstance(value, _NOT_STATE)
            and not type(value).__module__.startswith("torch"))


def _holders(named: Iterable[tuple[str, Any]], opaque: frozenset[int] = frozenset()) -> list[_Holder]:
    """Every place of state of the ``(label, module or other object)`` pairs: their ``__dict__``s, hook objects,
    hook cells, and the attributes of plain objects held there (one level down; not those whose id is in
    ``opaque``)."""
    out: list[_Holder] = []
    seen: set[int] = set()

    def add(name: str, module: str, prefix: str, mapping: Any, skip: frozenset[str] = frozenset(),
            nested: bool = True, owner: Any = None) -> None:
        key = id(mapping.cell) if isinstance(mapping, _Cell) else id(mapping)
        if key in seen:
            return
        seen.add(key)
        out.append(_Holder(name, module, prefix, mapping, skip, owner))
        if nested:
            for k, v in _items(mapping, skip):
                if type(v) not in _SCALARS and _plain_object(v) and id(v) not in opaque:
                    add(f"{name}.{k}", module, f"{prefix}{k}.", vars(v), nested=False, owner=v)

    for label, m in named:
        mname = type(m).__name__
        add(mname, label, "", m.__dict__, _own_keys(m), owner=m)
        for dict_name in _HOOK_DICTS:
            for i, hook in enumerate(getattr(m, dict_name, {}).values()):
                at = f"{dict_name}[{i}]."
                fn = hook.__func__ if isinstance(hook, types.MethodType) else hook
                if isinstance(hook, types.MethodType) and not isinstance(hook.__self__, nn.Module):
                    add(f"{mname} hook {type(hook.__self__).__name__}", label, at, vars(hook.__self__),
                        owner=hook.__self__)
                if isinstance(fn, types.FunctionType):
                    for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
                        add(f"{mname} hook {fn.__name__}", label, at, _Cell(cell, var))
                elif hasattr(fn, "__dict__") and not isinstance(fn, nn.Module):
                    add(f"{mname} hook {type(fn).__name__}", label, at, vars(fn), owner=fn)
    del add  # a recursive closure is a cycle holding ``out`` (the modules' dicts) until Python's collector runs
    return out


def _items(mapping: Any, skip: frozenset[str]) -> list[tuple[str, Any]]:
    """``mapping``'s items whose keys are not in ``skip``, in its order (a dict: filtered without a Python call per
    key, a module's ``__dict__`` being mostly torch's own keys)."""
    if isinstance(mapping, dict):
        if not skip:
            return list(mapping.items())
        return [(k, mapping[k]) for k in itertools.filterfalse(skip.__contains__, list(mapping))]
    return [(k, v) for k, v in list(mapping.items()) if k not in skip]


class _Diff(NamedTuple):
    holder: _Holder
    key: str
    how: str          # "rebound", "added", "contents" (a container changed in place) or "inplace" (see _changes)
    recorded: Any     # (value, contents) as taken, None for "added"


@dataclass(frozen=True)
class Change:
    """One attribute that differs from a model's state as taken (``ModuleState.changes``): where (``module``: the
    module's path, ``holder``: the attribute path inside it, e.g. "" or "schedule." or "_forward_pre_hooks[0]."),
    ``key``, ``how`` ("rebound", "added", "contents", "inplace" or "deleted") and its ``value`` now (None when
    deleted)."""

    module: str
    holder: str
    key: str
    how: str
    value: Any

    @property
    def attribute(self) -> str:
        return f"{self.holder}{self.key}"


class ModuleState:
    """The Python state of some modules at one moment (see the module docstring for what counts)."""

    def __init__(self, entries: tuple[list[_Holder], list[dict[str, Any]], list[dict[str, Any] | None]],
                 hooks: dict[tuple[str, str], int] | None = None, layout: Any = None,
                 tensors: KeptTensors | None = None) -> None:
        # three lists, not a tuple per place: holders, their {key: value}, and {key: contents} for the values
        # that have any, else None. A task keeps its model's as-built state for its whole life (checkpoint.py),
        # so no per-key tuple is spent on scalars; a Layout's snapshots reuse its own holder and value lists.
        self._holders, self._values, self._contents = entries
        self._hooks = hooks  # of_model: (path, hook dict) -> hooks there then, where any; else None
        self._layout = layout  # pystate_layout.Layout: the places of state as taken, for a quick ``changed``
        self._tensors = tensors  # of_callables: their tensors' values, put back by ``restore`` too

    @classmethod
    def take(cls, modules: Iterable[nn.Module]) -> ModuleState:
        return cls(_entries(_holders((type(m).__name__, m) for m in modules), BIG))

    @classmethod
    def of_model(cls, model: nn.Module) -> ModuleState:
        """The state of every module of ``model``, labelled by its path (``named_modules``; "(root)" for the model
        itself), containers copied whatever their length: what ``changes`` compares a checkpoint's model with."""
        named = [(shared_name(path) if path else "(root)", m) for path, m in model.named_modules()]
        # (the pairs are not kept: each module's own holder has its label and the module, ``hooks_changed``)
        return cls(_entries(_holders(named), float("inf"), kept=True), hooks=_hook_counts(named))

    @classmethod
    def of_objects(cls, named: list[tuple[str, Any]], opaque: Iterable[Any] = ()) -> ModuleState:
        """The state of other objects with attributes (a DataLoader's samplers, an optimizer: its attributes
        beyond torch's own), labelled as ``named`` gives them, containers copied whatever their length; objects
        they hold that are in ``opaque`` (a sampler's dataset) are not looked into."""
        return cls(_entries(_holders(named, frozenset(id(o) for o in opaque)), float("inf"), kept=True))

    @classmethod
    def of_callables(cls, named: list[tuple[str, Any]]) -> ModuleState:
        """The state of the user's callables hydra_tune calls more often than the plain loop (a task's loss in the
        cost profile, its metrics at submit), labelled as ``named`` gives them: a function's closure cells and
        attributes, a bound method's object, a callable object's attributes (a loss that counts its calls or
        keeps a history), every module of a loss module, and their tensors' values (a running mean in a buffer);
        ``restore()`` puts it back."""
        objects: list[tuple[str, Any]] = []
        cells: list[_Holder] = []
        for label, fn in named:
            code = fn.__func__ if isinstance(fn, types.MethodType) else fn
            owner = fn.__self__ if isinstance(fn, types.MethodType) else fn
            if isinstance(owner, nn.Module):
                objects += [(f"{label}.{path}" if path else label, m) for path, m in owner.named_modules()]
            elif hasattr(owner, "__dict__"):
                objects.append((label, owner))
            if isinstance(code, types.FunctionType):
                cells += [_Holder(f"{label} closure", label, "", _Cell(cell, var), frozenset())
                          for var, cell in zip(code.__code__.co_freevars, code.__closure__ or ())]
        return cls(_entries(_holders(objects) + cells, BIG), tensors=KeptTensors.of(named))

    def _changes(self) -> Iterable[_Diff]:
        """Each entry that differs now: "rebound", "added", "contents" (old contents kept) or "inplace" (a tensor
        changed in place, or a big container: the old contents are gone)."""
        for holder, keys, kept in zip(self._holders, self._values, self._contents):
            mapping = holder.mapping
            for k, value in keys.items():
                now = mapping.get(k, _MISSING)
                contents = None if kept is None else kept.get(k)  # None: nothing to compare
                if now is not value:
                    yield _Diff(holder, k, "rebound", (value, contents))
                elif contents is not None and not same_contents(contents, value):
                    how = "inplace" if isinstance(contents, int) else "contents"  # old contents: gone / kept
                    yield _Diff(holder, k, how, (value, contents))
            if isinstance(mapping, dict):  # the common case, by set operations: a module has ~20 torch keys
                added = mapping.keys() - keys.keys() - holder.skip
                for k in [k for k in mapping if k in added] if added else ():
                    yield _Diff(holder, k, "added", None)
                continue
            for k, _ in list(mapping.items()):
                if k not in keys and k not in holder.skip:
                    yield _Diff(holder, k, "added", None)

    def places(self) -> dict[int, tuple[_Holder, dict[str, Any]]]:
        """Each place's holder and values as taken, by the identity of its mapping (a ``__dict__``; closure cells
        left out): a Layout reuses those still the same (pystate_layout.py), the as-built snapshot being kept
        anyway."""
        return {id(h.mapping): (h, values) for h, values in zip(self._holders, self._values)
                if not isinstance(h.mapping, _Cell)}

    def entries(self) -> list[tuple[_Holder, dict[str, Any], dict[str, Any] | None]]:
        """(holder, values, contents or None) of each place, as taken."""
        return list(zip(self._holders, self._values, self._contents))

    def changed(self) -> bool:
        """Whether anything differs from the snapshot now (taken through a Layout: first by identity, which finds
        nothing changed without a Python step per attribute; anything it cannot rule out is looked at in full)."""
        if self._layout is not None and self._layout.unchanged() and self._contents_unchanged():
            return False
        return next(iter(self._changes()), None) is not None

    def _contents_unchanged(self) -> bool:
        return all(same_contents(c, values[k]) for values, kept in zip(self._values, self._contents) if kept
                   for k, c in kept.items())

    def changed_names(self) -> list[str]:
        """``Holder.attr`` of every attribute that differs now from the snapshot, sorted."""
        return sorted(f"{d.holder.name}.{d.key}" for d in self._changes())

    def inplace(self) -> list[str]:
        """``Holder.attr`` of each attribute changed in place beyond repair since the snapshot: a tensor that is
        not a buffer, or a container longer than ``BIG``."""
        return [f"{d.holder.name}.{d.key}" for d in self._changes() if d.how == "inplace"]

    def changes(self, frozen: bool = False) -> list[Change]:
        """Every attribute that differs now from the snapshot, with its value now (``frozen``: a deep copy, so
        that later changes do not reach it; the value itself when it cannot be copied)."""
        out = []
        for d in self._changes():
            now = d.holder.mapping.get(d.key, _MISSING)
            how, value = ("deleted", None) if now is _MISSING else (d.how, now)
            if frozen and how != "deleted":
                try:
                    value = copy.deepcopy(value)
                except Exception:  # noqa: BLE001  (not copyable: then not storable either, which the caller says)
                    pass
            out.append(Change(d.holder.module, d.holder.prefix, d.key, how, value))
        return out

    def hooks_changed(self) -> list[tuple[str, str, int, int]]:
        """(module, hook dict, hooks then, hooks now) wherever hooks were registered or removed since ``of_model``
        (only a snapshot ``of_model`` took counts them: [] for any other)."""
        then = self._hooks
        if then is None:
            return []
        modules = [(h.module, h.owner) for h in self._holders if not h.prefix and isinstance(h.owner, nn.Module)]
        now = {(label, d): len(getattr(m, d, {})) for label, m in modules for d in _HOOK_DICTS}  # zeros too
        return [(m, d, then.get((m, d), 0), n) for (m, d), n in now.items() if n != then.get((m, d), 0)]

    def put(self, change: Change) -> bool:
        """Make ``change`` here (this state's modules are another build of the model it was taken from): a
        container or tensor changed in place is given its contents in place (references to it stay valid), any
        other value is bound. False: no such place here."""
        holder = next((h for h in self._holders if (h.module, h.prefix) == (change.module, change.holder)
                       and change.key not in h.skip
                       and (not isinstance(h.mapping, _Cell) or h.mapping.var == change.key)),
                      None)
        if holder is None:
            return False
        mapping, now = holder.mapping, holder.mapping.get(change.key, _MISSING)
        if change.how == "deleted":
            if now is not _MISSING:
                del mapping[change.key]
        elif change.how in ("contents", "inplace") and isinstance(now, CONTAINERS) and type(now) is type(
                change.value):
            put_contents(now, change.value)
        elif change.how == "contents" and isinstance(now, torch.Generator) and isinstance(change.value,
                                                                                       torch.Generator):
            now.set_state(change.value.get_state())
        elif (change.how == "inplace" and isinstance(now, torch.Tensor) and isinstance(change.value, torch.Tensor)
              and now.shape == change.value.shape and now.dtype == change.value.dtype):
            with torch.no_grad():
                now.copy_(change.value)
        else:
            mapping[change.key] = change.value
        return True

    def settle(self, to_host: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace each tensor bound to an attribute since the snapshot (a forward's EMA, a hook's computed weight)
        by ``to_host(tensor)``: between units the model holds host tensors only, as a model trained on the CPU
        does, and nothing stays on a device outside its plan. A tensor held anywhere in the snapshot already
        (one attribute assigned another) stays as it is; parameters too."""
        known = {id(v) for keys in self._values for v in keys.values()}
        for d in list(self._changes()):
            if d.how in ("rebound", "added"):
                now = d.holder.mapping.get(d.key, _MISSING)
                if isinstance(now, torch.Tensor) and not isinstance(now, nn.Parameter) and id(now) not in known:
                    d.holder.mapping[d.key] = to_host(now)

    def restore(self) -> None:
        """Put back every rebound attribute and container contents; drop attributes added since (a tensor changed
        in place stays as it is: see ``inplace``)."""
        for d in list(self._changes()):
            if d.how == "added":
                del d.holder.mapping[d.key]
            elif d.how == "rebound":
                value, contents = d.recorded
                d.holder.mapping[d.key] = value
                if not isinstance(contents, int) and not same_contents(contents, value):
                    put_contents(value, contents)
            elif d.how == "contents":
                put_contents(d.recorded[0], d.recorded[1])
        if self._tensors is not None:
            self._tensors.restore()


def _entries(holders: list[_Holder], big: float,
             kept: bool = False) -> tuple[list[_Holder], list[dict[str, Any]], list[dict[str, Any] | None]]:
    """Each holder with its values now and the contents of those that have any (``ModuleState``'s entries).
    ``kept``: a snapshot kept for long (a task's as-built one): a holder with no values shares one empty dict, and
    equal contents share one copy (a PEFT LoRA layer's ``{"default": r}`` dicts, a dozen layers alike)."""
    all_values: list[dict[str, Any]] = []
    kept_contents: list[dict[str, Any] | None] = []
    same: dict[Any, Any] | None = {} if kept else None
    for holder in holders:
        values = dict(_items(holder.mapping, holder.skip))
        contents = {k: c for k, v in values.items()
                    if type(v) not in _SCALARS and (c := contents_of(v, big)) is not None}
        if same is not None:
            values = values or NO_VALUES
            for k, c in contents.items():
                key = shared_key(c)
                if key is not None:
                    contents[k] = same.setdefault(key, c)
        all_values.append(values)
        kept_contents.append(contents or None)
    return holders, all_values, kept_contents


def _hook_counts(named: Iterable[tuple[str, Any]]) -> dict[tuple[str, str], int]:
    """(module label, hook dict) -> the number of hooks registered there, where there are any (a label given twice
    counts as its last object)."""
    return {k: n for k, n in {(label, d): len(getattr(m, d, {})) for label, m in named for d in _HOOK_DICTS}.items()
            if n}
