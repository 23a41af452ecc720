"""PEFT models (``peft.PeftModel`` and its task subclasses) as stages: the wrapped model's own stages.

    model = get_peft_model(BertForSequenceClassification(cfg), LoraConfig(r=8, target_modules=["query", "value"]))
    cut = peft_stages(model)           # the BERT stages: embed, layer.0 .. layer.N-1, head
    [s.name for s in cut.stages] == ['embed', 'layer.0', 'layer.1', 'head']

Rules:
- A PEFT method that only swaps layers inside the base model (LoRA, IA3, LoHa, LoKr, ... : every method whose
  config is not prompt learning) leaves the forward of ``PeftModel`` as "call the base model": the LoRA layers sit
  in the base model's own modules, so the base model's stages run them, and the stages of the wrapped model (a
  family hydra_tune cuts, an nn.Sequential, declared stages) compute what the PEFT model computes.
- Prompt learning (prefix tuning, prompt tuning, P-tuning) adds virtual tokens in ``PeftModel``'s own forward:
  such a model is one stage (with a warning saying why), as are PEFT models with hooks or a replaced forward on
  the wrapper itself, and wrappers whose base model cannot be cut.
- The frozen base weights stay parameters with ``requires_grad=False``: they get no gradients and no optimizer
  state; runtimes may hold equal ones once (training/shared_frozen.py).
"""
from __future__ import annotations

import warnings
from typing import Any

import torch.nn as nn

from .base import ModelStages


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (checked by class, so peft is never imported here)."""
    return any(c.__name__ == "PeftModel" and c.__module__.startswith("peft.") for c in type(model).__mro__)


def peft_stages(model: nn.Module, cut_inner: Any) -> ModelStages | None:
    """The stages of the model ``model`` wraps (``cut_inner(base_model)`` cuts it), or None (with a warning) when
    ``model``'s own forward does more than call the base model."""
    why = _why_one_stage(model)
    if why:
        warnings.warn(f"hydra_tune runs {type(model).__name__} as one stage: {why}. Declare its stages "
                      "(ModelTask(stages=...)) to cut it.", stacklevel=4)
        return None
    cut = cut_inner(model.get_base_model())
    if cut.family == "whole":
        return None
    # declared stages keep their family: check.py still checks them against the (PEFT) model's forward
    family = cut.family if cut.family == "explicit" else f"peft:{cut.family}"
    return ModelStages(cut.stages, cut.prepare, family, cut.value_keys)


def _why_one_stage(model: nn.Module) -> str:
    config = getattr(model, "active_peft_config", None)
    if config is None:
        return "it has no active PEFT config"
    if getattr(config, "is_prompt_learning", False):
        return (f"its PEFT method {getattr(config, 'peft_type', '?')} is prompt learning, which adds virtual "
                "tokens in PeftModel's own forward")
    tuner = getattr(model, "base_model", None)
    for what, m in (("the PeftModel", model), ("its tuner", tuner)):
        if m is None:
            continue
        if "forward" in vars(m):
            return f"the forward of {what} is replaced on the instance"
        if m._forward_pre_hooks or m._forward_hooks:
            return f"{what} has forward hooks on itself"
    return ""
