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
import itertools
import types
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


class KeptTensors:
    """The tensors a user's callables hold (a loss module's buffers and parameters, tensor attributes, tensors in
    closure cells, one object deep), with copies of their values and gradients, for calls the plain loop never
    makes (the cost profile's loss call, the metric check at submit): ``restore`` puts back what such a call changed
    in place (a loss keeping a running mean in a buffer).

        kept = KeptTensors.of([("loss", loss_fn)]); loss_fn(out, batch).backward(); kept.restore()
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._kept = [(t, t._version, t.detach().clone(), t.grad, None if t.grad is None else t.grad.detach().clone())
                      for t in tensors]

    @classmethod
    def of(cls, named: list[tuple[str, Any]]) -> KeptTensors:
        found: dict[int, torch.Tensor] = {}
        for _, fn in named:
            owner = fn.__self__ if isinstance(fn, types.MethodType) else fn
            _tensors_in(owner, found, depth=2)
            for cell in getattr(getattr(fn, "__func__", fn), "__closure__", None) or ():
                try:
                    _tensors_in(cell.cell_contents, found, depth=1)
                except ValueError:  # an empty cell
                    pass
        return cls(list(found.values()))

    def restore(self) -> None:
        with torch.no_grad():
            for t, version, values, grad, grad_values in self._kept:
                if t._version != version:
                    t.copy_(values)
                if t.grad is not grad or (grad is not None and not torch.equal(grad, grad_values)):
                    t.grad = grad_values


def _tensors_in(value: Any, found: dict[int, torch.Tensor], depth: int) -> None:
    """Tensors of ``value``: itself, a module's parameters and buffers and its modules' tensor attributes, an
    object's tensor attributes (and those of the objects it holds, ``depth`` levels)."""
    if isinstance(value, torch.Tensor):
        found.setdefault(id(value), value)
    elif isinstance(value, torch.nn.Module):
        for t in itertools.chain(value.parameters(), value.buffers()):
            found.setdefault(id(t), t)
        for m in value.modules():
            for v in vars(m).values():
                if isinstance(v, torch.Tensor):
                    found.setdefault(id(v), v)
    elif depth > 0 and hasattr(value, "__dict__") and not isinstance(value, (type, types.ModuleType)):
        for v in list(vars(value).values()):
            _tensors_in(v, found, depth - 1)
