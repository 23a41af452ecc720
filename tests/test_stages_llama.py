"""LLaMA-family stages (Llama, Mistral, Qwen2) compose to the model's own forward and train like plain PyTorch."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from conftest import lm_batches
from reference import assert_stages_match_model, check_device_peaks, max_param_diff, plain_train

import hydra_tune as ht
from hydra_tune.stages import extract_stages

_TINY = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
             max_position_embeddings=64, attention_dropout=0.1)
# Sliding window 4 < sequence 12-16, so the sliding mask differs from the causal one; Qwen2's first layer is full
# attention and the others sliding (max_window_layers=1), so each layer must read the mask of its own type.
_FAMILY = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=4)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(sliding_window=4, use_sliding_window=True,
                                                      max_window_layers=1)),
}


def make(family: str, layers: int = 3, tied: bool = False, attn: str = "sdpa") -> nn.Module:
    import transformers

    cls, cfg, extra = _FAMILY[family]
    config = getattr(transformers, cfg)(num_hidden_layers=layers, tie_word_embeddings=tied, **_TINY, **extra)
    return getattr(transformers, cls)._from_config(config, attn_implementation=attn)



@pytest.mark.parametrize("family", list(_FAMILY))
@pytest.mark.parametrize("tied, padded, attn", [(True, False, "sdpa"), (False, False, "sdpa"), (True, True, "sdpa"),
                                               (False, True, "eager"), (True, False, "eager")])
def test_llama_family_stages_equal_model_forward_backward(family, tied, padded, attn):
    torch.manual_seed(0)
    model = make(family, tied=tied, attn=attn)
    model.train()
    assert model.config._attn_implementation == attn
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids = torch.randint(0, 128, (3, 12))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if padded:
        mask = torch.ones_like(ids)
        mask[0, 8:] = 0
        batch["attention_mask"] = mask
        batch["labels"][0, 8:] = -100
    kinds = {"llama": {"full_attention"}, "mistral": {"sliding_attention"},
             "qwen2": {"full_attention", "sliding_attention"}}[family]

    def masks_of_each_layer_type(i: int, carry: dict) -> None:
        if i == 0:
            assert set(carry["masks"]) == kinds

    assert_stages_match_model(model, batch, ["embed", "layers.0", "layers.1", "layers.2", "head"],
                              on_carry=masks_of_each_layer_type)


def test_sliding_window_changes_the_loss():
    """Guards the test above: with window 4 < 12 tokens the sliding mask is not the causal one."""
    torch.manual_seed(0)
    model = make("mistral", attn="eager").eval()
    ids = torch.randint(0, 128, (2, 12))
    sliding = model(input_ids=ids, labels=ids).loss
    model.config.sliding_window = None
    assert model(input_ids=ids, labels=ids).loss.item() != sliding.item()


def test_llama_batch_with_cache_or_unknown_key_is_explained():
    cut = extract_stages(make("llama", layers=1))
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"takes no \['inputs_embeds'\].*train the model unsharded"):
        cut.prepare({"input_ids": ids, "inputs_embeds": torch.zeros(1, 4, 32)})
    with pytest.raises(ValueError, match=r"takes no \['past_key_values'\]"):
        cut.prepare({"input_ids": ids, "past_key_values": None})
    with pytest.raises(TypeError, match=r"only keys in .* Fix: drop \['pixel_values'\]"):
        cut.prepare({"input_ids": ids, "pixel_values": torch.zeros(1)})


def test_gradient_checkpointing_is_refused_with_the_fix():
    model = make("qwen2", layers=3)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(every_n_layers=2)
        off = "activation_checkpointing_disable"
    else:   # transformers < 5.23 (benchmarks/compat.sh): the older name, which the fix then names
        model.gradient_checkpointing_enable()
        off = "gradient_checkpointing_disable"
    assert callable(getattr(model, off))
    with pytest.raises(ValueError, match=rf"gradient_checkpointing=True.*{off}"):
        extract_stages(model)


@pytest.mark.parametrize("family", list(_FAMILY))
def test_llama_family_trains_through_runtime_like_plain(family):
    factory = functools.partial(make, family, 3, family != "llama")  # tied for Mistral/Qwen2, untied for Llama
    budget = 900_000  # 3 shards; the last (layers.2 + head, its L unit) sets the peak
    tasks = [ht.ModelTask(factory, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                          lm_batches(3, batch=8, seq=16, seed=i), epochs=2, seed=i, name=f"{family}{i}")
             for i in range(2)]
    # residency "off": the units get the whole budget, whose peak the memory model predicts (with per-shard entries
    # the device also holds entries up to the budget: tests/test_lazy_runtime.py)
    config = ht.RuntimeConfig(devices=["cpu", "cpu"], device_memory=budget, residency="off")
    with ht.Runtime(config=config) as rt:
        handles = [rt.submit(t) for t in tasks]
        for h in handles:
            h.result()
        stats, trace = rt.stats(), rt.trace()
    for task, h in zip(tasks, handles):
        ref, _ = plain_train(task)
        assert max_param_diff(ref, h.model()) == 0.0
        assert len(stats["tasks"][task.name]["shards"]) >= 3
    predicted = max(stats["tasks"][t.name]["predicted_peak"] for t in tasks)
    check_device_peaks(stats, trace, predicted)   # the devices that ran the largest unit (L) peak as planned
