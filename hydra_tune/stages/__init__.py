"""Model -> ordered stages: the smallest pieces the planner may cut between.

    cut = extract_stages(model)             # declared stages, nn.Sequential, a transformers family, or one stage
    carry = cut.prepare(batch)              # the first stage's input
    for stage in cut.stages: carry = stage.module(carry)      # == the model's own outputs for that batch

A stage's module maps one *carry* (any pytree of tensors and plain values) to the next; the last returns the
model's outputs. Stage modules only reference the model's own submodules, so parameters stay the model's
(including parameters shared between stages, such as GPT-2's tied embedding and head).
"""
from __future__ import annotations

from collections.abc import Callable
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


class _WholeModel(nn.Module):
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


def _identity(batch: Any) -> Any:
    return batch


# transformers model class name -> (module in this package, function returning its ModelStages). Modules are
# imported when a model of theirs is cut, so transformers is never imported by hydra_tune itself.
FAMILIES: dict[str, tuple[str, str]] = {
    "GPT2LMHeadModel": ("gpt2", "gpt2_stages"),
    "BertForSequenceClassification": ("bert", "bert_stages"),
    "BertForMaskedLM": ("bert", "bert_stages"),
    "LlamaForCausalLM": ("llama", "llama_stages"),
    "MistralForCausalLM": ("llama", "llama_stages"),
    "Qwen2ForCausalLM": ("llama", "llama_stages"),
    "OPTForCausalLM": ("opt", "opt_stages"),
}


def extract_stages(model: nn.Module, stages: Callable[[nn.Module], Any] | None = None) -> ModelStages:
    """Cut ``model`` into stages: the ones ``stages(model)`` or ``model.hydra_stages()`` declares (explicit.py),
    else by its known structure; a model of unknown structure becomes one stage (it still runs if it fits)."""
    if stages is not None or callable(getattr(model, "hydra_stages", None)):
        from .explicit import explicit_stages

        return explicit_stages(model, stages)
    if isinstance(model, nn.Sequential) and len(model) > 0:
        from .sequential import sequential_stages

        return sequential_stages(model)
    cls = type(model)
    family = FAMILIES.get(cls.__name__) if cls.__module__.startswith("transformers.") else None
    if family is not None:
        import importlib

        module = importlib.import_module(f"{__name__}.{family[0]}")
        return getattr(module, family[1])(model)
    return ModelStages((Stage(cls.__name__, _WholeModel(model)),), _identity, "whole")
