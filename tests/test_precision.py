"""Mixed precision: bf16/fp16 autocast through the runtime equals the plain autocast loop; fp16 loss scaling
behaves like torch.amp.GradScaler, per task (an inf step is skipped for that task only)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import lm_batches, make_gpt2
from reference import max_param_diff, plain_train, trained

import hydra_tune as ht


def _gpt2_task(i: int, precision: str) -> ht.ModelTask:
    return ht.ModelTask(make_gpt2, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), lm_batches(4, seed=i),
                        epochs=2, grad_clip_norm=1.0, seed=i, precision=precision, name=f"{precision}-{i}")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_sharded_mixed_precision_matches_plain_autocast(precision):
    tasks = [_gpt2_task(i, precision) for i in range(2)]
    with ht.Runtime(devices=["cpu", "cpu"], device_memory="500KiB") as rt:
        handles = [rt.submit(t) for t in tasks]
        results = [(trained(h), list(h.metrics())) for h in handles]
        stats = rt.stats()
    for t, (model, metrics) in zip(tasks, results):
        assert len(stats["tasks"][t.name]["shards"]) >= 3
        ref, history = plain_train(t)
        diff = max_param_diff(ref, model)
        print(f"{t.name}: max|w - w_plain| = {diff:.3g}")
        assert diff == 0.0  # the same ops in the same order on the same device: bit for bit
        assert [m["train_loss"] for m in metrics] == history
        if precision == "fp16":
            assert metrics[-1]["loss_scale"] == ref.final_loss_scale
    assert all(d["peak_bytes"] <= d["budget"] for d in stats["devices"])


class _Mlp(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))


def _mlp_task(name: str, huge_batch: bool) -> ht.ModelTask:
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(3)]
    if huge_batch:  # fp16 overflows (max 65504): inf gradients, so GradScaler skips this step and backs off
        data[1] = (data[1][0] * 1e6, data[1][1])
    return ht.ModelTask(_Mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), data, epochs=2, seed=1,
                        loss=lambda out, b: F.mse_loss(out.float(), b[1]), precision="fp16", name=name)


def test_fp16_inf_step_is_skipped_for_that_task_only():
    bad, good = _mlp_task("overflows", True), _mlp_task("fine", False)
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=None) as rt:
        hb, hg = rt.submit(bad), rt.submit(good)
        bad_metrics, good_metrics = list(hb.metrics()), list(hg.metrics())
        bad_model, good_model = hb.model(), hg.model()
    ref_bad, _ = plain_train(bad)
    ref_good, _ = plain_train(good)
    assert bad_metrics[-1]["loss_scale"] == ref_bad.final_loss_scale
    assert good_metrics[-1]["loss_scale"] == ref_good.final_loss_scale
    # The overflowing batch backs off the scale of its own task, and of no other.
    assert bad_metrics[-1]["loss_scale"] < good_metrics[-1]["loss_scale"]
    assert max_param_diff(ref_bad, bad_model) == 0.0
    assert max_param_diff(ref_good, good_model) == 0.0
    assert torch.isfinite(torch.cat([p.flatten() for p in bad_model.parameters()])).all()


def test_unknown_precision_is_named():
    with pytest.raises(ValueError, match=r"`precision` in \('fp32', 'bf16', 'fp16'\).*precision='fp8'"):
        ht.ModelTask(_Mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), [], precision="fp8")
