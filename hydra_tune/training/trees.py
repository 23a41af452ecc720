"""Maps over the tensors of a batch or carry: torch's pytree walk, with a short path for the shapes units see most.

    host = map_tensors(lambda t: t.cpu(), (x, y))      # (x.cpu(), y.cpu()): the same container type back
    leaves = tensor_leaves({"input_ids": ids})          # every leaf, in pytree order (tensors and others)

Why: a unit maps its batch or carry several times (copies in, outputs out, the input leaves); torch's ``tree_map``
costs a dozen Python calls even for one tensor, as much as a small layer's forward. A tensor, or a plain tuple or
list of leaves that are tensors, numbers, strings or None, takes the short path; anything else (dicts, named
tuples, nested containers, tensor subclasses) goes through torch's pytree, so the result is always what
``tree_map``/``tree_flatten`` give.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map  # torch's own pytree walk: there is no public one

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
