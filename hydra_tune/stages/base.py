"""What every stage extractor builds: ``Stage`` (a named module), ``ModelStages`` (the stages in order, how a batch
becomes the first stage's carry, and the family that cut them), the batch convention and a token model's batches;
``join_inplace`` for cuts of user-listed modules.

    cut = ModelStages((Stage("embed", embed), Stage("head", head)), prepare=token_batches("a GPT-2", keys),
                      family="gpt2")
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.nn as nn


@dataclass(frozen=True)
class Stage:
    name: str
    module: nn.Module


@dataclass(frozen=True)
class ModelStages:
    stages: tuple[Stage, ...]
    prepare: Callable[[Any], Any]
    family: str


def call_with_batch(model: nn.Module, batch: Any) -> Any:
    """The batch convention: dict -> model(**batch); (inputs, target) -> model(inputs); tensor -> model(t)."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(batch[0])
    return model(batch)


class WholeModel(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Any) -> Any:
        return call_with_batch(self.model, batch)


def token_batches(what: str, keys: tuple[str, ...], unsupported: tuple[str, ...] = ()) -> Callable[[Any], Any]:
    """The ``prepare`` of a token model (``what``: e.g. "a BERT"): a dict with ``input_ids`` and only ``keys``, a
    tuple ``(input_ids, ...)`` or a tensor of input ids; keys in ``unsupported`` name the training-path limit."""
    import torch

    def prepare(batch: Any) -> dict[str, Any]:
        if isinstance(batch, torch.Tensor):
            return {"input_ids": batch}
        if isinstance(batch, (tuple, list)):
            return {"input_ids": batch[0]}
        if isinstance(batch, dict):
            special = sorted(set(batch) & set(unsupported))
            if special:
                raise ValueError(
                    f"{what} batch cut into stages takes no {special}, but got (keys={sorted(batch)}). Fix: drop "
                    f"{special} (the stages run the training path: input_ids, no cache), or train the model "
                    "unsharded (a budget that fits the whole model).")
            unknown = sorted(set(batch) - set(keys))
            if unknown or "input_ids" not in batch:
                raise TypeError(
                    f"{what} batch dict has `input_ids` and only keys in {list(keys)}, but got (keys="
                    f"{sorted(batch)}). Fix: drop {unknown or 'nothing'} from the batch and include input_ids.")
            return dict(batch)
        raise TypeError(f"{what} batch is a dict, a tuple (input_ids, ...) or a tensor of input ids, but got "
                        f"(batch={type(batch).__name__}). Fix: yield e.g. {{'input_ids': ids, 'labels': ids}}.")

    return prepare


class _Chain(nn.Sequential):
    """Stages joined into one by ``join_inplace``: the same modules, run in the same order."""


def join_inplace(stages: Sequence[Stage]) -> tuple[Stage, ...]:
    """``stages`` with each module that works in place on its input (``inplace=True``: ReLU, Dropout, ...) joined
    to the stage before it: a stage's input is a leaf that collects its gradient, and torch forbids changing such
    a leaf in place. The same modules run in the same order, so the stages still compute the model's forward.

        [s.name for s in join_inplace(cut)]  ->  ['0:Linear+1:ReLU', '2:Linear']   # ReLU(inplace=True)
    """
    out: list[Stage] = []
    for stage in stages:
        if out and getattr(stage.module, "inplace", False) is True:
            prev = out[-1]
            modules = list(prev.module) if isinstance(prev.module, _Chain) else [prev.module]
            out[-1] = Stage(f"{prev.name}+{stage.name}", _Chain(*modules, stage.module))
        else:
            out.append(stage)
    return tuple(out)


def identity(batch: Any) -> Any:
    return batch
