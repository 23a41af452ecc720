"""Measured stage costs kept per architecture, process-wide: a trial whose model, batch shapes, loss and precision
equal an earlier one's is planned from that one's profile instead of being measured again.

    found = PROFILES.find(cut, batch, loss_fn, autocast)    # a Lookup
    costs = found.costs if found.costs is not None else found.store(measure(...))
    PROFILES.info()                                         # {"hits", "misses", "unkeyable", "entries"}

The key (fingerprint.py) holds the stages' modules (classes, plain attributes such as dropout rates, parameter
and buffer layouts, ties, hooks), how the family prepares a batch, the batch's structure with every tensor's
shape, dtype and layout (and the values of the batch keys the stages read, such as an attention mask), the loss
function (its code and what it captures) and the autocast dtype, plus torch's default dtype and global module
hooks. Costs are stored with parameters by their place in the key's walk and handed out with the new model's.

Rules: a profile is reused only under an equal key and when every integer or boolean tensor of the new batch lies
within the value range of the batch it was measured on (token ids, class labels, masks): a batch that would make
the model or the loss raise (an id past the vocabulary) is measured, so its error still comes at submit. The
ranges of two profiled batches whose every such tensor's ranges overlap count as one range (trials over their own
data: each would stick out a little and be measured again); disjoint ones stay apart. Float
values are not compared: a float batch that makes the model or loss raise surfaces at its first unit when an equal
architecture was profiled before. At most ``MAX_ENTRIES`` architectures are kept (least recently used goes first);
the cache holds no model, tensor or function, only their keys, and classes in them by weak reference (an entry
whose class is gone matches nothing again).
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
    """One ``find``: the costs when an equal architecture was measured, else ``store(costs)`` keeps them."""

    costs: list[StageCost] | None
    _cache: "ProfileCache | None" = None
    _key: Any = None
    _ranges: Ranges = ()
    _places: dict[int, int] | None = None

    def store(self, costs: list[StageCost]) -> list[StageCost]:
        places = self._places
        if self._cache is not None and places is not None and all(k in places for c in costs for k, _, _ in c.params):
            by_place = [replace(c, params=tuple((self._places[k], n, g) for k, n, g in c.params)) for c in costs]
            self._cache.put(self._key, self._ranges, by_place)
        return costs


class ProfileCache:
    """Thread-safe, bounded map: architecture key -> [(value ranges, costs by place)]."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[Any, list[tuple[Ranges, list[StageCost]]]] = OrderedDict()
        self.max_entries = max_entries
        self.hits = self.misses = self.unkeyable = 0

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
            for seen, costs in self._entries.get(key, ()):
                if _within(ranges, seen):
                    self._entries.move_to_end(key)
                    self.hits += 1
                    ids = {place: k for k, place in places.items()}
                    return Lookup([replace(c, params=tuple((ids[p], n, g) for p, n, g in c.params)) for c in costs])
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
            self.hits = self.misses = self.unkeyable = 0

    def info(self) -> dict[str, int]:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "unkeyable": self.unkeyable,
                    "entries": len(self._entries)}


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
