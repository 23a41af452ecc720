"""The per-thread dispatch mode under which hydra_tune runs a task's code: own RNG stream, optional accounting.

    account = MemoryAccount()                                   # device/account.py
    with UnitMode(cpu_generator=torch.Generator().manual_seed(0), account=account):
        y = torch.nn.functional.dropout(torch.ones(4), 0.5)     # drew from the task's generator; bytes counted

Why a dispatch mode: CPU random ops draw from one process-wide generator, shared by every worker thread, so
concurrent tasks would steal each other's random numbers. Dispatch modes are thread-local: inside one, every CPU
random op of this thread draws from the task's own generator (the same algorithm and state layout as the global
one, so masks equal plain training seeded with ``torch.manual_seed(seed)``). With an account, every new storage
an op creates is counted until it is freed: the CPU devices' measured memory.

Inside either mode, ``torch.manual_seed`` and torch's other seeding functions called by this thread seed the mode's
generator (device/seeding.py), as the plain loop's call seeds the generator its later draws come from.

Rule: a process forked inside these modes (a DataLoader worker started while the task's data loads) leaves them at
once (``os.register_at_fork``): it is no unit of the task, and PyTorch seeds a worker's own generators (torch,
``random``, numpy) from the loader's base seed, which the task's stream drew, as in the plain loop.
"""
from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import dropout, sdpa, seeding
from .account import MemoryAccount
from .draws import IN_BACKWARD, UNSEEN, OutermostCall, draws, is_seeded, recomputed_in_backward, routed

_GLOBAL_RNG_LOCK = threading.Lock()
_generator_arg: dict[Any, bool] = {}


def _uses_generator(func: Any) -> bool:
    known = _generator_arg.get(func)
    if known is None:
        # an OpOverload's schema (torch has no public accessor): does the op take a `generator` argument?
        known = _generator_arg[func] = any(a.name == "generator" for a in func._schema.arguments)
    return known


_self_fills: dict[Any, bool] = {}
_allocating: dict[Any, bool] = {}


def _may_allocate(func: Any) -> bool:
    """Whether an op's output may be a new storage: not when every output aliases an input by its schema (a
    view, an in-place or an ``out=`` result), which is most ops of a training step."""
    known = _allocating.get(func)
    if known is None:
        rets = func._schema.returns
        known = _allocating[func] = not all(r.alias_info is not None for r in rets)
    return known


def _fills_self(func: Any) -> bool:
    """An in-place op on its first argument that returns it (``normal_``, ``uniform_``, ``bernoulli_``)."""
    known = _self_fills.get(func)
    if known is None:
        args, rets = func._schema.arguments, func._schema.returns
        first = args[0].alias_info if args else None
        known = _self_fills[func] = bool(first is not None and first.is_write and len(rets) == 1
                                         and rets[0].alias_info is not None)
    return known


def _op_device(args: tuple, kwargs: dict) -> torch.device:
    dev = kwargs.get("device")
    if dev is not None:
        return torch.device(dev)
    if args and isinstance(args[0], torch.Tensor):  # the common case, without a walk of every argument
        return args[0].device
    for leaf in tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")


class _SeedsGenerator:
    """Inside the mode, this thread's ``torch.manual_seed`` & co. seed the mode's generator, not torch's global one
    (device/seeding.py). Where the generator is a task's, the task's code also runs in ``seeding_to(task_rng)``,
    which reaches its GPU stream too."""

    _seeds: seeding.Scratch

    def __enter__(self):  # type: ignore[no-untyped-def]
        seeding.push(self._seeds)
        try:
            return super().__enter__()  # type: ignore[misc]
        except BaseException:
            seeding.pop(self._seeds)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)  # type: ignore[misc]
        finally:
            seeding.pop(self._seeds)


class UnitMode(_SeedsGenerator, TorchDispatchMode):
    """Route this thread's CPU random ops to ``cpu_generator``; count new storages in ``account`` if given."""

    def __init__(self, cpu_generator: torch.Generator, account: MemoryAccount | None = None) -> None:
        super().__init__()
        self.generator = cpu_generator
        self.account = account
        self.paused = False
        self.seeded: set[str] = set()  # base names of the random aten ops run under this mode
        self.draws = 0  # CPU random aten ops run under this mode (which stages draw: device/quiet.py)
        self._seeds = seeding.Scratch(cpu_generator)
        self._graph = torch._C._current_graph_task_id()  # the backward this mode began in (-1: none)
        self.outermost: OutermostCall | None = None  # a measured unit's: what the light router would see of a draw

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        where = _op_device(args, kwargs).type if is_seeded(func) and draws(func, args, kwargs) else None
        if where == "cpu":
            self.seeded.add(func._schema.name.split("::")[-1])
            if torch._C._current_graph_task_id() != self._graph or recomputed_in_backward():
                # drawn in a backward run within the unit, or in a block autograd will recompute there
                # (torch.utils.checkpoint with dropout): the light router's function mode does not reach the
                # recompute's draws, so the task keeps this mode
                self.seeded.add(IN_BACKWARD)
            if self.outermost is not None and not self.outermost.routed:
                self.seeded.add(UNSEEN)  # inside a call the router runs as it is (or outside any)
            self.draws += 1
            out = self._seeded(func, args, dict(kwargs))
        elif where == "meta" and _fills_self(func):
            out = args[0]  # a meta tensor has no values to draw (a model's init on the meta device: no work)
        else:
            out = func(*args, **kwargs)
        if self.account is not None and not self.paused and _may_allocate(func):
            if isinstance(out, torch.Tensor):
                self._count(out, args)
            elif isinstance(out, (tuple, list)):
                for t in out:
                    if isinstance(t, torch.Tensor):
                        self._count(t, args)
        return out

    def _seeded(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if _uses_generator(func):
            if kwargs.get("generator") is None:
                kwargs["generator"] = self.generator
            return func(*args, **kwargs)
        # An op without a generator argument draws from the global generator: lend it our state, briefly.
        with _GLOBAL_RNG_LOCK:
            if not _LENT:  # quiet units (quiet.py) stop for good: their guard cannot see into a lent window
                _LENT.append(True)
            saved = torch.default_generator.get_state()
            torch.default_generator.set_state(self.generator.get_state())
            try:
                return func(*args, **kwargs)
            finally:
                self.generator.set_state(torch.default_generator.get_state())
                torch.default_generator.set_state(saved)

    def _count(self, t: torch.Tensor, args: tuple) -> None:
        """Track ``t``'s storage unless it is one we know or an input's (a view, or an in-place result); a sparse
        tensor's by its parts (indices and values: it has no storage of its own)."""
        if t.device.type not in self.account.types:  # type: ignore[union-attr]
            return
        if t.layout is not torch.strided:
            for part in sparse_parts(t):
                self._count(part, args)
            return
        key = t.untyped_storage()._cdata
        account = self.account
        if key in account._live:  # type: ignore[union-attr]
            return
        for a in args:
            if isinstance(a, torch.Tensor) and a.layout is torch.strided and a.untyped_storage()._cdata == key:
                return
        account.track(t.untyped_storage())  # type: ignore[union-attr]


def sparse_parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The strided tensors a sparse tensor keeps its data in (its indices and values); () for other layouts."""
    if t.layout is torch.sparse_coo:
        return t._indices(), t._values()  # (no public form that works on an uncoalesced tensor)
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return t.crow_indices(), t.col_indices(), t.values()
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return t.ccol_indices(), t.row_indices(), t.values()
    return ()


_LENT: list[bool] = []  # non-empty once any task lent the global generator its state (``UnitMode._seeded``)


def lent_global() -> bool:
    """Whether a task ever lent torch's global CPU generator its own state in this process."""
    return bool(_LENT)


def global_rng_state() -> bytes | None:
    """torch's global CPU generator state as bytes (quiet.py's guard: compared with no tensor call), or None once
    any task lent it its state. No lock: a task lends only after marking ``_LENT`` (``UnitMode._seeded``)."""
    if _LENT:
        return None
    state = torch.default_generator.get_state().numpy().tobytes()
    return None if _LENT else state


def unmoved(before: bytes | None) -> bool:
    """Whether torch's global CPU generator is known not to have moved since ``before = global_rng_state()`` (a
    state lent to a task on either side reads None: not known unmoved)."""
    after = global_rng_state()
    return before is not None and after is not None and after == before


def draw_global_seed() -> int:
    """A seed in [0, 2**62) drawn from torch's global generator, under the lock a UnitMode holds while it lends that
    generator a task's state (``_seeded``): a draw outside the lock could take numbers from the lent state, moving
    that task's stream and giving this caller the task's numbers.

        seed = draw_global_seed()
    """
    with _GLOBAL_RNG_LOCK:
        return int(torch.randint(0, 2**62, (), generator=torch.default_generator).item())


class paused_accounting:
    """Within a UnitMode with an account: allocations here are host memory, not the device's."""

    def __init__(self, mode: UnitMode | None) -> None:
        self.mode = mode
        self._was = False

    def __enter__(self) -> None:
        if self.mode is not None:
            self._was, self.mode.paused = self.mode.paused, True

    def __exit__(self, *exc: object) -> None:
        if self.mode is not None:
            self.mode.paused = self._was


class RandomRouter(_SeedsGenerator, TorchFunctionMode):
    """A light stand-in for UnitMode on units whose memory need not be counted: only calls to functions that
    may draw random numbers on the CPU are intercepted (a handful per layer, not every aten op: ``routed``, by
    name or, for ``DRAWS_WHEN``'s composite functions, by the arguments that make them draw), and those run
    under UnitMode (F.dropout's common case: its four tensor calls here, device/dropout.py); on accelerator
    tensors (dropout on CUDA) they run as they are: they draw from the device's generator, which holds the task's
    stream for the unit. Used for a task only after a UnitMode-measured segment of it saw nothing but ``ROUTED``
    random aten ops, each inside a call it routes (``UnitMode.seeded`` without ``UNSEEN``): every draw of its
    units comes from a call it runs under UnitMode (CUDA: always)."""

    def __init__(self, cpu_generator: torch.Generator) -> None:
        super().__init__()
        self.generator = cpu_generator
        self._seeds = seeding.Scratch(cpu_generator)
        self._spare: UnitMode | None = None  # the UnitMode of its last random call, for the next one

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func is dropout.DROPOUT and (out := dropout.routed_dropout(args, kwargs, self.generator)) is not None:
            return out  # nn.Dropout's call, its four ops made here with the task's generator
        if func is sdpa.SDPA and (out := sdpa.routed_sdpa(args, kwargs, self.generator)) is not None:
            return out  # attention with dropout: torch's math path's calls made here with the task's generator
        if not routed(func, args, kwargs) or _op_device(args, kwargs).type != "cpu":
            # not random, or on an accelerator: a GPU's draws come from its own generator, which the device sets
            # to the task's stream for the unit (CudaDevice.unit_scope), so its ops need no interception
            return func(*args, **kwargs)
        # Its aten ops go through UnitMode: those with a generator argument (dropout's bernoulli_) get the task's
        # generator without any lock, so concurrent devices do not serialise on attention or dropout. One made
        # for a call serves the next ones (a call made while it is entered makes its own).
        unit, self._spare = self._spare or UnitMode(self.generator), None
        try:
            with unit:
                return func(*args, **kwargs)
        finally:
            self._spare = unit


def router_for(rng: Any) -> RandomRouter:
    """The RandomRouter of a TaskRNG's CPU generator, made once and reused by the task's units and routed stages
    (a task runs one unit at a time): making one, with the UnitMode its random calls use, for every unit or routed
    stage cost about as much as routing a dropout.

        with router_for(rng), seeding_to(rng): ...
    """
    if rng.router is None:
        rng.router = RandomRouter(rng.cpu)
    return rng.router


def bookkeeping(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a method of an object with a ``plain_tensors`` attribute: while that is true, the method runs
    outside this thread's torch-function modes (a unit's RandomRouter).

        @bookkeeping
        def load(self, device): ...        # detach, requires_grad_, .grad: no Python call each through the router

    For the runtime's own work inside a unit (copies in, gradients out): it draws no random numbers, and each of
    its tensor calls would otherwise go through the router's Python hook (about 40 per unit of a small model,
    costing about as much as its forward). Only for plain tensors and Parameters (``plain_tensors``): a tensor
    subclass's own ``__torch_function__`` would be skipped too."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.plain_tensors:
            return method(self, *args, **kwargs)
        with torch._C.DisableTorchFunction():  # no public form: torch's guard that turns the hooks off
            return method(self, *args, **kwargs)
    return run


def plain_call(fn: Callable[..., Any], t: Any, *args: Any) -> Any:
    """``fn(t, *args)`` (a copy of the runtime's) outside this thread's torch-function modes when ``t`` is a plain
    tensor (see ``bookkeeping``); a tensor subclass keeps its own ``__torch_function__``."""
    if type(t) is not torch.Tensor:
        return fn(t, *args)
    with torch._C.DisableTorchFunction():
        return fn(t, *args)


def _leave_task_modes() -> None:
    """In a forked child: drop the UnitModes and RandomRouters the forking thread was in (their dispatch stacks are
    thread-local state, copied by fork); any other mode stays, in its order."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

    stack = _get_current_dispatch_mode_stack()
    if any(isinstance(m, UnitMode) for m in stack):
        for _ in stack:
            _pop_mode()
        for mode in stack:
            if not isinstance(mode, UnitMode):
                _push_mode(mode)
    functions = [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
    if any(isinstance(m, RandomRouter) for m in functions):
        for _ in functions:
            torch._C._pop_torch_function_stack()
        for mode in functions:
            if not isinstance(mode, RandomRouter):
                torch._C._push_on_torch_function_stack(mode)


os.register_at_fork(after_in_child=_leave_task_modes)
