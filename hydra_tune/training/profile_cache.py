"""Measured stage costs kept per architecture, process-wide: a trial whose model, batch shapes, loss and precision
equal an earlier one's is planned from that one's profile instead of being measured again.

    found = PROFILES.find(cut, batch, loss_fn, autocast)    # a Lookup
    if found.costs is not None: costs = found.costs         # an equal architecture's, for these values
    elif found.needs_check: check(batch); costs = found.checked()   # its costs, once this batch ran without error
    else: costs = found.store(measure(...))
    PROFILES.info()                                         # {"hits", "checked", "misses", "unkeyable", "entries"}

The key (fingerprint.py) holds the stages' modules (classes, plain attributes such as dropout rates, parameter
and buffer layouts, ties, hooks), how the family prepares a batch, the batch's structure with every tensor's
shape, dtype and layout (and the values of the batch keys the stages read, such as an attention mask), the loss
function (its code and what it captures) and the autocast dtype, plus torch's default dtype and global module
hooks. Costs are stored with parameters by their place in the key's walk and handed out with the new model's.

Rules: a profile is reused as it is under an equal key when every integer or boolean tensor of the new batch lies
within the value range of a batch it was measured or checked on (token ids, class labels, masks). Under an equal
key with a batch whose values lie elsewhere (trials over their own data or their own shuffle: each first batch's
token ids stick out a little), the costs still hold, since they depend on shapes alone, but the batch is checked
first (``Lookup.needs_check``: profile.py runs every stage's forward and the loss on it, without autograd), so that
a batch that makes the model or the loss raise (an id past the vocabulary) still raises at submit; the check costs
about a fifth of a profile. The ranges of two batches whose every such tensor's ranges overlap count as one range;
disjoint ones stay apart. Float values are not compared: a float batch that makes the model or loss raise surfaces
at its first unit when an equal architecture was profiled before. At most ``MAX_ENTRIES`` architectures are kept
(least recently used goes first); the cache holds no model, tensor or function, only their keys, and classes in
them by weak reference (an entry whose class is gone matches nothing again).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils._pytree import tree_flatten  # torch's own pytree walk: there is no public one

from ..policy.partition import StageCost
from ..stages import ModelStages
from .fingerprint import Keyer, Unkeyable

MAX_ENTRIES = 64     # architectures kept
MAX_PER_KEY = 4      # value ranges kept per architecture

Ranges = tuple[tuple[int, int] | None, ...]  # per batch leaf: (min, max) of an integer or boolean tensor


@dataclass
class Lookup:
    """One ``find``: the costs when an equal architecture was measured on batches whose values cover this one's;
    else, when one was measured on other values, ``needs_check`` (then ``checked()`` once this batch ran without
    error); else ``store(costs)`` keeps the costs measured now."""

    costs: list[StageCost] | None
    _cache: "ProfileCache | None" = None
    _key: Any = None
    _ranges: Ranges = ()
    _places: dict[int, int] | None = None
    _known: list[StageCost] | None = None  # the equal architecture's costs, by place

    @property
    def needs_check(self) -> bool:
        """Whether an equal architecture's costs wait for this batch's check (the module docstring's rules)."""
        return self._known is not None

    def checked(self) -> list[StageCost]:
        """The equal architecture's costs with this model's parameters, once the check of this batch ran without
        error; its value ranges join the key's."""
        if self._cache is None or self._known is None or self._places is None:
            raise RuntimeError("Lookup.checked() is for a lookup that needs_check")
        self._cache.put(self._key, self._ranges, self._known)
        return _with_params(self._known, self._places)

    def store(self, costs: list[StageCost]) -> list[StageCost]:
        places = self._places
        if self._cache is not None and places is not None and all(k in places for c in costs for k, _, _ in c.params):
            by_place = [replace(c, params=tuple((places[k], n, g) for k, n, g in c.params)) for c in costs]
            self._cache.put(self._key, self._ranges, by_place)
        return costs


class ProfileCache:
    """Thread-safe, bounded map: architecture key -> [(value ranges, costs by place)]."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[Any, list[tuple[Ranges, list[StageCost]]]] = OrderedDict()
        self.max_entries = max_entries
        self.hits = self.checks = self.misses = self.unkeyable = 0

    def find(self, cut: ModelStages, batch: Any, loss_fn: Any, autocast: torch.dtype | None) -> Lookup:
        try:
            keyer = Keyer()
            key = (*model_key(keyer, cut, loss_fn, autocast), _batch_key(cut, batch))
            places = keyer.positions()
            ranges = _ranges(batch)
        except Unkeyable:
            with self._lock:
                self.unkeyable += 1
            return Lookup(None)
        with self._lock:
            kept = self._entries.get(key, ())
            for seen, costs in kept:
                if _within(ranges, seen):
                    self._entries.move_to_end(key)
                    self.hits += 1
                    return Lookup(_with_params(costs, places))
            if kept:
                self.checks += 1  # (counted at the lookup: a check that raises fails the submit anyway)
                return Lookup(None, self, key, ranges, places, kept[0][1])
            self.misses += 1
        return Lookup(None, self, key, ranges, places)

    def put(self, key: Any, ranges: Ranges, costs: list[StageCost]) -> None:
        with self._lock:
            kept = self._entries.setdefault(key, [])
            for i, (seen, _) in enumerate(kept):  # overlapping ranges: one validated range (trials' own data)
                merged = _union(ranges, seen)
                if merged is not None:
                    del kept[i]
                    ranges = merged
                    break
            kept.insert(0, (ranges, costs))
            del kept[MAX_PER_KEY:]
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.checks = self.misses = self.unkeyable = 0

    def info(self) -> dict[str, int]:
        """Lookups that reused a profile (``hits``), reused one after checking the batch (``checked``), measured
        (``misses``) or could not be keyed (``unkeyable``); architectures kept (``entries``)."""
        with self._lock:
            return {"hits": self.hits, "checked": self.checks, "misses": self.misses,
                    "unkeyable": self.unkeyable, "entries": len(self._entries)}


def _with_params(costs: list[StageCost], places: dict[int, int]) -> list[StageCost]:
    """Costs stored by parameter place, with the parameters (ids) of the model whose places ``places`` gives."""
    ids = {place: k for k, place in places.items()}
    return [replace(c, params=tuple((ids[p], n, g) for p, n, g in c.params)) for c in costs]


def model_key(keyer: Keyer, cut: ModelStages, loss_fn: Any, autocast: Any, *more: Any) -> tuple[Any, Any]:
    """What a forward and loss over ``cut`` depend on, keyed by ``keyer`` (fingerprint.py): the process's globals
    (``_globals``), and the cut's stages, ``loss_fn``, ``autocast`` and ``more``; raises Unkeyable."""
    return _globals(keyer), keyer.key(cut.family, cut.prepare, cut.value_keys, loss_fn, autocast, *more,
                                      [(s.name, s.module) for s in cut.stages])


def _globals(keyer: Keyer) -> Any:
    """Process state every forward reads: the default dtype and torch's global module hooks."""
    from torch.nn.modules import module as torch_module

    hooks = [getattr(torch_module, name) for name in sorted(vars(torch_module))
             if name.startswith("_global_") and isinstance(getattr(torch_module, name), dict)]
    return keyer.key(torch.get_default_dtype(), [list(h.values()) for h in hooks])


def _batch_key(cut: ModelStages, batch: Any) -> Any:
    """The batch by structure and tensor layouts; the values of ``cut.value_keys`` too."""
    shapes = Keyer(values=False)
    if isinstance(batch, dict) and cut.value_keys:
        read = {k: v for k, v in batch.items() if k in cut.value_keys}
        return shapes.key({k: v for k, v in batch.items() if k not in read}), Keyer().key(read)
    return shapes.key(batch), None


def _ranges(batch: Any) -> Ranges:
    """Per leaf of the batch: an integer or boolean tensor's (min, max), else None."""
    out: list[tuple[int, int] | None] = []
    for leaf in tree_flatten(batch)[0]:
        if (isinstance(leaf, torch.Tensor) and leaf.numel() and leaf.device.type != "meta"
                and not leaf.is_floating_point() and not leaf.is_complex()):
            try:
                lo, hi = torch.aminmax(leaf.detach().to(torch.int64) if leaf.dtype == torch.bool else leaf.detach())
            except RuntimeError as exc:  # a dtype aminmax does not take: measure this batch
                raise Unkeyable(str(exc)) from None
            out.append((int(lo), int(hi)))
        else:
            out.append(None)
    return tuple(out)


def _union(a: Ranges, b: Ranges) -> Ranges | None:
    """Both batches' ranges as one, when every leaf's two ranges overlap or touch (each value in the union was
    within a profiled batch's range); None when some leaf's do not (nothing between them was profiled)."""
    if len(a) != len(b) or any((x is None) != (y is None) for x, y in zip(a, b)):
        return None
    out: list[tuple[int, int] | None] = []
    for x, y in zip(a, b):
        if x is not None and y is not None:
            if x[0] > y[1] + 1 or y[0] > x[1] + 1:
                return None
            out.append((min(x[0], y[0]), max(x[1], y[1])))
        else:
            out.append(None)
    return tuple(out)


def _within(new: Ranges, seen: Ranges) -> bool:
    return len(new) == len(seen) and all(
        a is None or (b is not None and b[0] <= a[0] and a[1] <= b[1]) for a, b in zip(new, seen))


PROFILES = ProfileCache()
