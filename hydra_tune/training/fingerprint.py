"""An exact, hashable key of what a measurement depends on (equal keys, equal results), and a bounded memo.

    keyer = Keyer()
    key = keyer.key([s.module for s in cut.stages], loss_fn, autocast)   # (digest, anchors); raises Unkeyable
    keyer.position(id(param))     # the tensor's place in the walk: the same place in an equal model
    memo = Memo(64); memo.get(key) or memo.put(key, measured)

What goes in: every module's class, its plain attributes (``training``, dropout ``p``, a config object's fields,
hook functions), its parameters and buffers (shape, dtype, strides, device type, requires_grad, and which ones
are the same tensor: tied weights), its submodules, in order; other tensors by shape, dtype and a digest of their
values; functions by their code, defaults and closure contents (so two lambdas from one ``def`` with equal
captures are equal); objects by class and attributes. Hook dictionaries are keyed by registration order, not by
torch's global handle numbers.

A key is compact, since memos keep up to 64 keys each and a walk of a large model is a large nested tuple: the
walk's structure and plain values (tuples, frozensets, ints, floats, strings, bytes) go into a BLAKE2b-256 digest
of their ``marshal`` bytes (an exact encoding of those types: ``-0.0`` is not ``0.0``, ``1`` is not ``True``), every
other leaf (classes by weak reference, dtypes, code objects, C functions, hashable objects) into the key's
``anchors``, each once, compared as the leaf itself would be. Stricter than equality only where a miss is harmless
(two equal frozensets iterated in another order measure again).

Rules: equal keys only when every one of those is equal (up to a digest collision), so two models that differ in
one layer width, one dropout rate, one frozen parameter or one hook get different keys. A value it cannot read
exactly (an object without ``__dict__`` that is neither a known type nor hashable by value, an attribute that
raises when read), a walk past ``LIMIT`` values (a module holding a dataset) or a tensor past ``DIGEST_LIMIT`` bytes
to key by its values raises ``Unkeyable``: the caller then measures anew. Not seen: module-level globals that code
reads at run time, and what a function's ``__globals__`` holds.
"""
from __future__ import annotations

import enum
import functools
import hashlib
import marshal
import threading
import types
import weakref
from collections import OrderedDict
from typing import Any

import torch
import torch.nn as nn

LIMIT = 50_000  # values walked per key; past it the key is given up (a module holding a dataset, a tokenizer)
DIGEST_LIMIT = 16 << 20  # bytes of a tensor keyed by its values; a larger one gives the key up (hashing costs)

_PLAIN = (type(None), bool, int, float, complex, str, bytes)
_PLAIN_TYPES = frozenset(_PLAIN)  # exact types: the fast path (subclasses take the isinstance one)
_CONTAINERS = frozenset((tuple, list, dict, set, frozenset))
# Values that are themselves the key: long-lived objects compared by identity (C functions and descriptors,
# modules, enum members) or by value (torch's dtypes and devices): anchors; classes by weak reference (Keyer._held)
_BY_IDENTITY = (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
                types.MethodWrapperType, types.GetSetDescriptorType, types.MemberDescriptorType,
                types.ClassMethodDescriptorType, types.ModuleType, types.CodeType, torch.dtype, torch.device,
                torch.layout, torch.memory_format, enum.Enum, torch._ops.OpOverload, torch._ops.OpOverloadPacket)
_MODULE_OWN = ("_parameters", "_buffers", "_modules")


@functools.cache
def _torch_own() -> frozenset[str]:
    """torch's bookkeeping attributes of every module and optimizer (empty ones are left out of keys). Made at
    first use: torch's first optimizer imports torch._dynamo (over a second), which ``import hydra_tune`` need
    not pay (a Ray driver, a node's client)."""
    return frozenset(nn.Module().__dict__) | frozenset(
        torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1).__dict__)


_EMPTY_CELL = ("<empty cell>",)


class Unkeyable(Exception):
    """Something in the walk cannot be keyed exactly: measure instead of reusing a profile."""


class Keyer:
    """Walks values into a hashable key; remembers each tensor's first place (``position``) and each object's, so
    shared tensors, modules and objects are keyed by reference (ties and cycles stay visible and finite)."""

    def __init__(self, values: bool = True, limit: int = LIMIT) -> None:
        self.values = values  # key tensors that are no parameter or buffer by their contents too
        self._tensors: dict[int, int] = {}   # id(tensor) -> its place among the tensors walked
        self._objects: dict[int, int] = {}   # id(object) -> its place among the objects walked
        self._alive: list[Any] = []          # what the ids above belong to, so no id is reused during the walk
        self._anchors: dict[Any, int] = {}   # leaves that are no plain value -> their index (module docstring)
        self._left = limit

    def key(self, *values: Any) -> tuple[bytes, tuple[Any, ...]]:
        """The key of ``values``: (digest, anchors); raises Unkeyable (also for anything that fails while it is
        read, a nesting too deep for Python's recursion limit or marshal's included). Keys of one keyer share its
        places and anchors: each holds the anchors of every earlier one too."""
        try:
            out = marshal.dumps(tuple(self.value(v) for v in values), 2)   # version 2: no back-references
            anchors = tuple(self._anchors)
            hash(anchors)
        except Unkeyable:
            raise
        except Exception as exc:  # noqa: BLE001  (an attribute that raises when read, an unhashable leaf)
            raise Unkeyable(f"{type(exc).__name__}: {exc}") from None
        return hashlib.blake2b(out, digest_size=32).digest(), anchors

    def position(self, tensor_id: int) -> int:
        """The place of the tensor with this ``id`` among the tensors walked (KeyError: not walked)."""
        return self._tensors[tensor_id]

    def positions(self) -> dict[int, int]:
        return dict(self._tensors)

    # -- one value ------------------------------------------------------------------------------------------
    def _anchor(self, leaf: Any) -> tuple[str, int]:
        """A leaf that is no plain value, by its index among the anchors (equal leaves share one)."""
        return "@", self._anchors.setdefault(leaf, len(self._anchors))

    def _held(self, cls: type) -> tuple[str, int]:
        """A class: a weak reference (equal while the class lives, so a key keeps no user class, and through its
        methods' closures no model, alive; a dead class's key matches nothing, not a new class at its address)."""
        return self._anchor(weakref.ref(cls))

    def value(self, v: Any) -> Any:
        self._left -= 1
        if self._left < 0:
            raise Unkeyable(f"more than {LIMIT} values to walk")
        kind = type(v)  # checks on the type: isinstance would read __class__ (slow on transformers' configs)
        if kind in _PLAIN_TYPES:
            return v  # (True, 1 and 1.0 are equal in Python; marshal writes each with its type)
        if kind in _CONTAINERS:
            return self._container(v)
        seen = self._objects.get(id(v))
        if seen is not None:
            return "ref", seen
        if issubclass(kind, _PLAIN):
            return self._held(kind), self._anchor(v)
        if issubclass(kind, torch.Tensor):
            return self._tensor(v)
        if issubclass(kind, type):
            return self._held(v)
        if issubclass(kind, _BY_IDENTITY):
            return self._anchor(v)
        if issubclass(kind, (tuple, list, dict, set, frozenset)):
            return self._container(v)
        self._objects[id(v)] = len(self._objects)
        self._alive.append(v)
        return self._object(v)

    def _container(self, v: Any) -> Any:
        if isinstance(v, dict):
            items: Any = tuple((self.value(k), self.value(x)) for k, x in v.items())
        elif isinstance(v, (set, frozenset)):
            items = frozenset(self.value(x) for x in v)
        else:
            items = tuple(self.value(x) for x in v)
        extra = getattr(v, "__dict__", None)  # a subclass's own attributes (a namedtuple has none)
        return self._held(type(v)), items, self._attrs(extra) if extra else None

    def _tensor(self, t: torch.Tensor, values: bool | None = None) -> Any:
        """Layout and place; the values too (``values``; default: a tensor that is no parameter or buffer)."""
        place = self._tensors.get(id(t))
        if place is not None:
            return "same tensor", place
        self._tensors[id(t)] = place = len(self._tensors)
        self._alive.append(t)
        layout = (self._held(type(t)), tuple(t.shape), self._anchor(t.dtype),
                  t.stride() if t.layout == torch.strided else None, t.device.type, t.requires_grad, place)
        if values is None:
            values = self.values and not isinstance(t, nn.Parameter)
        return layout + (self._digest(t),) if values else layout

    @staticmethod
    def _digest(t: torch.Tensor) -> Any:
        """A tensor attribute's or batch value's contents (none for meta tensors, which have no values)."""
        if t.device.type == "meta" or t.layout != torch.strided:
            return None
        if t.numel() * t.element_size() > DIGEST_LIMIT:
            raise Unkeyable(f"a tensor of {t.numel() * t.element_size()} bytes to key by its values")
        data = t.detach()
        if data.device.type != "cpu":
            data = data.cpu()
        data = data.contiguous().view(-1).view(torch.uint8) if data.numel() else data
        return hashlib.blake2b(data.numpy().tobytes() if data.numel() else b"", digest_size=16).digest()

    def _object(self, v: Any) -> Any:
        if isinstance(v, nn.Module):
            return self._module(v)
        if isinstance(v, types.FunctionType):
            return self._function(v)
        if isinstance(v, types.MethodType):
            return "method", self.value(v.__func__), self.value(v.__self__)
        if isinstance(v, functools.partial):
            return "partial", self.value(v.func), self.value(v.args), self.value(v.keywords)
        if isinstance(v, (staticmethod, classmethod)):
            return self._held(type(v)), self.value(v.__func__)
        if isinstance(v, property):
            return self._held(type(v)), self.value(v.fget), self.value(v.fset), self.value(v.fdel)
        attrs = getattr(v, "__dict__", None)
        if attrs is not None:
            return self._held(type(v)), self._attrs(attrs), self._slots(v)
        slots = self._slots(v)
        if slots:
            return self._held(type(v)), slots
        try:
            hash(v)
        except TypeError:
            raise Unkeyable(f"a {type(v).__name__} without attributes") from None
        if type(v).__eq__ is object.__eq__:
            raise Unkeyable(f"a {type(v).__name__} compared by identity")  # would never equal another model's
        return self._held(type(v)), self._anchor(v)

    def _slots(self, v: Any) -> tuple[Any, ...]:
        names = [n for cls in type(v).__mro__ for n in getattr(cls, "__slots__", ()) if n not in ("__dict__",
                                                                                                    "__weakref__")]
        return tuple((n, self.value(getattr(v, n, _EMPTY_CELL))) for n in names)

    def _function(self, f: types.FunctionType) -> Any:
        cells = []
        for cell in f.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # an empty cell (a name assigned later)
                cells.append(_EMPTY_CELL)
        return ("function", f.__module__, self._anchor(f.__code__), self.value(f.__defaults__),
                self.value(f.__kwdefaults__), self.value(cells))

    def _attrs(self, own: dict[str, Any], skip: tuple[str, ...] = ()) -> tuple[Any, ...]:
        """An object's ``__dict__``; hook dictionaries (torch's modules and optimizers keep them by global handle
        number) by registration order, and left out when empty (as torch's other bookkeeping is)."""
        out = []
        order: dict[int, int] | None = None
        for name, value in own.items():
            if name in skip:
                continue
            if isinstance(value, (dict, set)) and not value and name in _torch_own():
                continue
            if "hooks" in name and isinstance(value, dict):
                if order is None:
                    handles = sorted({k for n, d in own.items() if "hooks" in n and isinstance(d, dict) for k in d
                                      if isinstance(k, int)})
                    order = {h: i for i, h in enumerate(handles)}
                value = [(order.get(k, k), x) for k, x in value.items()]
            out.append((name, self.value(value)))
        return tuple(out)

    def _module(self, m: nn.Module) -> Any:
        # parameters and buffers by layout (their values are the model's state, not its architecture)
        state = tuple((name, None if t is None else self._tensor(t, values=False))
                      for name, t in [*m._parameters.items(), *m._buffers.items()])
        children = tuple((name, self.value(x)) for name, x in m._modules.items())
        return self._held(type(m)), self._attrs(m.__dict__, _MODULE_OWN), state, children


class Memo:
    """A thread-safe map from keys to results, the least recently used dropped past ``size`` entries.

        memo = Memo(64); found = memo.get(key)      # None: not there
        memo.put(key, value); memo.hits, memo.misses
    """

    def __init__(self, size: int) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[Any, Any] = OrderedDict()
        self.size = size
        self.hits = self.misses = 0

    def get(self, key: Any) -> Any:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return found

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)
