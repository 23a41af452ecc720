"""ModelTask(nonfinite_loss=...): a NaN/inf training loss fails the task where it happened ("fail", the default),
drops the minibatch exactly as the plain loop's `if not torch.isfinite(loss): optimizer.zero_grad(); continue`
("skip_step"), or is trained on as a plain loop would ("ignore"; the fp16 default, where the GradScaler skips it)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, plain_train

import hydra_tune as ht
from hydra_tune.errors import NonFiniteLoss


BUDGET = 20_000  # the MLP below needs 2 or more shards under it


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 2))


def _mse(out, batch):
    return F.mse_loss(out.float(), batch[1])


def _momentum(m: nn.Module) -> torch.optim.Optimizer:  # a step on zero gradients still moves: a skip must skip
    return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)


def _data(n: int, bad: dict[int, float]) -> list:
    """``n`` batches; batch i (0-based) in ``bad`` gets that value (nan, inf) in its targets, so its loss is it."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
        if i in bad:
            y[0, 0] = bad[i]
        out.append((x, y))
    return out


def _inf_the_second_time(data: list, index: int):
    """A loss that is inf the second time it sees ``data[index]`` (epoch 2; the profile at submit uses only the
    first batch)."""
    seen = [0]

    def loss(out, batch):
        value = _mse(out, batch)
        if torch.equal(batch[0], data[index][0]):
            seen[0] += 1
            if seen[0] == 2:
                return value * math.inf
        return value

    return loss


def test_fail_names_task_epoch_batch_step_and_value():
    # grad_accumulation=2, 4 batches an epoch: epoch 1 makes steps 1-2, epoch 2's batches 1-2 step 3; batch 3 is bad.
    data = _data(4, {})
    task = ht.ModelTask(_mlp, _momentum, data, loss=_inf_the_second_time(data, 2), epochs=3, grad_accumulation=2,
                        name="diverges")
    assert task.nonfinite_loss == "fail"
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=BUDGET) as rt:
        h = rt.submit(task)
        with pytest.raises(NonFiniteLoss) as err:
            h.result(timeout=60)
        assert len(rt.stats()["tasks"]["diverges"]["shards"]) >= 2
    assert str(err.value) == (
        "the training loss is finite (nonfinite_loss='fail') must hold, but got (task='diverges', epoch=2, "
        "batch_in_epoch=3, steps_done=3, loss=inf). Fix: lower the learning rate, clip gradients "
        "(grad_clip_norm=1.0), check that batch for inf/NaN inputs or labels that are all ignored (-100), or pass "
        "nonfinite_loss='skip_step' to drop such batches ('ignore' trains on them).")
    assert isinstance(err.value, ht.HydraError) and isinstance(err.value, FloatingPointError)


@pytest.mark.parametrize("accumulation", [1, 3])
def test_skip_step_equals_the_plain_loop_that_skips(accumulation):
    # Bad batches: the second (mid-window for k=3), and the last of the epoch (no step may follow it).
    data = _data(7, {1: math.nan, 6: math.inf})
    task = ht.ModelTask(_mlp, _momentum, data, loss=_mse, epochs=2, grad_accumulation=accumulation,
                        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5), seed=3,
                        nonfinite_loss="skip_step", name=f"skips-k{accumulation}")
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=BUDGET) as rt:
        h = rt.submit(task)
        metrics = list(h.metrics())
        assert len(rt.stats()["tasks"][task.name]["shards"]) >= 2
    ref, history = plain_train(task)
    assert max_param_diff(ref, h.model()) == 0.0
    assert [m["train_loss"] for m in metrics] == history
    assert [m["skipped_batches"] for m in metrics] == [2, 2]
    steps_per_epoch = {1: 5, 3: 1}[accumulation]  # k=3: [0 X] dropped, [2 3 4] steps, [5 X] dropped
    assert metrics[-1]["steps"] == 2 * steps_per_epoch
    assert metrics[-1]["samples"] == 2 * 5 * 4


def test_ignore_trains_on_the_nan_like_a_plain_loop():
    task = ht.ModelTask(_mlp, _momentum, _data(3, {1: math.nan}), loss=_mse, nonfinite_loss="ignore",
                        name="ignores")
    with ht.Runtime(devices=["cpu"], device_memory=BUDGET) as rt:
        h = rt.submit(task)
        metrics = h.result()
    ref, _ = plain_train(task)
    got = h.model().state_dict()
    assert math.isnan(metrics["train_loss"])
    assert all(torch.equal(got[k].isnan(), v.isnan()) and torch.equal(got[k].nan_to_num(), v.nan_to_num())
               for k, v in ref.state_dict().items())


def _fp16_overflow(**kw) -> ht.ModelTask:
    data = _data(3, {})
    data[1] = (data[1][0] * 1e6, data[1][1])  # beyond fp16's 65504: the forward overflows, the loss is NaN
    return ht.ModelTask(_mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), data, loss=_mse, epochs=2,
                        precision="fp16", name="fp16", **kw)


def test_fp16_default_leaves_the_nan_to_the_grad_scaler():
    task = _fp16_overflow()
    assert task.nonfinite_loss == "ignore"
    with ht.Runtime(devices=["cpu"]) as rt:
        h = rt.submit(task)
        metrics = list(h.metrics())
    ref, history = plain_train(task)
    assert math.isnan(metrics[0]["train_loss"]) and metrics[-1]["loss_scale"] == ref.final_loss_scale < 2.0**16
    assert max_param_diff(ref, h.model()) == 0.0  # the overflowing steps were skipped, the weights are finite


def test_fp16_fail_on_request_suggests_bf16():
    with ht.Runtime(devices=["cpu"]) as rt:
        h = rt.submit(_fp16_overflow(nonfinite_loss="fail"))
        with pytest.raises(NonFiniteLoss) as err:
            h.result(timeout=60)
    assert str(err.value) == (
        "the training loss is finite (nonfinite_loss='fail') must hold, but got (task='fp16', epoch=1, "
        "batch_in_epoch=2, steps_done=1, loss=nan). Fix: lower the learning rate, clip gradients "
        "(grad_clip_norm=1.0), check that batch for inf/NaN inputs or labels that are all ignored (-100), use "
        "precision='bf16' (fp16 overflows above 65504) or leave nonfinite_loss=None, or pass "
        "nonfinite_loss='skip_step' to drop such batches ('ignore' trains on them).")


def test_eval_losses_are_reported_not_checked():
    task = ht.ModelTask(_mlp, _momentum, _data(2, {}), loss=_mse, eval_data=_data(2, {0: math.nan}),
                        name="nan-eval")
    with ht.Runtime(devices=["cpu"]) as rt:
        metrics = rt.submit(task).result()
    assert math.isfinite(metrics["train_loss"]) and math.isnan(metrics["eval_loss"])
