"""The memory model, unit by unit, for every supported family: predicted device bytes vs what the unit measured
(CPU accounting), within 10%. Each unit runs alone on one device (no prefetch beside it), every shard forced into
one mode, so each prediction is compared with exactly the unit it describes."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import lm_batches, make_gpt2
from reference import smallest_plan

import hydra_tune as ht
from hydra_tune.device.devices import CpuDevice

TOLERANCE = 0.10


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                        attention_dropout=0.1))


def _opt():
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM(OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=3, num_attention_heads=4,
                                    vocab_size=128, max_position_embeddings=64, word_embed_proj_dim=32))


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, vocab_size=128, max_position_embeddings=64))


FAMILIES = {"gpt2": make_gpt2, "llama": _llama, "opt": _opt, "bert": _bert}


def unit_table(factory, mode: str) -> list[tuple[str, int, int]]:
    """(unit, predicted, measured) for one minibatch with every shard but the last in ``mode``."""
    task = ht.ModelTask(factory, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), lm_batches(1), seed=0)
    state = smallest_plan(task, 300)
    k = len(state.execs)
    flags = tuple(i < k - 1 for i in range(k))
    state.plan = dataclasses.replace(state.plan, keep=(False,) * k,
                                     offload=flags if mode == "offload" else (False,) * k)
    device = CpuDevice("cpu:0", None)  # no ShardCache: every unit copies its own shard in, nothing beside it
    acct, rows = device.account, []
    segment = next(iter(state.segments(lambda m: None)))
    for unit in segment.units:
        start = acct.current
        acct.reset_peak()
        unit.run(device)
        shard = state.plan.shards[unit.shard]
        rows.append((f"{unit.kind}{unit.shard}", shard.unit_peak(unit.kind, mode), acct.peak - start))
    return rows


@pytest.mark.parametrize("mode", ["recompute", "offload"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_unit_is_predicted_within_ten_percent(family, mode):
    rows = unit_table(FAMILIES[family], mode)
    assert len(rows) >= 5
    bad = [(u, p, m) for u, p, m in rows if abs(m - p) > TOLERANCE * p]
    assert not bad, f"{family}/{mode}: (unit, predicted, measured) off by more than 10%: {bad}"
