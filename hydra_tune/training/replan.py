"""A device ran out of memory during a unit: re-plan that task with smaller shards and run its minibatch again.

    except torch.OutOfMemoryError as exc:
        segment = replan(state, unit, device.name, bandwidth, keep)   # the same minibatch over smaller shards
        # ... run ``segment``; a stage that does not fit even alone raises PlanError naming it

The minibatch starts over from where it began (``TaskState.retry``: the task's RNG state, the epoch's losses, host
buffers such as BatchNorm statistics), and nothing of the failed attempt reached the parameters (gradients are
added and the optimizer steps only after a segment), so the task ends exactly as it would have without the
out-of-memory. Each re-plan asks for 75% of the failed plan's predicted peak (85% or 95% when no plan fits that):
the memory the device really had is unknown (another process, fragmentation, a model whose measured costs were
off), so it shrinks until the units fit, or until a single stage no longer fits even in 95% and the task fails with
the partitioner's error. A task whose state was resident on the device (resident.py) held that too: the shares
apply to its units' peak plus its state, its state left the device, and the re-plan first tries to leave room for
the state to come back (``TaskState.home.room``: units and state together), else gives it all to the units.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import HydraError, PlanError, format_bytes
from ..policy.partition import partition

if TYPE_CHECKING:
    from .segments import Segment, Unit
    from .state import TaskState

SHRINK = (0.75, 0.85, 0.95)  # a re-plan fits the task into the first of these shares of the failed plan's peak
                              # that a plan exists for
MAX_REPLANS = 8   # a task that keeps running out of memory after this many re-plans fails


def is_oom(exc: BaseException) -> bool:
    """The device's allocator refused an allocation (CUDA, or the CPU stand-ins' test-only limit)."""
    return isinstance(exc, torch.OutOfMemoryError)


def replan(state: TaskState, unit: Unit, device: str, bandwidth: float | None, keep: bool,
           resident: int = 0) -> Segment:
    """Cut ``state``'s model for a smaller budget and rebuild the minibatch in flight over the new shards;
    ``resident``: the bytes of its state that were on the device (0: none)."""
    plan, name = state.plan, state.task.name
    used = plan.peak + resident
    allowed = plan.budget if state.home.room is None else state.home.room  # after a re-plan: units and state
    ceiling = used if allowed is None else min(allowed, used)
    where = (f"task {name!r} ran out of device memory on {device} in unit {unit} (plan: {len(plan.shards)} shards, "
             f"predicted peak {format_bytes(plan.peak)})")
    if state.replans >= MAX_REPLANS:
        raise HydraError(f"{where} after {state.replans} re-plans; the last budget was {format_bytes(ceiling)}. "
                         "Fix: lower device_memory to what the device really has free, or free the memory other "
                         "processes hold on it.")
    smaller = None
    for share in SHRINK:  # the smallest budget a plan exists for: the device holds less than the plan said
        room = budget = int(ceiling * share)
        for budget in ([room - resident] if 0 < resident < room else []) + [room]:  # state back first, if it can be
            try:
                smaller = partition(state.costs, budget, bandwidth=bandwidth, keep=keep)
                break
            except PlanError as exc:
                error = exc
        if smaller is not None:
            break
    else:
        raise PlanError(f"{where}; re-planning it for {format_bytes(budget)} failed: {error} (Plans are measured "
                        "on the task's first batch: a larger later batch needs more than planned; make the first "
                        "batch the largest, or keep batch shapes equal.)") from None
    state.home.room = room
    return state.retry(smaller)
