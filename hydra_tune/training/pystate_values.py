"""The contents of a value of Python state (pystate.py): what an in-place change of it is detected by, and how
the old contents are put back.

    kept = contents_of(value, BIG)              # a container's shallow copy, a tensor's version, a generator's state
    if not same_contents(kept, value): put_contents(value, kept)

Rules: a container longer than ``big`` is kept as its length only (copying it every unit would cost): changed, it
cannot be put back, nor can a tensor changed in place (its version moved); a ``torch.Generator`` is put back with
``set_state``.
"""
from __future__ import annotations

import collections
import copy
from typing import Any, NamedTuple

import torch

CONTAINERS = (list, dict, set, collections.deque, bytearray)
BIG = 10_000  # a container longer than this is compared by its length only (copying it every unit costs)


class GeneratorState(NamedTuple):
    """A ``torch.Generator`` attribute's contents: its state (put back with ``set_state``)."""

    state: torch.Tensor


def contents_of(value: Any, big: float) -> Any:
    """What an in-place change is detected by: a container's shallow copy (its length, past ``big`` items), a
    tensor's version, a generator's state, else None."""
    if isinstance(value, torch.Generator):
        return GeneratorState(value.get_state())
    if isinstance(value, torch.Tensor):
        return value._version  # torch's in-place counter: there is no public accessor
    if isinstance(value, CONTAINERS):
        return copy.copy(value) if len(value) <= big else len(value)
    return None


def same_contents(old: Any, value: Any) -> bool:
    if isinstance(old, GeneratorState):
        return torch.equal(old.state, value.get_state())
    if isinstance(value, torch.Tensor) or isinstance(old, int):  # a version, or a big container's length
        return (value._version if isinstance(value, torch.Tensor) else len(value)) == old
    if isinstance(value, (list, collections.deque)):
        return len(old) == len(value) and all(a is b for a, b in zip(old, value))
    if isinstance(value, dict):
        return old.keys() == value.keys() and all(old[k] is value[k] for k in old)
    if isinstance(value, CONTAINERS):
        return old == value
    return True


def put_contents(value: Any, old: Any) -> None:
    """Give a container (or a generator) back its old contents in place."""
    if isinstance(value, torch.Generator):
        value.set_state(old.state)
    elif isinstance(value, (list, bytearray)):
        value[:] = old
    elif isinstance(value, collections.deque):
        value.clear()
        value.extend(old)
    elif isinstance(value, (dict, set)):
        value.clear()
        value.update(old)
