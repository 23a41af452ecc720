"""Which tasks a CPU device measures as one: segments of equal tasks are counted op by op once between them.

    state.measure_as = measure_as(task, cut, plan, autocast)   # TaskState.build: a class key, or the task's name
    device.measure(measure_key(state, segment.key, device), task)   # runtime/worker.py, training/light_run.py

Why: a CPU stand-in counts a segment's allocations op by op the first time it sees the segment's key (the task and
its batch shapes), and learns then which stages draw random numbers (device/quiet.py); every later segment of the
key runs uncounted. A counted segment of a small model costs several times a light one, and a search of many small
trials of one architecture counted the same few segments again for every trial (the README's Performance section
has the figures). Tasks whose units allocate and draw alike now share what was measured, and a runtime's CPU devices
share it too (device/measured.py).

Rules: tasks are one class only when all that their units run is equal by ``training/fingerprint.py``'s exact key
(the same one the cost profiles are kept by): the model's stages (every module, attribute, parameter layout and
tied weight), the cut, the loss and metric functions (code, defaults, captured values), the precision, the gradient
accumulation and the shard plan (boundaries, kept and offloaded forwards); prepared models' tasks too (their loss is
the profile's, the same function for all). A task that cannot be keyed and a task after an out-of-memory re-plan
are measured as their own, as before. A class is shared only where its measured segment left its units quiet
(every draw inside a stage it routes, none the router does not know: ``Device.shares``), so a task of the class
that draws anywhere else moves torch's global generator, which the guard sees: the segment runs again routed
(device/quiet.py), never wrong; otherwise each task of the class is measured as its own, but the one it was
measured for (its own count, as a key of its own would have been: not counted twice). What is shared is the
device's op-by-op count (its peak) and the routing hint. A CUDA device measures itself (``Device.measure`` is never
true there) and shares nothing.
"""
from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from .fingerprint import Keyer, Unkeyable
from .profile_cache import model_key


def measure_as(task: Any, cut: Any, plan: Any, autocast: Any) -> Hashable:
    """A key shared by the tasks whose segments allocate and draw alike (module docstring), else ``task.name``."""
    try:
        metrics = sorted((task.metrics or {}).items())
        return ("class", *model_key(Keyer(), cut, task.loss, autocast, metrics, task.grad_accumulation),
                plan_layout(plan))
    except Unkeyable:
        return task.name


def measure_key(state: Any, segment: Hashable, device: Any) -> tuple[Hashable, Hashable]:
    """The key ``device`` measures ``state``'s segment of key ``segment`` under: its class's where the device shares
    it (``Device.shares``), else the task's own name's."""
    key = (state.measure_as, segment)
    if key[0] is state.task.name or device.shares(key, state.task.name):
        return key
    return state.task.name, segment


def plan_layout(plan: Any) -> tuple[Any, ...]:
    """The plan's shards as the units see them: stage ranges, kept and offloaded forwards."""
    return tuple((s.start, s.stop, plan.keeps(s.index), plan.offloads(s.index)) for s in plan.shards) + (
        plan.may_keep(),)
