"""Reads of weights whose lazy update is pending: brought up to date first, in the loop's thread; refused elsewhere.

    guard = PendingGuard(access.flush)        # runner.py: one per prepared model
    guard.watch(optimizer)                    # optimizer.state reads are checked too
    guard.stepped_here(); guard.mark(shard, params)   # lazy.py: the loop's thread began step t: these
                                                      # parameters' updates are pending
    kept[0].sum(); optimizer.param_groups[0]["params"][0].data; optimizer.state[p]   # loop's thread: flush first
    guard.unmark([shard])                     # lazy.py: its update is being applied: plain parameters again

Why: a spilled prepared model applies each shard's update of step t just before the shard's next use (the lazy
per-shard step). Between ``optimizer.step()`` and that use the user's loop may read or write the weights through
references it holds: a parameter list kept from before ``prepare``, ``optimizer.param_groups``, a submodule
(``model.fc.weight``), ``optimizer.state``. ``model.parameters()`` can apply the updates first; those cannot be
intercepted as calls of ours. So while its update is pending a parameter's class is ``PendingParameter`` (an
``nn.Parameter`` subclass: ``isinstance`` checks hold) whose ``__torch_function__`` (every torch call and tensor
attribute, ``.data`` and ``.grad`` included, reaches it) applies every pending update before the read, and the
optimizer's ``state`` mapping does the same for reads of it; the class goes back to ``nn.Parameter`` when the
update is applied. A read of shape, dtype, device and the like changes nothing and passes.

Rules: the runtime's own reads pass: those inside ``direct()`` (our code in the loop's thread) and those of the
runtime's threads (named ``hydra-...``: workers, copy threads, task host threads). The loop's thread (the one that
called ``optimizer.step()``) applies the pending updates and reads the current values, bit-identical to the plain
loop. Any other thread's read while an update is pending raises (its values would be the old ones, and applying
the update from there would race the loop): read in the loop's thread, or after the next forward. Only parameters
whose class is exactly ``nn.Parameter`` are marked (``markable``); lazy.py applies other tasks' steps at once.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn

from ..errors import rule_error
from .optimizer import is_direct

_OWNERS: dict[int, PendingGuard] = {}  # id(parameter) -> the guard of the model whose update of it is pending
_ACCESSORS = ("__get__", "__set__", "__delete__")
# reads that an update leaves unchanged: no need to apply it first
_UNCHANGED = frozenset({"shape", "dtype", "device", "requires_grad", "is_leaf", "ndim", "layout", "is_cuda",
                        "is_cpu", "is_meta", "is_sparse", "is_quantized", "names", "size", "dim", "numel",
                        "nelement", "element_size", "is_floating_point", "is_complex", "__hash__"})


def _what(func: Any) -> str:
    name = getattr(func, "__name__", "?")
    if name in _ACCESSORS:  # a tensor attribute: the descriptor's name ("data", "grad")
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _guards(args: Iterable[Any]) -> Iterator[PendingGuard]:
    for a in args:
        if type(a) is PendingParameter:
            guard = _OWNERS.get(id(a))
            if guard is not None:
                yield guard
        elif isinstance(a, (list, tuple)):
            yield from _guards(a)


class PendingParameter(nn.Parameter):
    """A parameter whose update is pending (see the module docstring); never constructed, only assigned."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not is_direct():
            what = _what(func)
            if what not in _UNCHANGED:
                for guard in set(_guards((*args, *kwargs.values()))):
                    guard.read(what)
        with torch._C.DisableTorchFunctionSubclass():  # as nn.Parameter's own (disabled) __torch_function__
            return func(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> nn.Parameter:
        if id(self) not in memo:  # a plain Parameter, as the copy of an up-to-date one is
            memo[id(self)] = nn.Parameter(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        return memo[id(self)]


def _runtime_thread() -> bool:
    return threading.current_thread().name.startswith("hydra-")


class PendingGuard:
    """One prepared model's pending parameters and what a read of them does (see the module docstring)."""

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush
        # shard -> its parameters marked (an attribute WatchedState reads at every lookup of the optimizer's state:
        # the optimizer's own step makes one per parameter)
        self.by_shard: dict[int, list[nn.Parameter]] = {}
        self._loop: int | None = None  # the thread that called optimizer.step()
        self.reads = 0  # reads that applied the pending updates early

    @staticmethod
    def markable(params: Iterable[torch.Tensor]) -> bool:
        return all(type(p) is nn.Parameter or type(p) is PendingParameter for p in params)

    def stepped_here(self) -> None:
        """This thread (the loop's) began the step whose updates are marked next: its reads apply them."""
        self._loop = threading.get_ident()

    def mark(self, shard: int, params: list[nn.Parameter]) -> None:
        """Shard ``shard``'s update of these parameters is pending."""
        for p in params:
            _OWNERS[id(p)] = self
            p.__class__ = PendingParameter
        self.by_shard[shard] = params

    def marked(self) -> list[int]:
        return list(self.by_shard)

    def unmark(self, shards: Iterable[int]) -> dict[int, list[nn.Parameter]]:
        """These shards' parameters are plain again (their updates are being applied); returns them by shard."""
        taken = {}
        for shard in shards:
            params = self.by_shard.pop(shard, None)
            if params is None:
                continue
            for p in params:
                _OWNERS.pop(id(p), None)
                p.__class__ = nn.Parameter
            taken[shard] = params
        return taken

    def pending(self) -> bool:
        return bool(self.by_shard)

    def read(self, what: str) -> None:
        """A read of a pending parameter (or of the optimizer's state) outside the runtime's own code."""
        if not self.by_shard:
            return
        if threading.get_ident() != self._loop:
            if _runtime_thread():
                return
            raise rule_error("a prepared model's weights are read in the thread that steps its optimizer while "
                             "their update is pending (read from another thread)", "read them in your training "
                             "loop's thread, or after its next forward", kind=RuntimeError, call=what,
                             thread=threading.current_thread().name)
        self.reads += 1
        self._flush()
        if self.by_shard:  # the task ended before its update could be applied (it failed): the values are stale
            self.unmark(self.marked())
            raise rule_error("a prepared model's pending update is applied before its weights are read", "the "
                             "model's task ended (see its error); prepare the model again", kind=RuntimeError,
                             call=what)

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Check reads of ``optimizer.state`` too (again after ``load_state_dict``, which replaces it)."""
        if not isinstance(optimizer.state, WatchedState):
            optimizer.state = WatchedState(self, optimizer.state)


class WatchedState(defaultdict):
    """``optimizer.state``: reads from the user's side apply the pending updates first (PendingGuard.read)."""

    def __init__(self, guard: PendingGuard, state: dict) -> None:
        super().__init__(dict, state)
        self._guard = guard

    def _check(self) -> None:
        if self._guard.by_shard and not is_direct():
            self._guard.read("optimizer.state")

    # the lookups an optimizer's step makes per parameter check inline (nothing pending: no call at all)
    def __getitem__(self, key: Any) -> Any:
        if self._guard.by_shard:
            self._check()
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        if self._guard.by_shard:
            self._check()
        return super().get(key, default)

    def __contains__(self, key: Any) -> bool:
        if self._guard.by_shard:
            self._check()
        return super().__contains__(key)

    def __iter__(self) -> Iterator[Any]:
        self._check()
        return super().__iter__()

    def __len__(self) -> int:
        self._check()
        return super().__len__()

    def keys(self) -> Any:
        self._check()
        return super().keys()

    def values(self) -> Any:
        self._check()
        return super().values()

    def items(self) -> Any:
        self._check()
        return super().items()

    def __reduce__(self) -> Any:
        # pickled (torch.save(optimizer), copy.deepcopy) as the plain defaultdict torch's optimizers keep
        self._check()
        return defaultdict, (dict,), None, None, iter(dict.items(self))
