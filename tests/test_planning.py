"""Shape-only planning on the meta device: the same bytes as measuring real tensors, and no weights built."""
from __future__ import annotations

import subprocess
import sys

import torch
from conftest import lm_batches, make_gpt2

import hydra_tune as ht
from hydra_tune.config import parse_bytes
from hydra_tune.policy.partition import partition
from hydra_tune.stages import extract_stages
from hydra_tune.training.profile import measure_costs


def test_meta_plan_equals_the_plan_measured_on_real_tensors():
    batch = lm_batches(1)[0]
    for budget in ("500KiB", "800KiB", None):
        meta = ht.plan_model(make_gpt2, batch, budget)
        torch.manual_seed(0)
        real_costs = measure_costs(extract_stages(make_gpt2()), batch)
        real = partition(real_costs, parse_bytes(budget), keep=False)
        assert [s.names for s in meta.shards] == [s.names for s in real.shards]
        assert meta.peak == real.peak
        assert [(s.forward_peak, s.backward_peak, s.state_bytes) for s in meta.shards] == [
            (s.forward_peak, s.backward_peak, s.state_bytes) for s in real.shards]


_SIX_B = """
import resource, sys, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
import hydra_tune as ht
cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, vocab_size=32000)
ids = torch.zeros(1, 512, dtype=torch.long)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
plan = ht.plan_model(lambda: LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}, "20GiB", precision="bf16")
seconds = time.perf_counter() - t0
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
params = sum(s.state_bytes for s in plan.shards) / 4
print(len(plan.shards), round(seconds, 2), round(grown), int(params), plan.peak)
"""


def test_six_billion_parameter_plan_takes_seconds_and_no_weights():
    out = subprocess.run([sys.executable, "-c", _SIX_B], capture_output=True, text=True, check=True)
    shards, seconds, grown_mib, params, peak = out.stdout.split()
    assert int(params) > 6_000_000_000 * 0.99  # the fp32 weights the plan accounts for: about 6.7e9 parameters
    assert int(shards) >= 2 and int(peak) <= 20 * 2**30
    assert float(seconds) < 20, seconds
    assert int(grown_mib) < 1024, f"planning grew the process by {grown_mib} MiB: weights were allocated"
