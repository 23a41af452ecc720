"""nn.Sequential: every position is a stage, in the order ``forward`` runs them; the batch's inputs feed the first.

    act = nn.ReLU()
    cut = sequential_stages(nn.Sequential(nn.Linear(4, 4), act, nn.Linear(4, 4), act))
    [s.name for s in cut.stages] == ['0:Linear', '1:ReLU', '2:Linear', '3:ReLU']

Rule: a module placed at several positions (one instance reused) is a stage at each of them, as ``forward`` calls
it at each; its parameters are then shared by those stages, and the runtime sums their gradient contributions
like autograd does (as for GPT-2's tied embedding and head). A child working in place on its input
(``nn.ReLU(inplace=True)``) joins the stage before it (base.join_inplace).
"""
from __future__ import annotations

from typing import Any

import torch.nn as nn

from .base import ModelStages, Stage, join_inplace


def _inputs(batch: Any) -> Any:
    if isinstance(batch, (tuple, list)):
        return batch[0]
    if isinstance(batch, dict):
        raise TypeError(
            "an nn.Sequential model takes one input, but the batch is a dict "
            f"(keys={sorted(batch)}). Fix: yield (inputs, target) tuples, or a tensor.")
    return batch


def sequential_stages(model: nn.Sequential) -> ModelStages:
    # Not named_children(): it skips a module already seen, so an instance placed twice would run once. The
    # position -> module table is what Sequential.forward iterates (``for module in self``), repeats included;
    # torch has no public accessor that keeps both the names and the repeats.
    stages = [Stage(f"{name}:{type(child).__name__}", child) for name, child in model._modules.items()]
    return ModelStages(join_inplace(stages), _inputs, "sequential")
