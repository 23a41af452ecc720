"""Isolation: a task that raises, whose loss goes NaN or that runs out of device memory fails alone, its error reported to its own handle; every
other task ends bit-identical to a run without it and to plain PyTorch (GPT-2 with dropout, sharded, 2 devices)."""
from __future__ import annotations

import gc

import pytest
import torch
from conftest import lm_batches, make_gpt2
from reference import max_param_diff, plain_train

import hydra_tune as ht
from hydra_tune.errors import NonFiniteLoss

DEVICES, BUDGET = ["cpu", "cpu"], "600KiB"  # GPT-2 (4 blocks) needs >= 2 shards under this budget


def _adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-3)


def _healthy(i: int) -> ht.ModelTask:
    return ht.ModelTask(make_gpt2, _adamw, lm_batches(4, seed=i), epochs=2, grad_clip_norm=1.0, seed=10 + i,
                        name=f"ok-{i}")


class CorruptRecord(Exception):
    """What a user's data pipeline raises on a bad record."""


class _BreaksAtThirdBatch:
    """Data whose iterator raises on its third batch (every epoch)."""

    def __init__(self) -> None:
        self.batches = lm_batches(4, seed=20)

    def __iter__(self):
        for i, batch in enumerate(self.batches):
            if i == 2:
                raise CorruptRecord("record 2 of shard-00017 is truncated")
            yield batch


def _failing() -> list[ht.ModelTask]:
    data = lm_batches(4, seed=21)
    poison = data[2]["input_ids"].clone()

    def loss_raising_on_third_batch(outputs, batch):
        if torch.equal(batch["input_ids"], poison):
            raise ValueError("no label smoothing table for this vocabulary")
        return outputs.loss

    nan_data = lm_batches(4, seed=22)
    nan_data[2]["labels"][:] = -100  # every label ignored: the mean over no tokens is NaN, as in plain PyTorch
    # Planned from its first batch (4 x 16 tokens), its third batch is 64 x 32 tokens: a real out-of-memory on the
    # device (whose memory is its budget, test-only limit), re-planned until even one stage cannot hold it.
    long_data = lm_batches(4, seed=24)
    long_data[2] = lm_batches(1, batch=64, seq=32, seed=25)[0]
    return [ht.ModelTask(make_gpt2, _adamw, data, loss=loss_raising_on_third_batch, epochs=2, seed=21,
                         name="raises-in-loss"),
            ht.ModelTask(make_gpt2, _adamw, _BreaksAtThirdBatch(), epochs=2, seed=22, name="raises-in-data"),
            ht.ModelTask(make_gpt2, _adamw, nan_data, epochs=2, seed=23, name="nan-loss"),
            ht.ModelTask(make_gpt2, _adamw, long_data, epochs=2, seed=24, name="out-of-memory")]


def _run(tasks: list[ht.ModelTask]) -> tuple[dict[str, ht.TaskHandle], dict]:
    with ht.Runtime(devices=DEVICES, device_memory=BUDGET) as rt:
        for d in rt.devices:   # the devices really hold their budget, no more: past it, torch.OutOfMemoryError
            d.limit_memory(d.budget)
        handles = {t.name: rt.submit(t) for t in tasks}
        for h in handles.values():
            try:
                h.result(timeout=120)
            except Exception:
                pass
        gc.collect()
        stats = rt.stats()
    return handles, stats


def _reported(handle: ht.TaskHandle) -> list[dict]:
    seen: list[dict] = []
    with pytest.raises(Exception):
        for m in handle.metrics():
            seen.append(m)
    return seen


def test_failing_tasks_fail_alone_and_the_others_end_bit_identical():
    healthy = [_healthy(i) for i in range(3)]
    failing = _failing()
    mixed = [healthy[0], failing[0], healthy[1], failing[1], failing[3], failing[2], healthy[2]]
    handles, stats = _run(mixed)

    with pytest.raises(ValueError) as err:
        handles["raises-in-loss"].result()
    assert type(err.value) is ValueError and str(err.value) == "no label smoothing table for this vocabulary"
    assert err.value.__notes__[0].startswith("Raised in task 'raises-in-loss' in a hydra_tune device worker:\n")
    with pytest.raises(CorruptRecord) as err:
        handles["raises-in-data"].result()
    assert str(err.value) == "record 2 of shard-00017 is truncated"
    assert err.value.__notes__[0].startswith("Raised in task 'raises-in-data' in a hydra_tune device worker:\n")
    with pytest.raises(NonFiniteLoss) as err:
        handles["nan-loss"].result()
    assert str(err.value) == (
        "the training loss is finite (nonfinite_loss='fail') must hold, but got (task='nan-loss', epoch=1, "
        "batch_in_epoch=3, steps_done=2, loss=nan). Fix: lower the learning rate, clip gradients "
        "(grad_clip_norm=1.0), check that batch for inf/NaN inputs or labels that are all ignored (-100), or pass "
        "nonfinite_loss='skip_step' to drop such batches ('ignore' trains on them).")
    with pytest.raises(ht.HydraError) as err:
        handles["out-of-memory"].result()
    assert str(err.value).startswith("task 'out-of-memory' ran out of device memory on cpu:")
    assert "Fix:" in str(err.value)
    assert stats["tasks"]["out-of-memory"]["replans"] >= 1
    for t in failing:
        assert handles[t.name].status == "failed" and stats["tasks"][t.name]["state"] == "failed"
        assert _reported(handles[t.name]) == []  # failed in epoch 1: no epoch was reported
    assert all(len(stats["tasks"][t.name]["shards"]) >= 2 for t in mixed)
    assert all(d["current_bytes"] == 0 and d["peak_bytes"] <= d["budget"] for d in stats["devices"])

    alone, _ = _run([_healthy(i) for i in range(3)])  # a fresh runtime, the healthy tasks only
    for t in healthy:
        got, ref = handles[t.name].model().state_dict(), alone[t.name].model().state_dict()
        assert all(torch.equal(got[k], ref[k]) for k in ref), t.name
        plain, history = plain_train(t)
        assert max_param_diff(plain, handles[t.name].model()) == 0.0, t.name
        assert [m["train_loss"] for m in handles[t.name].metrics()] == history
