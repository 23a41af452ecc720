"""torch's seeding functions, called by code hydra_tune runs for a task, seed that task's own random stream.

    with seeding_to(task_rng):          # TaskState.build, the data loading, every unit (a TaskRNG or a Scratch)
        torch.manual_seed(123)          # seeds task_rng: its CPU generator now, its GPU stream from its next unit
    torch.manual_seed(7)                # a thread outside such a block: torch's own function, as always

Why: a task draws from its own generators (dispatch.py), never from torch's process-wide one. A factory that calls
``torch.manual_seed(123)`` reseeds the global generator in the plain loop, and every later draw there (the rest of
the init, dropout, shuffling) continues from 123; under hydra_tune the same call would reseed a generator the task
does not read, and would reseed it under every other thread (and, on GPUs, every device's generator, which holds
some other task's stream while its unit runs). So the functions are replaced once, in torch's namespaces, by
wrappers that look up this thread's innermost ``seeding_to`` target: inside one they seed the target (exactly what
the plain loop's call does to the stream the task reads), outside one they call torch's own function unchanged.

Routed: ``torch.manual_seed``, ``torch.seed``, ``torch.initial_seed``, ``torch.get_rng_state``,
``torch.set_rng_state`` (also as ``torch.random.*``; ``torch.random.fork_rng`` calls these), and
``torch.cuda.manual_seed``/``manual_seed_all``/``seed``/``seed_all`` (also as ``torch.cuda.random.*``). The GPU
stream of a task is one stream (the plain loop trains on one GPU), so the ``_all`` forms seed it and nothing else.

Rules: ``install`` runs once, when hydra_tune is imported, and again is a no-op; ``uninstall`` restores torch's
functions where they are still ours (a wrapper someone installed after us stays, and keeps reaching ours). A forked
child (a DataLoader worker) starts with no target: PyTorch's worker seeding is its own. Not reached: a function
bound before hydra_tune was imported (``from torch import seed`` then ``import hydra_tune``; ``torch.manual_seed``
so bound is reached through ``torch.random._manual_seed_impl``, which ``_split_manual_seed`` gives the torch
releases that lack it), the methods of torch's
generator objects (``torch.default_generator.manual_seed``), ``torch.cuda.get_rng_state``/``set_rng_state``, and
Python's ``random`` and numpy's global seeds.
"""
from __future__ import annotations

import functools
import os
import threading
import types
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.cuda
import torch.random

_local = threading.local()  # .stack: this thread's targets, innermost last
_MARK = "__hydra_tune_seeding__"


class SeedTarget(Protocol):
    """Where a routed seeding call goes: the CPU generator the task's code draws from, and its GPU stream."""

    cpu: torch.Generator

    def seed_accel(self, seed: int) -> None:
        """``torch.cuda.manual_seed_all(seed)`` for this stream."""


class Scratch:
    """A target with a CPU generator only (the scratch streams of submit's checks and profile): a GPU seed is
    dropped, as nothing of it reaches a GPU."""

    def __init__(self, generator: torch.Generator) -> None:
        self.cpu = generator

    def seed_accel(self, seed: int) -> None:
        pass


class OnDevice:
    """The target inside one GPU unit of a task: its CPU generator, and the unit's device generator (which holds
    the task's GPU stream until the unit ends; devices.py saves it back)."""

    def __init__(self, cpu: torch.Generator, device_generator: torch.Generator) -> None:
        self.cpu, self._device = cpu, device_generator

    def seed_accel(self, seed: int) -> None:
        self._device.manual_seed(seed)


def push(target: SeedTarget) -> None:
    """Route this thread's seeding calls to ``target`` until ``pop(target)``."""
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(target)


def pop(target: SeedTarget) -> None:
    """End ``push(target)`` (its latest push, should blocks have ended out of order)."""
    stack = _local.__dict__.get("stack") or []
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is target:
            del stack[i]
            return


class seeding_to:  # noqa: N801  (used as a function: ``with seeding_to(rng):``)
    """Inside the block, this thread's torch seeding calls seed ``target`` (see the module docstring). A class, not
    a generator: units enter several of these each, and a generator's context manager costs a few Python calls
    more."""

    __slots__ = ("target",)

    def __init__(self, target: SeedTarget) -> None:
        self.target = target

    def __enter__(self) -> SeedTarget:
        push(self.target)
        return self.target

    def __exit__(self, *exc: object) -> None:
        pop(self.target)


def current() -> SeedTarget | None:
    """This thread's innermost target, or None (torch's own functions apply)."""
    stack = _local.__dict__.get("stack")
    return stack[-1] if stack else None


def _normalized(seed: Any) -> int:
    # torch's own check and remapping of a seed (negative values, the 64-bit range), and its own error
    return torch.Generator().manual_seed(int(seed)).initial_seed()


# -- what each routed function does to a target --------------------------------------------------------------
def _manual_seed(t: SeedTarget, seed: Any) -> torch.Generator:
    t.cpu.manual_seed(int(seed))
    t.seed_accel(t.cpu.initial_seed())
    return t.cpu


def _seed(t: SeedTarget) -> int:
    seed = t.cpu.seed()
    t.seed_accel(seed)
    return seed


def _cuda_manual_seed(t: SeedTarget, seed: Any) -> None:
    t.seed_accel(_normalized(seed))


def _cuda_seed(t: SeedTarget) -> None:
    t.seed_accel(torch.Generator().seed())  # a non-deterministic seed, as torch.cuda.seed draws one


_ROUTES: dict[str, Callable[..., Any]] = {
    "manual_seed": _manual_seed, "_manual_seed_impl": _manual_seed, "seed": _seed,
    "initial_seed": lambda t: t.cpu.initial_seed(), "get_rng_state": lambda t: t.cpu.get_state(),
    "set_rng_state": lambda t, new_state: t.cpu.set_state(new_state)}
_CUDA_ROUTES: dict[str, Callable[..., Any]] = {
    "manual_seed": _cuda_manual_seed, "manual_seed_all": _cuda_manual_seed, "seed": _cuda_seed,
    "seed_all": _cuda_seed}


def _wrap(original: Callable[..., Any], route: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def routed(*args: Any, **kwargs: Any) -> Any:
        target = current()
        if target is None:
            return original(*args, **kwargs)
        return route(target, *args, **kwargs)

    setattr(routed, _MARK, True)
    return routed


_installed: list[tuple[Any, str, Callable[..., Any], Callable[..., Any]]] = []  # (namespace, name, torch's, ours)


def _namespaces() -> list[tuple[Any, dict[str, Callable[..., Any]]]]:
    import torch.cuda.random as cuda_random

    return [(torch, _ROUTES), (torch.random, _ROUTES), (torch.cuda, _CUDA_ROUTES), (cuda_random, _CUDA_ROUTES)]


def _split(seed: Any) -> Any:
    # the code torch.random.manual_seed runs once split: the name resolves in torch.random, the function's module
    return _manual_seed_impl(seed)  # noqa: F821


def _split_manual_seed() -> None:
    """Where ``torch.random.manual_seed`` seeds by itself (no ``_manual_seed_impl``: torch 2.4 to at least 2.8), give
    it newer torch's split: its body moves to ``torch.random._manual_seed_impl`` (which ``install`` wraps) and the
    function object, kept, runs ``return _manual_seed_impl(seed)``. So a ``manual_seed`` bound before hydra_tune was
    imported reaches the task's stream too, as on newer torch; outside a task it seeds exactly as before."""
    fn = torch.random.manual_seed
    params = getattr(fn, "__code__", _split.__code__).co_varnames[:1]
    if (hasattr(torch.random, "_manual_seed_impl") or not isinstance(fn, types.FunctionType) or fn.__closure__
            or fn.__globals__ is not vars(torch.random) or fn.__code__.co_argcount != 1 or params != ("seed",)):
        return   # newer torch (already split), or a manual_seed this code does not know: left as it is
    impl = types.FunctionType(fn.__code__, fn.__globals__, "_manual_seed_impl", fn.__defaults__)
    impl.__doc__ = fn.__doc__
    torch.random._manual_seed_impl = impl  # type: ignore[attr-defined]
    fn.__code__ = _split.__code__


def install() -> None:
    """Put the routing wrappers in torch's namespaces (once; a name torch lacks is skipped)."""
    if _installed:
        return
    for namespace, routes in _namespaces():
        for name, route in routes.items():
            original = getattr(namespace, name, None)
            if original is None or getattr(original, _MARK, False):
                continue
            ours = _wrap(original, route)
            setattr(namespace, name, ours)
            _installed.append((namespace, name, original, ours))


def uninstall() -> None:
    """Give torch its functions back where ours are still in place."""
    while _installed:
        namespace, name, original, ours = _installed.pop()
        if getattr(namespace, name, None) is ours:
            setattr(namespace, name, original)


def _forget_targets() -> None:
    _local.__dict__.pop("stack", None)


_split_manual_seed()   # before install: it wraps the split-off _manual_seed_impl
install()
os.register_at_fork(after_in_child=_forget_targets)  # a forked DataLoader worker seeds as PyTorch seeds it
