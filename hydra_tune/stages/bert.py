"""transformers' BertForSequenceClassification and BertForMaskedLM as stages: embeddings, one per layer, head.

    cut = bert_stages(BertForMaskedLM(BertConfig(num_hidden_layers=2)))
    [s.name for s in cut.stages] == ['embed', 'layer.0', 'layer.1', 'head']

Each stage repeats exactly what the model's forward does for its part (training path: encoder only, no cache,
no cross-attention), so the stages compose to the model's own loss and gradients. The carry between layers holds
the hidden states plus what later stages need: the attention mask as ``BertModel`` builds it for the attention
implementation in use, the user's position ids (forwarded to the attention function like the model does) and
the labels. For the masked LM, ``cls.predictions.decoder.weight`` is ``word_embeddings.weight`` when the config
ties them; the runtime sums the two stages' gradient contributions like autograd does.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .base import ModelStages, Stage, build_mask, outputs_checked, token_batches
from .compat import call_renamed

_KEYS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "labels")


_prepare = token_batches("a BERT", _KEYS)


class _Embed(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.embeddings = model.bert.embeddings
        self.config = model.config

    def forward(self, batch: dict[str, Any]) -> dict[str, Any]:
        from transformers.masking_utils import create_bidirectional_mask

        position_ids = batch.get("position_ids")
        # BertEmbeddings itself fills in the default position and token type ids from its buffers (cache_length 0)
        hidden = call_renamed(self.embeddings, input_ids=batch["input_ids"], position_ids=position_ids,
                              token_type_ids=batch.get("token_type_ids"), inputs_embeds=None, cache_length=0)
        # Encoder-only BertModel: bidirectional mask (None, bool or additive float, by attention implementation)
        mask = build_mask(create_bidirectional_mask, hidden, batch.get("attention_mask"), config=self.config)
        return {"hidden": hidden, "mask": mask, "position_ids": position_ids, "labels": batch.get("labels")}


class _Layer(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, carry: dict[str, Any]) -> dict[str, Any]:
        # Same call as BertEncoder: encoder_hidden_states positional (for gradient checkpointing), position_ids as kwarg
        hidden = call_renamed(self.layer, carry["hidden"], carry["mask"], None, encoder_attention_mask=None,
                              cache=None, position_ids=carry["position_ids"])
        return {**carry, "hidden": hidden}


class _ClassifierHead(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.pooler, self.dropout, self.classifier = model.bert.pooler, model.dropout, model.classifier
        self.config = model.config
        self.num_labels = model.num_labels

    def forward(self, carry: dict[str, Any]) -> Any:
        from transformers.modeling_outputs import SequenceClassifierOutput

        logits = self.classifier(self.dropout(self.pooler(carry["hidden"])))
        labels = carry["labels"]
        loss = None
        if labels is not None:
            # The model infers problem_type on first use and stores it in the config; do the same, so either path
            # sees the same choice afterwards.
            if self.config.problem_type is None:
                if self.num_labels == 1:
                    self.config.problem_type = "regression"
                elif self.num_labels > 1 and labels.dtype in (torch.long, torch.int):
                    self.config.problem_type = "single_label_classification"
                else:
                    self.config.problem_type = "multi_label_classification"
            kind = self.config.problem_type
            if kind == "regression":
                loss = nn.functional.mse_loss(logits.squeeze(), labels.squeeze()) if self.num_labels == 1 \
                    else nn.functional.mse_loss(logits, labels)
            elif kind == "single_label_classification":
                loss = nn.functional.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
            elif kind == "multi_label_classification":
                loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


class _MaskedLMHead(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.cls = model.cls  # transform + decoder; decoder.weight is word_embeddings.weight when tied
        self.vocab_size = model.config.vocab_size

    def forward(self, carry: dict[str, Any]) -> Any:
        from transformers.modeling_outputs import MaskedLMOutput

        logits = self.cls(carry["hidden"])
        labels = carry["labels"]
        loss = None if labels is None else \
            nn.functional.cross_entropy(logits.view(-1, self.vocab_size), labels.view(-1))  # ignore_index -100
        return MaskedLMOutput(loss=loss, logits=logits)


def bert_stages(model: nn.Module) -> ModelStages:
    config = model.config
    for option in ("is_decoder", "add_cross_attention"):
        if getattr(config, option, False):
            raise ValueError(f"BERT with `{option}=True` cannot be cut into stages yet (only the encoder path is), "
                             f"but got ({option}=True). Fix: train it unsharded (a budget that fits the whole model).")
    name = type(model).__name__
    if name == "BertForSequenceClassification":
        head: nn.Module = _ClassifierHead(model)
        if model.bert.pooler is None:
            raise ValueError("BertForSequenceClassification needs its pooler, but got (bert.pooler=None). "
                             "Fix: build the model with its pooling layer, or train it unsharded.")
    elif name == "BertForMaskedLM":
        head = _MaskedLMHead(model)
    else:
        raise ValueError(f"bert_stages supports BertForSequenceClassification and BertForMaskedLM, but got "
                         f"(model={name}). Fix: train it unsharded (a budget that fits the whole model).")
    stages = [Stage("embed", _Embed(model))]
    stages += [Stage(f"layer.{i}", _Layer(layer)) for i, layer in enumerate(model.bert.encoder.layer)]
    stages.append(Stage("head", head))
    return ModelStages(tuple(stages), outputs_checked(_prepare, "a BERT", model.config), "bert",
                       ("attention_mask",))
