"""Python's ``random`` and numpy's global generator around the code hydra_tune runs more often than the plain loop.

    with replayed(task): model = task.model()      # every build of a task's model draws what its first one drew
    with kept(): costs = profile(model)            # hydra_tune's own runs of the model leave the streams as they were
    start = states(); ...; replay(start)           # a recomputed forward draws what its forward drew
    point = retry_point(rng); ...; back_to(rng, point)   # a retried segment draws what its failed one drew

Why: torch's draws come from the task's own stream (device/dispatch.py), the same for every build and replayed for a
recompute. Python's and numpy's global generators are one per process: a factory drawing from them (an
architecture choice, an init) drew again at the real build after the meta build for admission, so the trained
model was not the plain loop's (its one call draws once), and the cost profile and a recomputing backward drew
numbers the plain loop never draws (a stochastic-depth branch taken by ``random.random() < p`` flipped between a
forward and its recompute: other gradients). Hydra_tune cannot give each task its own stream of these (they are
one per process, shared by every thread), so several tasks drawing from them at once interleave as threads of a
plain script do; what it keeps is that none of its own extra runs moves them.

Rules: the first build runs from the streams as they are and leaves them as one call of the factory does; a later
build of the same task (another thread, a re-plan) runs from where the first started and puts back what it found.
A node server's builds after the first run from the client's streams as they stood at submit (``start_from``):
the first (the meta build for admission) runs from the server's own, so that a factory that draws nothing costs
no write; the client's own streams do not move (its process never runs the factory).
numpy is read only when the process imported it. Reading both costs tens of microseconds, so a shard's recomputed
forwards are watched at its first ``shard_state.HOST_CHECKS`` (2) only: one that drew nothing there is not
snapshotted later (a forward that starts drawing only after its first steps is not replayed); a segment that may be
retried (a device out-of-memory) is marked only for a task whose cost profile saw a stage draw
(``TaskRNG.host_draws``), as is a step boundary a checkpoint may take (its resume sets them back).

The generators are one per process, so hydra_tune writes them only where the code it ran drew (a factory that drew
at its first build, a profile or check that drew, a recompute of a forward that drew; a node server's builds from
a client's streams): other threads read them too. ``writes()`` counts those writes: the check that a task's data
draws nothing from them (data.py) does not conclude across one.
"""
from __future__ import annotations

import contextlib
import random
import sys
import weakref
from collections.abc import Iterator
from typing import Any

_STARTS: dict[int, dict[str, Any]] = {}  # id(task) -> its first build's start (by identity: a task may define ==)
_NO_DRAWS: dict[str, Any] = {}  # a task whose first build drew nothing: later builds leave the generators alone


class _Client(dict):
    """A client's streams at submit (a node server's task), not yet known to be needed (``start_from``)."""
_writes = [0]  # restore() calls so far


def writes() -> int:
    """How many times hydra_tune has set the generators (see the module docstring)."""
    return _writes[0]


def states() -> dict[str, Any]:
    """Python's and (when imported) numpy's global generator states, comparable with ``==``."""
    out: dict[str, Any] = {"random": random.getstate()}
    np = sys.modules.get("numpy")  # never imported here
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        out["numpy.random"] = (kind, keys.tobytes(), pos, has_gauss, cached)
    return out


def restore(saved: dict[str, Any]) -> None:
    """Put the generators back to ``saved`` (from ``states()``)."""
    _writes[0] += 1
    random.setstate(saved["random"])
    np = sys.modules.get("numpy")
    if np is not None and "numpy.random" in saved:
        kind, keys, pos, has_gauss, cached = saved["numpy.random"]
        np.random.set_state((kind, np.frombuffer(keys, dtype=np.uint32), pos, has_gauss, cached))


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Whatever runs inside leaves the generators as they were (set back only when it drew)."""
    saved = states()
    try:
        yield
    finally:
        if states() != saved:
            restore(saved)


def mark(rng: Any) -> dict[str, Any] | None:
    """Where a segment that may be retried (a device out-of-memory, an unrouted draw) starts, for a task whose code
    draws from the generators (``TaskRNG.host_draws``); None for the others (no read: tens of microseconds)."""
    return states() if rng.host_draws else None


def rewind(saved: dict[str, Any] | None) -> None:
    """A retried segment draws what its failed attempt drew (``saved`` from ``mark``)."""
    if saved is not None:
        restore(saved)


def retry_point(rng: Any) -> tuple[Any, dict[str, Any] | None]:
    """Where a segment that may be retried starts: the task's torch streams (``TaskRNG.snapshot``) and ``mark``."""
    return rng.snapshot(), mark(rng)


def back_to(rng: Any, point: tuple[Any, dict[str, Any] | None]) -> None:
    """Start a retried segment over from ``point`` (``retry_point``): both kinds of generator."""
    rng.restore(point[0])
    rewind(point[1])


def start_from(task: Any, saved: dict[str, Any]) -> None:
    """``task``'s builds draw from ``saved`` (a client's ``states()`` at submit: a node server builds the task in
    another process, whose generators are not the client's), and put back what they found; its first build, if
    that draws nothing, makes its later ones leave the generators alone."""
    _remember(task, _Client(saved))


def _remember(task: Any, start: dict[str, Any]) -> None:
    if id(task) not in _STARTS:
        weakref.finalize(task, _STARTS.pop, id(task), None)  # forgotten with the task
    _STARTS[id(task)] = start


@contextlib.contextmanager
def replayed(task: Any) -> Iterator[None]:
    """A build of ``task``'s model: its first draws from the generators as they are (as the plain loop's one
    call); a later one from where the first started, and puts back what it found."""
    start = _STARTS.get(id(task))
    if start is None or isinstance(start, _Client):
        before = states()
        yield
        drew = states() != before
        _remember(task, (dict(start) if start is not None else before) if drew else _NO_DRAWS)
        return
    with replay(None if start is _NO_DRAWS else start):
        yield


@contextlib.contextmanager
def replay(start: dict[str, Any] | None) -> Iterator[None]:
    """A recompute from the generators' ``start`` (what its forward started from; None: it drew nothing), then
    back to what they are now."""
    if start is None:
        yield
        return
    now = states()
    restore(start)
    try:
        yield
    finally:
        restore(now)
