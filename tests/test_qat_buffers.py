"""Buffers whose shape a forward changes: quantization-aware training's observers (torch.ao.quantization) make their
running min/max per channel at their first forward. Units write a forward's buffers back into the model's own
(training/shard.py), and a retried minibatch puts them back (store.py put_buffer): both take the new shape."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, plain_train

import hydra_tune as ht
from hydra_tune.policy import partition


def _qat_model() -> nn.Module:
    import torch.ao.quantization as tq

    model = nn.Sequential(tq.QuantStub(), nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 4), tq.DeQuantStub())
    model.train()
    model.qconfig = tq.get_default_qat_qconfig("fbgemm")
    return tq.prepare_qat(model)


def _task() -> ht.ModelTask:
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(4)]
    return ht.ModelTask(_qat_model, lambda m: torch.optim.SGD(m.parameters(), lr=0.05), data,
                        loss=lambda out, b: F.cross_entropy(out, b[1]), epochs=2, seed=3, name="qat")


@pytest.mark.parametrize("budget", [None, "115KiB"])   # resident; three shards whose backwards recompute
def test_quantization_aware_training_trains_as_the_plain_loop(budget, monkeypatch):
    # before: the first unit failed ("output with shape [1] doesn't match the broadcast shape [64]") writing the
    # observers' per-channel buffers back into the model's empty ones
    monkeypatch.setattr(partition, "choose_offload", lambda shards, keep, bandwidth: (False,) * len(shards))
    want, _ = plain_train(_task())
    with ht.Runtime(devices=["cpu"], device_memory=budget) as rt:
        handle = rt.submit(_task())
        handle.result()
        shards = len(rt.stats()["tasks"]["qat"]["shards"])
    got = handle.model()
    assert shards == (1 if budget is None else 3)
    assert max_param_diff(want, got) == 0.0
    for (name, a), b in zip(want.named_buffers(), got.buffers()):
        assert a.shape == b.shape and torch.equal(a, b), name
