"""Maps over the tensors of a batch or carry: torch's pytree walk, with a short path for the shapes units see most.

    host = map_tensors(lambda t: t.cpu(), (x, y))      # (x.cpu(), y.cpu()): the same container type back
    leaves = tensor_leaves({"input_ids": ids})          # every leaf, in pytree order (tensors and others)

Why: a unit maps its batch or carry several times (copies in, outputs out, the input leaves); torch's ``tree_map``
costs a dozen Python calls even for one tensor, as much as a small layer's forward. A tensor, or a plain tuple or
list of leaves that are tensors, numbers, strings or None, takes the short path; anything else (dicts, named
tuples, nested containers, tensor subclasses) goes through torch's pytree, so the result is always what
``tree_map``/``tree_flatten`` give.

A dataclass holding tensors (a custom model output, ``Out(logits=..., aux=...)``) is a leaf to torch's pytree: its
tensors would not be moved, detached or joined to the user's graph. ``open_dataclasses(tree)`` registers the
dataclass types among a tree's leaves with torch's pytree (their init fields, as torch's ``register_dataclass``),
once per type and process; the cost profile calls it on every stage's batch and output, before any unit runs.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree  # torch's own pytree walk: there is no public one
from torch.utils._pytree import tree_flatten, tree_map

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_SCALARS = (int, float, bool, str, type(None))


def _flat(tree: Any) -> bool:
    """A plain tuple or list whose items are all leaves of the short path."""
    if type(tree) not in (tuple, list):
        return False
    for t in tree:  # (loops, not generators: they run once or twice per unit, each call counts)
        if type(t) not in _PLAIN_TENSORS and type(t) not in _SCALARS:
            return False
    return True


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree_map(lambda t: fn(t) if isinstance(t, torch.Tensor) else t, tree)``."""
    if type(tree) in _PLAIN_TENSORS:
        return fn(tree)
    if _flat(tree):
        out = []
        for t in tree:
            out.append(fn(t) if type(t) in _PLAIN_TENSORS else t)
        return out if type(tree) is list else tuple(out)
    return tree_map(lambda t: fn(t) if isinstance(t, torch.Tensor) else t, tree)


def tensor_leaves(tree: Any) -> list[Any]:
    """``tree_flatten(tree)[0]``: every leaf of ``tree`` in order."""
    if type(tree) in _PLAIN_TENSORS:
        return [tree]
    if _flat(tree):
        return list(tree)
    return tree_flatten(tree)[0]


_OPENED: set[type] = set()  # dataclass types this process registered with torch's pytree (or found registered)


def open_dataclasses(tree: Any) -> None:
    """Register the dataclass types among ``tree``'s leaves with torch's pytree (repeated until none is left: a
    dataclass may hold another); types torch cannot rebuild from their fields stay leaves."""
    while True:
        new = {type(leaf) for leaf in tree_flatten(tree)[0]
               if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type) and type(leaf) not in _OPENED}
        if not new:
            return
        for cls in new:
            _OPENED.add(cls)
            try:
                pytree.register_dataclass(cls)
            except (ValueError, TypeError):  # registered already (by the user), or fields it cannot take
                pass
