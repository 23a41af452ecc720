"""Snapshots of one fixed list of modules' Python state, reusing the places of state found by the last one while
nothing that decides them changed (pystate.py's companion: the same holders, values and contents, found faster).

    snaps = Snapshots(modules)            # ShardExec: one for its modules
    before = snaps.take()                 # == ModuleState.take(modules), before each unit
    before.changed()                      # by identity first (Layout.unchanged), in full only when that fails

Why: finding the places of state (pystate ``_holders``: every module's ``__dict__``, the plain objects held there,
hook objects and cells) walks every attribute of every module; for a transformers GPT-2 of 4 layers (60 modules)
that is ~0.4 ms of a ~0.65 ms snapshot, taken before every unit, on the GIL. The places only change when an
attribute is bound, added or removed, a module's or holder's ``__dict__`` is replaced, or a hook is registered or
removed.

Rule (exact: the same snapshot as ``ModuleState.take``): a Layout is reused only while every holder's mapping
has as many keys as then and its attributes are bound to the same objects (compared by identity with the values
the layout holds, so that no address can be reused under it), every owner still has that ``__dict__``, and every
module's hook dicts hold the same hooks; the contents that may change in place (containers, tensor versions) are
taken anew at every take. Assumed, not compared: torch's own attributes of a module (its parameter, buffer,
submodule and hook dicts, ``training``) are not deleted or rebound to other dicts (torch itself relies on that);
so ``model.eval()`` keeps a layout.
"""
from __future__ import annotations

import operator
from itertools import repeat
from typing import Any

import torch
import torch.nn as nn

from .pystate import _HOOK_DICTS, _MISSING, NO_VALUES, ModuleState, _Cell, _holders, _items
from .pystate_values import BIG, CONTAINERS, contents_of

_is = operator.is_
_HOOK_DICTS_OF = operator.attrgetter(*_HOOK_DICTS)  # a module's hook dicts, as a tuple
_HAS_CONTENTS = (torch.Tensor, torch.Generator, *CONTAINERS)  # the values pystate._contents takes anything of


class Layout:
    """The places of state of some modules as found once, with the values bound there then."""

    def __init__(self, modules: list[nn.Module], known: ModuleState | None = None) -> None:
        self._modules = modules  # (the caller's list, not copied)
        # per holder (``known``'s own where it found the same place: the task keeps its as-built snapshot for
        # checkpoints, and a holder's label, the module's path there, is not read from a layout's snapshots): its
        # values then (the same dicts every snapshot of this layout keeps: never changed; one shared empty dict
        # for the holders with none; ``known``'s own dict where it took the same values) and the keys whose values
        # have contents to take anew (containers, tensors; () for none)
        then = known.places() if known is not None else {}
        found = [(h, then.get(id(h.mapping))) for h in _holders((type(m).__name__, m) for m in modules)]
        self._holders = [_same_holder(k[0], h) if k is not None else h for h, k in found]
        self._values = [_same_or(k and k[1], dict(_items(h.mapping, h.skip))) for h, k in found]
        self._content_keys = [tuple(k for k, v in values.items() if isinstance(v, _HAS_CONTENTS))
                              for values in self._values]
        # what ``unchanged`` compares besides the values: each ``__dict__``'s size and owner, the hooks
        self._sizes = [len(h.mapping) if not isinstance(h.mapping, _Cell) else -1 for h in self._holders]
        hooks = [tuple(getattr(m, d, {}).values()) for m in modules for d in _HOOK_DICTS]
        self._hooks = hooks if any(hooks) else None  # (None: there were none, the common case)

    def take(self) -> ModuleState:
        """A snapshot now (the caller checked ``unchanged``)."""
        contents = [({k: c for k in keys if (c := contents_of(values[k], BIG)) is not None} or None) if keys else None
                    for values, keys in zip(self._values, self._content_keys)]
        return ModuleState((self._holders, self._values, contents), layout=self)  # (lists never written)

    def unchanged(self) -> bool:
        """Whether every place of state still holds what this layout found there (see the module docstring)."""
        for holder, values, size in zip(self._holders, self._values, self._sizes):
            mapping = holder.mapping
            if size < 0:  # a closure cell
                if mapping.get(mapping.var, _MISSING) is not values.get(mapping.var, _MISSING):
                    return False
            elif (len(mapping) != size  # (each test below one C call over the dict, no Python step per key)
                  or not all(map(_is, map(mapping.get, values, repeat(_MISSING)), values.values()))
                  or holder.owner is not None and holder.owner.__dict__ is not mapping):
                return False
        if self._hooks is None:  # (C-level calls only: a generator here cost a Python step per module)
            return not any(map(any, map(_HOOK_DICTS_OF, self._modules)))
        now = [getattr(m, d, {}) for m in self._modules for d in _HOOK_DICTS]
        return all(len(d) == len(then) and all(map(_is, d.values(), then)) for d, then in zip(now, self._hooks))


def _same_holder(known: Any, found: Any) -> Any:
    """``known`` (a kept snapshot's holder of the same mapping) when it is ``found`` but for its label, else
    ``found``."""
    same = (known.name == found.name and known.prefix == found.prefix and known.skip == found.skip
            and known.owner is found.owner)
    return known if same else found


def _same_or(then: dict[str, Any] | None, now: dict[str, Any]) -> dict[str, Any]:
    """``then`` when it holds the same keys bound to the same objects as ``now``, else ``now`` (``NO_VALUES`` for
    none)."""
    if then is not None and then.keys() == now.keys() and all(map(_is, map(then.get, now), now.values())):
        return then
    return now or NO_VALUES


# A shard whose places of state changed at two takes in a row (a forward that rebinds an attribute every time)
# takes this many plain snapshots before it tries a layout again: rebuilding one at every take cost a third more
# than a plain snapshot.
RETRY_AFTER = 16


class Snapshots:
    """``ModuleState.take(modules)`` for one fixed list of modules, through a Layout while it holds; ``known``: a
    snapshot kept anyway (the task's as-built one) whose values a layout shares where they are the same."""

    def __init__(self, modules: list[nn.Module], known: ModuleState | None = None) -> None:
        self._modules = modules  # (the caller's list, not copied)
        self._known = known
        self._layout: Layout | None = None
        self._misses = 0  # takes in a row that found the layout out of date
        self._plain = 0   # plain snapshots still to take before a layout is tried again

    def take(self) -> ModuleState:
        if self._plain:
            self._plain -= 1
            return ModuleState.take(self._modules)
        layout = self._layout
        if layout is not None and layout.unchanged():
            self._misses = 0
            return layout.take()
        self._layout = None  # (let the old one go first: its values are not needed to find the new places)
        self._misses += layout is not None
        if self._misses >= 2:
            self._misses, self._plain = 0, RETRY_AFTER - 1
            return ModuleState.take(self._modules)
        layout = self._layout = Layout(self._modules, self._known)
        return layout.take()

    def holds_layout(self) -> bool:
        """Whether a layout is kept now (not while the places keep changing)."""
        return self._layout is not None
