"""Scheduling policies over plain data: which ready task a free device runs next.

    fifo([Ready("a", seq=3, last_device=1), Ready("b", seq=1, last_device=0)], device=0) == 1

A policy sees only small records, never tensors or threads, so it is tested with exact expected choices and can
be replayed by a simulator. The runtime calls ``pick`` under its lock whenever a device is free.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Ready:
    """A task whose next unit may run now."""

    task: str
    seq: int                 # when it became ready (a global counter)
    last_device: int | None  # the device its previous unit ran on


Policy = Callable[[Sequence[Ready], int], int]


def fifo(ready: Sequence[Ready], device: int) -> int:
    """The task that has waited longest; among equals, one that last ran on this device."""
    return min(range(len(ready)), key=lambda i: (ready[i].seq, ready[i].last_device != device))


POLICIES: dict[str, Policy] = {"fifo": fifo}
