"""Stages compose to the model's own forward: same loss and gradients, bit for bit (dropout on)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import make_gpt2
from reference import assert_stages_match_model

from hydra_tune.stages import extract_stages



@pytest.mark.parametrize("tied, padded, attn", [(True, False, "sdpa"), (False, False, "sdpa"), (True, True, "sdpa"),
                                               (False, True, "eager"), (True, False, "eager")])
def test_gpt2_stages_equal_model_forward_backward(tied, padded, attn):
    torch.manual_seed(0)
    model = make_gpt2(tie_word_embeddings=tied, attn_implementation=attn)
    assert model.config._attn_implementation == attn
    ids = torch.randint(0, 128, (3, 12))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if padded:
        mask = torch.ones_like(ids)
        mask[0, 8:] = 0
        batch["attention_mask"] = mask
        batch["labels"][0, 8:] = -100
    assert_stages_match_model(model, batch, ["embed", "h.0", "h.1", "h.2", "h.3", "head"])


def test_gpt2_batch_with_unknown_key_is_explained():
    cut = extract_stages(make_gpt2())
    with pytest.raises(TypeError, match=r"only keys in .* Fix: drop \['pixel_values'\]"):
        cut.prepare({"input_ids": torch.zeros(1, 4, dtype=torch.long), "pixel_values": torch.zeros(1)})


def test_unknown_model_is_one_stage():
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)

        def forward(self, x):
            return self.a(x)

    cut = extract_stages(Custom())
    assert [s.name for s in cut.stages] == ["Custom"]
    x = torch.randn(2, 3)
    assert torch.equal(cut.stages[0].module(cut.prepare((x, None))), Custom.forward(cut.stages[0].module.model, x))


@pytest.mark.parametrize("family", ["gpt2", "bert"])
@pytest.mark.parametrize("flag", ["output_hidden_states", "output_attentions"])
def test_a_config_asking_for_more_outputs_than_the_stages_return_is_refused_at_each_batch(family, flag):
    # before: the head returned logits and loss only, so `out.hidden_states` read None where the plain model's
    # returns them (a loss term guarded by `if out.hidden_states is not None` was left out silently)
    from test_stages_bert import make_bert

    model = make_gpt2() if family == "gpt2" else make_bert("BertForSequenceClassification")
    cut = extract_stages(model)
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long)}
    cut.prepare(batch)
    if flag == "output_attentions":  # transformers takes it under eager attention only
        model.config._attn_implementation = "eager"
    setattr(model.config, flag, True)  # (set after the cut too: the loop may set it at any time)
    with pytest.raises(ValueError, match=rf"logits and the loss only.*config.{flag}=True.*model.config.{flag} = False"):
        cut.prepare(batch)
