"""Model -> ordered stages: the smallest pieces the planner may cut between.

    cut = extract_stages(model)             # declared stages, nn.Sequential, a transformers family, or one stage
    carry = cut.prepare(batch)              # the first stage's input
    for stage in cut.stages: carry = stage.module(carry)      # == the model's own outputs for that batch

A stage's module maps one *carry* (any pytree of tensors and plain values) to the next; the last returns the
model's outputs. Stage modules only reference the model's own submodules, so parameters stay the model's
(including parameters shared between stages, such as GPT-2's tied embedding and head).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch.nn as nn

from .base import ModelStages, NotCuttable, Stage, WholeModel, call_with_batch, identity, token_batches
from .peft import is_peft_model

__all__ = ["extract_stages", "FAMILIES", "ModelStages", "Stage", "call_with_batch", "token_batches"]

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
    else by its known structure; a model of unknown structure becomes one stage (it still runs if it fits).
    Rule: a known structure is cut only when ``model(...)`` runs it as such: an nn.Sequential subclass with its
    own ``forward``, or a model with forward hooks (or a replaced ``forward``) on itself, computes more than its
    parts, so it is one stage unless its stages are declared (with a warning saying why)."""
    if stages is not None or callable(getattr(model, "hydra_stages", None)):
        from .explicit import explicit_stages

        return explicit_stages(model, stages)
    if is_peft_model(model):  # LoRA & co.: the wrapped model's stages (peft.py)
        from .peft import peft_stages

        cut = peft_stages(model, extract_stages)
        if cut is not None:
            return cut
        return ModelStages((Stage(type(model).__name__, WholeModel(model)),), identity, "whole")
    cls = type(model)
    family = FAMILIES.get(cls.__name__) if cls.__module__.startswith("transformers.") else None
    sequential = isinstance(model, nn.Sequential) and len(model) > 0
    more = _runs_more_than_its_parts(model, sequential) if sequential or family is not None else ""
    if more:
        warnings.warn(f"hydra_tune runs {cls.__name__} as one stage: {more}, which its parts alone would not run. "
                      "Declare its stages (ModelTask(stages=...)) to cut it.", stacklevel=3)
    else:
        try:
            cut = _known_cut(model, family) if family is not None or sequential else None
        except NotCuttable as exc:
            warnings.warn(f"hydra_tune runs {cls.__name__} as one stage: {exc}", stacklevel=3)
            cut = None
        skipped = _skipped_containers(model, cut) if cut is not None else []
        if cut is not None and not skipped:
            return cut
        if skipped:
            warnings.warn(f"hydra_tune runs {cls.__name__} as one stage: forward hooks or a replaced forward on "
                          f"{skipped}, modules whose own forward its stages do not call. Declare its stages "
                          "(ModelTask(stages=...)) to cut it.", stacklevel=3)
    return ModelStages((Stage(cls.__name__, WholeModel(model)),), identity, "whole")


def _known_cut(model: nn.Module, family: tuple[str, str] | None) -> ModelStages:
    if family is None:
        from .sequential import sequential_stages

        return sequential_stages(model)
    import importlib

    from .compat import check_family

    check_family(family[0])   # a transformers release whose forward the family's stages repeat exactly
    module = importlib.import_module(f"{__name__}.{family[0]}")
    return getattr(module, family[1])(model)


def _skipped_containers(model: nn.Module, cut: ModelStages) -> list[str]:
    """Submodules with forward hooks (or a replaced forward) that no stage runs: a container whose children the
    stages call directly (GPT-2's ``transformer``), so its own forward, and its hooks, would never run."""
    inside = {id(m) for stage in cut.stages for m in stage.module.modules()}
    return [name for name, m in model.named_modules() if m is not model and id(m) not in inside
            and (m._forward_pre_hooks or m._forward_hooks or "forward" in vars(m))]


def _runs_more_than_its_parts(model: nn.Module, sequential: bool) -> str:
    """Why ``model(...)`` computes more than its stages would ("" when it does not)."""
    if sequential and type(model).forward is not nn.Sequential.forward:
        return "it subclasses nn.Sequential with its own forward"
    if "forward" in vars(model):
        return "its forward is replaced on the instance"
    # torch lists a module's own hooks only in these tables
    if model._forward_pre_hooks or model._forward_hooks:
        return "it has forward hooks on itself"
    return ""
