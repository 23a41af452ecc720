"""What the training loop (loop.py) keeps about one epoch's run and about the segment in flight.

    run = EpochRun(losses=[], skip=0, samples=0)       # one epoch's losses, samples, minibatches since the step
    attempt = Attempt(point, losses, len(losses), rebuild)   # where a retried segment starts over from
    batch_size(batch)                                   # the leading dimension of its first tensor (1: none)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .segments import Segment
from .trees import tensor_leaves


@dataclass
class Attempt:
    """Where the segment in flight began: the task's RNG state, the losses list and its length, and how to build
    the segment's units again (over the task's current shards)."""

    rng: Any  # host_rng.retry_point: the task's streams and, where it draws from them, Python's and numpy's
    losses: list[float]
    n_losses: int
    rebuild: Callable[[], Segment]


@dataclass
class EpochRun:
    """One epoch's training so far: its minibatch losses, the batches a resume steps over, the samples trained
    on (all epochs), minibatches since the last step and minibatches skipped for a non-finite loss."""

    losses: list[float]
    skip: int
    samples: int
    pending: int = 0
    skipped: int = 0


def batch_size(batch: Any) -> int:
    for leaf in tensor_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 1
