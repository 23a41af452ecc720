"""The schedule as data: a task's training is a chain of segments, each a run of units on one device.

    for segment in state.segments(emit=print):           # Segment "F0 F1 L2 B1 B0": one training minibatch
        for unit in segment.units: unit.run(device)      # one device per segment, its units in order

Unit kinds: F (forward, no loss), L (the last shard: forward, loss and backward in one unit), B (backward of one
shard, recomputing its forward unless it was kept), E (eval forward; on the last shard also the loss). A training
segment of K shards is F0..F(K-2), L(K-1), B(K-2)..B0; an eval segment is E0..E(K-1).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..device.devices import Device
from .trees import tensor_leaves


@dataclass(frozen=True)
class Unit:
    """One schedulable piece of work of kind F, L, B or E on one shard. ``prefetch`` prepares its shard on a
    device ahead of it."""

    task: str
    kind: str
    shard: int
    segment: int
    run: Callable[[Device], None] = field(repr=False, compare=False)
    prefetch: Callable[[Device], int] = field(repr=False, compare=False)  # returns the bytes it copied

    def __str__(self) -> str:
        return f"{self.kind}{self.shard}"


@dataclass(frozen=True)
class Segment:
    """Units that run back to back on one device: a training minibatch (F.. L B..) or one eval batch."""

    task: str
    index: int
    units: tuple[Unit, ...]
    train: bool
    key: Any = None  # (train, input shapes): segments with equal keys allocate alike
    # the task's next segment completes this one, right after its caller's own short work (a prepared training
    # forward: its backward is the loop's next call): the device runs it before any other (scheduler.py)
    follows: bool = False
    # no units: a light run's minibatch whose device the policy gave to another task (loop.py ``_light``); the
    # device that takes the task next opens its next segment itself, as one kept on it does, and tries a light
    # run there first (the minibatch becomes a segment of its own only if that declines too)
    handover: bool = False

    def __str__(self) -> str:
        return " ".join(str(u) for u in self.units)


def segment_key(train: bool, batch: Any) -> tuple[bool, tuple[Any, ...]]:
    """``Segment.key`` of a segment over ``batch``: training or eval, and every leaf's shape and dtype (its type
    name for a leaf that is not a tensor)."""
    shapes = tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                   for t in tensor_leaves(batch))
    return train, shapes
