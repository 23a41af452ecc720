"""nn.Sequential: every child is a stage; the batch's inputs feed the first child.

    cut = sequential_stages(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    [s.name for s in cut.stages] == ['0:Linear', '1:ReLU']
"""
from __future__ import annotations

from typing import Any

import torch.nn as nn

from .base import ModelStages, Stage


def _inputs(batch: Any) -> Any:
    if isinstance(batch, (tuple, list)):
        return batch[0]
    if isinstance(batch, dict):
        raise TypeError(
            "an nn.Sequential model takes one input, but the batch is a dict "
            f"(keys={sorted(batch)}). Fix: yield (inputs, target) tuples, or a tensor.")
    return batch


def sequential_stages(model: nn.Sequential) -> ModelStages:
    stages = tuple(Stage(f"{name}:{type(child).__name__}", child) for name, child in model.named_children())
    return ModelStages(stages, _inputs, "sequential")
