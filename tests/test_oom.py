"""Device out-of-memory during a unit: the task is re-planned smaller, its minibatch runs again, and it ends with
the weights it would have had without the out-of-memory. CPU devices raise a real torch.OutOfMemoryError from
their allocation accounting once a test-only limit is set (``CpuDevice.limit_memory``)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import lm_batches, make_gpt2
from reference import SqueezingLoss, max_param_diff, plain_train

import hydra_tune as ht
from hydra_tune.errors import PlanError

BUDGET = 800 * 1024


def _gpt2_task(seed: int, **kw) -> ht.ModelTask:
    return ht.ModelTask(make_gpt2, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), lm_batches(3, seed=seed),
                        eval_data=lm_batches(1, seed=50 + seed), epochs=2, grad_clip_norm=1.0, seed=seed,
                        name=f"gpt2-{seed}", **kw)


def test_out_of_memory_replans_and_ends_bit_identical():
    # residency "off": the units get the whole budget, so 60% of their peak is too little for them (planned for
    # per-shard entries, their peak leaves room for the entries: tests/test_lazy_runtime.py runs out of memory there)
    with ht.Runtime(config=ht.RuntimeConfig(devices=["cpu", "cpu"], device_memory=BUDGET, residency="off")) as rt:
        # the device holds less than it was said to: the first plans' larger units no longer fit on it. The first
        # training unit to compute a loss there leaves it no room (it runs out of memory then, after its forwards),
        # then it has 60% of the largest predicted peak (not 60% at once: whether a unit went past it depended on
        # when the copy thread's prefetch landed; reference.SqueezingLoss)
        loss = SqueezingLoss(lambda out, batch: out.loss, rt.devices[0], 0.6)  # as the model's own loss
        tasks = [_gpt2_task(s, loss=loss) for s in (1, 2, 3)]
        handles = [rt.submit(t) for t in tasks]
        first = rt.stats()["tasks"]
        loss.arm(max(t["predicted_peak"] for t in first.values()))
        results = [(h, list(h.metrics())) for h in handles]
        assert loss.squeezed
        stats = rt.stats()
    replanned = [n for n, t in stats["tasks"].items() if t["replans"]]
    assert replanned, "the limit should have driven at least one task out of memory"
    for name in replanned:   # a re-plan fits at most 95% of the failed plan's predicted peak
        assert stats["tasks"][name]["predicted_peak"] <= 0.95 * first[name]["predicted_peak"]
    for task, (h, metrics) in zip(tasks, results):
        assert h.status == "done"
        model, history = plain_train(task)
        assert max_param_diff(model, h.model()) == 0.0, task.name
        assert [m["train_loss"] for m in metrics] == history


def _bn_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 128),
                         nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 4))


def test_retried_minibatch_restores_batchnorm_statistics_and_dropout():
    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(4)]
    with ht.Runtime(devices=["cpu"], device_memory=300_000) as rt:   # 3 shards; BatchNorm in the first two
        # the L unit fails, after both BatchNorms ran: its loss leaves the device no room, then the device has 90% of
        # the predicted peak (not 90% at once, right after submit: whether the L unit then went past it depended on
        # the copy thread's prefetch of the next shard landing during it; reference.SqueezingLoss)
        loss = SqueezingLoss(lambda out, b: F.mse_loss(out, b[1]), rt.devices[0], 0.9)
        task = ht.ModelTask(_bn_mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), data,
                            loss=loss, epochs=2, seed=3, grad_accumulation=2)
        h = rt.submit(task)
        loss.arm(rt.stats()["tasks"][task.name]["predicted_peak"])
        h.result()
        assert loss.squeezed
        replans = rt.stats()["tasks"][task.name]["replans"]
    assert replans >= 1
    model, _ = plain_train(task)
    assert max_param_diff(model, h.model()) == 0.0
    for a, b in zip(model.buffers(), h.model().buffers()):
        assert torch.equal(a, b)   # running statistics updated once per minibatch, not once per attempt


def test_stage_that_cannot_fit_even_alone_fails_that_task_only():
    with ht.Runtime(devices=["cpu"], device_memory=BUDGET) as rt:
        victim = rt.submit(_gpt2_task(1))
        rt.devices[0].limit_memory(64 * 1024)   # far below any single GPT-2 block
        with pytest.raises(PlanError) as err:
            victim.result()
        rt.devices[0].limit_memory(None)
        healthy = _gpt2_task(2)
        h = rt.submit(healthy)
        h.result()
        assert rt.devices[0].current_bytes() == 0
    msg = str(err.value)
    assert msg.startswith("task 'gpt2-1' ran out of device memory on cpu:0 in unit ")
    assert "re-planning it for" in msg and "alone needs" in msg and "Fix:" in msg
    model, _ = plain_train(healthy)
    assert max_param_diff(model, h.model()) == 0.0
