"""transformers' OPTForCausalLM as stages: embeddings, one stage per decoder layer, final norm + head + loss.

    cut = opt_stages(OPTForCausalLM(OPTConfig(num_hidden_layers=2)))
    [s.name for s in cut.stages] == ['embed', 'layers.0', 'layers.1', 'head']

Each stage repeats exactly what ``OPTForCausalLM.forward`` does for its part on the training path, so the
stages compose to the model's own loss and gradients. The carry between layers holds the hidden states, the
causal mask as the decoder builds it, the position ids and the labels. OPT applies no dropout to its embeddings
(dropout lives inside the layers). ``project_in``/``project_out`` (word_embed_proj_dim != hidden_size) run in the
embed/head stages; ``final_layer_norm`` runs in the head when the model has one (do_layer_norm_before and not
_remove_final_layer_norm). ``lm_head.weight`` is ``embed_tokens.weight`` when the config ties them; the runtime
sums the two stages' gradient contributions like autograd does.
With ``config.use_cache`` (OPT's default) the model fills a DynamicCache even in training, which makes keys and
values contiguous copies and so changes sdpa's gradient bits; each layer stage passes a fresh DynamicCache of its
own too (dropped when the stage returns). Not cut: ``layerdrop > 0`` (each forward skips random layers, which
the stages do not repeat) -> ``NotCuttable``: the model runs as one stage, with a warning (stages/__init__.py).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .base import ModelStages, NotCuttable, Stage, build_mask, outputs_checked, token_batches
from .compat import call_renamed, keep_all_positions


def _new_cache(decoder: nn.Module, training: bool) -> Any:
    """The cache the decoder's forward would create: config.use_cache, unless it checkpoints while training.

    The decoder's own flag decides for every layer (with every_n_layers > 1 some layers are not checkpointed).
    Deliberately ignores torch.is_grad_enabled() (the decoder checks it): a shard's no-grad forward must match its
    recompute and the plain training forward, which runs with gradients on."""
    from transformers.cache_utils import DynamicCache

    config = decoder.config
    if not config.use_cache or (decoder.gradient_checkpointing and training):
        return None
    return DynamicCache(config=config)


_KEYS = ("input_ids", "attention_mask", "position_ids", "labels")


_prepare = token_batches("an OPT", _KEYS)


class _Embed(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        d = model.model.decoder
        self.embed_tokens, self.embed_positions, self.project_in = d.embed_tokens, d.embed_positions, d.project_in
        self.config = d.config

    def forward(self, batch: dict[str, Any]) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask

        input_ids = batch["input_ids"]
        attention_mask, position_ids = batch.get("attention_mask"), batch.get("position_ids")
        input_ids = input_ids.view(-1, input_ids.shape[-1])
        inputs_embeds = self.embed_tokens(input_ids)
        # The dense mask only infers position ids; the causal mask gets the user's (maybe None) mask so that
        # sdpa may skip it when unpadded, as OPTDecoder does. Its float ones make the same positions as the model's.
        position_attention_mask = attention_mask
        if position_attention_mask is None:
            position_attention_mask = torch.ones(inputs_embeds.shape[0], inputs_embeds.shape[1],
                                                 device=inputs_embeds.device)
        if position_ids is None:
            position_ids = torch.cumsum(position_attention_mask, dim=1)
            position_ids = (position_ids * position_attention_mask - 1).long()
        # The model passes its empty DynamicCache here when config.use_cache: the mask is the same without it.
        mask = build_mask(create_causal_mask, inputs_embeds, attention_mask, config=self.config, cache=None)
        pos_embeds = self.embed_positions(position_attention_mask, 0, position_ids=position_ids)
        if self.project_in is not None:
            inputs_embeds = self.project_in(inputs_embeds)
        hidden = inputs_embeds + pos_embeds.to(inputs_embeds.device)
        return {"hidden": hidden, "mask": mask, "position_ids": position_ids, "labels": batch.get("labels")}


class _Layer(nn.Module):
    def __init__(self, layer: nn.Module, decoder: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self._decoder = (decoder,)  # a tuple is no submodule: only this layer's parameters are the stage's

    def forward(self, carry: dict[str, Any]) -> dict[str, Any]:
        cache = _new_cache(self._decoder[0], self.training)
        hidden = call_renamed(self.layer, carry["hidden"], attention_mask=carry["mask"],
                              position_ids=carry["position_ids"], cache=cache, use_cache=cache is not None)
        return {**carry, "hidden": hidden}


class _Head(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        d = model.model.decoder
        self.final_layer_norm, self.project_out, self.lm_head = d.final_layer_norm, d.project_out, model.lm_head
        self.loss_function = model.loss_function
        self.vocab_size = model.config.vocab_size

    def forward(self, carry: dict[str, Any]) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        hidden = carry["hidden"]
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        hidden = keep_all_positions(hidden)  # the model's default: keep every position
        logits = self.lm_head(hidden).contiguous()
        labels = carry["labels"]
        loss = None if labels is None else self.loss_function(logits=logits, labels=labels,
                                                              vocab_size=self.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def opt_stages(model: nn.Module) -> ModelStages:
    """Cut an ``OPTForCausalLM`` into 'embed', 'layers.<i>' per decoder layer, and 'head'."""
    layerdrop = getattr(model.config, "layerdrop", 0.0)
    if layerdrop and layerdrop > 0.0:
        raise NotCuttable(f"config.layerdrop={layerdrop} skips random layers in every training forward, which its "
                          "stages do not repeat; set config.layerdrop = 0.0 to cut it")
    decoder = model.model.decoder
    stages = [Stage("embed", _Embed(model))]
    stages += [Stage(f"layers.{i}", _Layer(layer, decoder)) for i, layer in enumerate(decoder.layers)]
    stages.append(Stage("head", _Head(model)))
    return ModelStages(tuple(stages), outputs_checked(_prepare, "an OPT", model.config), "opt",
                       ("attention_mask",))
