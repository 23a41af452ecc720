"""transformers' GPT2LMHeadModel as stages: embeddings, one stage per block, final norm + head + loss.

    cut = gpt2_stages(GPT2LMHeadModel(GPT2Config(n_layer=2)))
    [s.name for s in cut.stages] == ['embed', 'h.0', 'h.1', 'head']

Each stage repeats exactly what ``GPT2LMHeadModel.forward`` does for its part (training path: no cache, no
cross-attention), so the stages compose to the model's own loss and gradients. The carry between blocks holds
the hidden states plus what later stages need: the causal mask, position ids, labels and the output shape.
The head's ``lm_head.weight`` is the embedding's ``wte.weight`` when the config ties them; the runtime sums the
two stages' gradient contributions like autograd does.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .base import ModelStages, Stage, build_mask, outputs_checked, token_batches

_KEYS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "labels")


_prepare = token_batches("a GPT-2", _KEYS)


class _Embed(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        t = model.transformer
        self.wte, self.wpe, self.drop = t.wte, t.wpe, t.drop
        self.config = model.config

    def forward(self, batch: dict[str, Any]) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask

        input_ids = batch["input_ids"]
        attention_mask, token_type_ids = batch.get("attention_mask"), batch.get("token_type_ids")
        position_ids = batch.get("position_ids")
        input_shape = input_ids.size()
        input_ids = input_ids.view(-1, input_shape[-1])
        batch_size = input_ids.shape[0]
        if token_type_ids is not None:
            token_type_ids = token_type_ids.view(-1, input_shape[-1])
        inputs_embeds = self.wte(input_ids)
        if position_ids is None:
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(0)
        hidden = inputs_embeds + self.wpe(position_ids).to(inputs_embeds.device)
        if attention_mask is not None and attention_mask.ndim < 4:
            attention_mask = attention_mask.view(batch_size, -1)
        # Position ids made here are a plain arange, which the mask's packed-sequence check would only confirm
        # (by reading their values); passing the user's alone gives the same mask and lets shapes-only planning
        # (meta tensors, no values) run this stage.
        mask = build_mask(create_causal_mask, inputs_embeds, attention_mask, config=self.config, cache=None,
                          position_ids=batch.get("position_ids"))
        if token_type_ids is not None:
            hidden = hidden + self.wte(token_type_ids)
        hidden = self.drop(hidden)
        return {"hidden": hidden, "mask": mask, "position_ids": position_ids, "labels": batch.get("labels"),
                "output_shape": (-1,) + tuple(input_shape[1:]) + (hidden.size(-1),)}


class _Block(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, carry: dict[str, Any]) -> dict[str, Any]:
        hidden = self.block(carry["hidden"], None, carry["mask"], None, encoder_attention_mask=None,
                            use_cache=False, position_ids=carry["position_ids"])
        return {**carry, "hidden": hidden}


class _Head(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = model.transformer.ln_f, model.lm_head
        self.loss_function = model.loss_function
        self.vocab_size = model.config.vocab_size

    def forward(self, carry: dict[str, Any]) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

        hidden = self.ln_f(carry["hidden"]).view(carry["output_shape"])
        logits = self.lm_head(hidden)
        labels = carry["labels"]
        loss = None if labels is None else self.loss_function(logits, labels, vocab_size=self.vocab_size)
        return CausalLMOutputWithCrossAttentions(loss=loss, logits=logits)


def gpt2_stages(model: nn.Module) -> ModelStages:
    if getattr(model.config, "add_cross_attention", False):
        raise ValueError("GPT-2 with `add_cross_attention=True` cannot be cut into stages yet, but got "
                         "(add_cross_attention=True). Fix: train it unsharded (a budget that fits the whole model).")
    stages = [Stage("embed", _Embed(model))]
    stages += [Stage(f"h.{i}", _Block(block)) for i, block in enumerate(model.transformer.h)]
    stages.append(Stage("head", _Head(model)))
    return ModelStages(tuple(stages), outputs_checked(_prepare, "a GPT-2", model.config), "gpt2",
                       ("attention_mask",))
