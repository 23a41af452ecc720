"""transformers' LLaMA-family decoders (Llama, Mistral, Qwen2 ForCausalLM) as stages: embed, one per layer, head.

    cut = llama_stages(LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, ...)))
    [s.name for s in cut.stages] == ['embed', 'layers.0', 'layers.1', 'head']

Each stage repeats exactly what the model's forward does for its part on the training path, so the stages compose
to the model's own loss and gradients. The three families share one forward and differ only in their masks:
Llama builds a causal mask, Mistral a sliding-window mask when ``config.sliding_window`` is set, Qwen2 one mask
per entry of ``config.layer_types`` (full_attention / sliding_attention). The embed stage builds the masks, the
position ids and the rotary (cos, sin) once and carries them; each layer reads the mask of its own layer type.
With ``config.use_cache`` (the default) the model's forward makes an empty DynamicCache even in training; the
masks are built against one and each layer runs with a fresh one, so the numbers match bit for bit.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .base import ModelStages, Stage, build_mask, outputs_checked, token_batches
from .compat import call_renamed, keep_all_positions

_KEYS = ("input_ids", "attention_mask", "position_ids", "labels")
# Inputs the model's forward accepts but whose branch (generation cache, embeddings given directly, logits of a
# few positions only) the stages do not repeat.
_UNSUPPORTED = ("cache", "past_key_values", "use_cache", "inputs_embeds", "logits_to_keep", "output_attentions",
                "output_hidden_states")


_prepare = token_batches("a LLaMA-family", _KEYS, _UNSUPPORTED)


def _layer_types(model: nn.Module) -> list[str]:
    """The mask each decoder layer reads, as the family's forward picks it."""
    config, n = model.config, model.config.num_hidden_layers
    name = type(model).__name__
    if name == "Qwen2ForCausalLM":
        return list(config.layer_types[:n])
    if name == "MistralForCausalLM" and config.sliding_window is not None:
        return ["sliding_attention"] * n
    return ["full_attention"] * n


def _fresh_cache(config: Any) -> Any:
    """What the model's forward makes when use_cache is on (its default, training included): an empty cache."""
    if not config.use_cache:
        return None
    from transformers.cache_utils import DynamicCache

    return DynamicCache(config=config)


def _layer_kwargs(config: Any) -> dict[str, Any]:
    # merge_with_config_defaults forwards config.is_causal to every layer when the config has one.
    return {"is_causal": config.is_causal} if hasattr(config, "is_causal") else {}


class _Embed(nn.Module):
    def __init__(self, model: nn.Module, kinds: list[str]) -> None:
        super().__init__()
        self.embed_tokens, self.rotary_emb = model.model.embed_tokens, model.model.rotary_emb
        self.config = model.config
        self.kinds = kinds  # mask kinds the layers read, each built once

    def forward(self, batch: dict[str, Any]) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        input_ids, attention_mask = batch["input_ids"], batch.get("attention_mask")
        position_ids = batch.get("position_ids")
        inputs_embeds = self.embed_tokens(input_ids)
        cache = _fresh_cache(self.config)
        if position_ids is None:
            # past_seen_tokens is 0: the cache (if any) is empty
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(0)
        builders = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        masks = {kind: build_mask(builders[kind], inputs_embeds, attention_mask, config=self.config, cache=cache,
                                  position_ids=position_ids) for kind in self.kinds}
        cos, sin = self.rotary_emb(inputs_embeds, position_ids=position_ids)
        return {"hidden": inputs_embeds, "masks": masks, "position_ids": position_ids, "cos": cos, "sin": sin,
                "labels": batch.get("labels")}


class _Layer(nn.Module):
    def __init__(self, layer: nn.Module, kind: str, config: Any) -> None:
        super().__init__()
        self.layer, self.kind, self.config = layer, kind, config

    def forward(self, carry: dict[str, Any]) -> dict[str, Any]:
        # A fresh cache per layer is what the model's shared one is to this layer: each layer touches only its own
        # slot, and the cache's concatenation makes the keys/values contiguous exactly as in the model.
        cache = _fresh_cache(self.config)
        hidden = call_renamed(self.layer, carry["hidden"], attention_mask=carry["masks"][self.kind],
                              position_embeddings=(carry["cos"], carry["sin"]), position_ids=carry["position_ids"],
                              cache=cache, use_cache=self.config.use_cache, **_layer_kwargs(self.config))
        return {**carry, "hidden": hidden}


class _Head(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = model.model.norm, model.lm_head
        self.loss_function = model.loss_function
        self.vocab_size = model.config.vocab_size

    def forward(self, carry: dict[str, Any]) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        hidden = keep_all_positions(self.norm(carry["hidden"]))  # logits_to_keep=0: every position
        logits = self.lm_head(hidden)
        labels = carry["labels"]
        loss = None if labels is None else self.loss_function(logits=logits, labels=labels,
                                                              vocab_size=self.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def llama_stages(model: nn.Module) -> ModelStages:
    """Cut a LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM into embed, layers.<i>, head."""
    base = model.model
    # Checkpointing turns use_cache off inside the model only when grad is enabled, a branch the stages do not
    # repeat; it buys nothing here either, since the runtime recomputes each shard's forward in its backward.
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        # transformers 5.23 renamed gradient_checkpointing_disable (still there) to activation_checkpointing_disable
        off = "activation" if hasattr(model, "activation_checkpointing_disable") else "gradient"
        raise ValueError(
            f"{type(model).__name__} cut into stages must have activation checkpointing off, but got "
            f"(gradient_checkpointing=True). Fix: call model.{off}_checkpointing_disable() (the runtime already "
            "recomputes each shard's forward in its backward), or train it unsharded.")
    kinds = _layer_types(model)
    unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"`config.layer_types` must hold only full_attention / sliding_attention, but got "
                         f"(layer_types={unknown}). Fix: train the model unsharded.")
    stages = [Stage("embed", _Embed(model, sorted(set(kinds))))]
    n = model.config.num_hidden_layers
    stages += [Stage(f"layers.{i}", _Layer(layer, kinds[i], model.config)) for i, layer in enumerate(base.layers[:n])]
    stages.append(Stage("head", _Head(model)))
    return ModelStages(tuple(stages), outputs_checked(_prepare, "a LLaMA-family", model.config), "llama",
                       ("attention_mask",))
