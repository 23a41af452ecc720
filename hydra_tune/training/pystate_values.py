"""The contents of a value of Python state (pystate.py): what an in-place change of it is detected by, and how
the old contents are put back.

    kept = contents_of(value, BIG)              # a container's shallow copy, a tensor's version, a generator's state
    if not same_contents(kept, value): put_contents(value, kept)
    tensors = KeptTensors.of([("loss", loss_fn)]); ...; tensors.restore()   # a user's callables' tensors

Rules: a container longer than ``big`` is kept as its length only (copying it every unit would cost): changed, it
cannot be put back, nor can a tensor changed in place (its version moved); a ``torch.Generator`` is put back with
``set_state``. The tensors of a user's callables (``KeptTensors``), around the rare calls the plain loop never
makes, are copied up to ``COPY_LIMIT`` bytes each and put back.
"""
from __future__ import annotations

import collections
import copy
import itertools
import types
import warnings
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


def shared_key(kept: Any) -> Any:
    """What makes two contents copies interchangeable (the same items, compared as ``same_contents`` compares
    them: lists, deques and dict values by identity, sets and bytes by equality, dict keys by equality and type),
    hashable; None for anything else (not shared). A snapshot kept for long shares equal copies (pystate.py)."""
    kind = type(kept)
    if kind is list or kind is collections.deque:
        return kind, tuple(map(id, kept))
    if kind is dict:
        return kind, tuple((k, type(k), id(v)) for k, v in kept.items())
    if kind is set:
        return kind, frozenset(kept)
    if kind is bytearray:
        return kind, bytes(kept)
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


COPY_LIMIT = 4 << 20  # bytes: a larger tensor of a callable is not copied before such a call, only watched


class KeptTensors:
    """The tensors a user's callables hold (a loss module's buffers and parameters, tensor attributes, tensors in
    closure cells, one object deep) and their gradients, for calls the plain loop never makes (the cost profile's
    loss call, the metric check at submit): ``restore`` puts back what such a call changed (a loss keeping a running
    mean in a buffer, a gradient a backward set). Tensors past ``COPY_LIMIT`` bytes (a distillation loss's
    teacher) are not copied: one changed in place cannot be put back, and ``restore`` warns, naming it.

        kept = KeptTensors.of([("loss", loss_fn)]); loss_fn(out, batch).backward(); kept.restore()
    """

    def __init__(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self._kept = [(name, t, t._version, _copy(t), t.grad, None if t.grad is None else t.grad._version,
                       None if t.grad is None else _copy(t.grad)) for name, t in tensors]

    @classmethod
    def of(cls, named: list[tuple[str, Any]]) -> KeptTensors:
        found: dict[int, tuple[str, torch.Tensor]] = {}
        for label, fn in named:
            owner = fn.__self__ if isinstance(fn, types.MethodType) else fn
            _tensors_in(label, owner, found, depth=2)
            for cell in getattr(getattr(fn, "__func__", fn), "__closure__", None) or ():
                try:
                    _tensors_in(f"{label} closure", cell.cell_contents, found, depth=1)
                except ValueError:  # an empty cell
                    pass
        return cls(list(found.values()))

    def restore(self) -> None:
        lost = []
        with torch.no_grad():
            for name, t, version, values, grad, grad_version, grad_values in self._kept:
                if t._version != version and not _put(t, values):
                    lost.append(name)
                if t.grad is not grad:  # set by a backward (None before), or replaced
                    t.grad = grad
                if grad is not None and grad._version != grad_version and not _put(grad, grad_values):
                    lost.append(f"{name}.grad")
        if lost:
            warnings.warn(f"hydra_tune called the task's loss or metrics once more than the plain loop does (its cost "
                          f"profile, its metric check), and that call changed tensors too large to have been copied "
                          f"first ({COPY_LIMIT >> 20} MiB): {lost}. They keep the change; compute such updates out "
                          "of place, or keep them outside the loss", RuntimeWarning, stacklevel=3)


def _put(t: torch.Tensor, values: torch.Tensor | None) -> bool:
    if values is None:
        return False
    t.copy_(values)
    return True


def _copy(t: torch.Tensor) -> torch.Tensor | None:
    return t.detach().clone() if t.numel() * t.element_size() <= COPY_LIMIT else None


def _tensors_in(label: str, value: Any, found: dict[int, tuple[str, torch.Tensor]], depth: int) -> None:
    """Tensors of ``value``, named from ``label``: itself, a module's parameters and buffers and its modules' tensor
    attributes, an object's tensor attributes (and those of the objects it holds, ``depth`` levels)."""
    if isinstance(value, torch.Tensor):
        found.setdefault(id(value), (label, value))
    elif isinstance(value, torch.nn.Module):
        for name, t in itertools.chain(value.named_parameters(), value.named_buffers()):
            found.setdefault(id(t), (f"{label}.{name}", t))
        for path, m in value.named_modules():
            for k, v in vars(m).items():
                if isinstance(v, torch.Tensor):
                    found.setdefault(id(v), (f"{label}.{path}.{k}" if path else f"{label}.{k}", v))
    elif depth > 0 and hasattr(value, "__dict__") and not isinstance(value, (type, types.ModuleType)):
        for k, v in list(vars(value).items()):
            _tensors_in(f"{label}.{k}", v, found, depth - 1)
