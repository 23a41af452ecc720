"""Declared stages for a model hydra_tune cannot cut by itself: ModelTask(stages=...) and hydra_stages()."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, plain_train, trained

import hydra_tune as ht
from hydra_tune.errors import PlanError
from hydra_tune.stages import extract_stages


class Net(nn.Module):
    """A model with a non-sequential forward: a residual block and a dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.block = Residual()
        self.block2 = Residual()
        self.out = Head()

    def forward(self, x: torch.Tensor) -> dict:
        return self.out(self.block2(self.block(self.inp(x))))


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.drop = nn.Dropout(0.2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(torch.relu(self.lin(h)))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 4)

    def forward(self, h: torch.Tensor) -> dict:
        return {"pred": self.lin(h)}


class Declared(Net):
    def hydra_stages(self) -> list:
        return [("inp", self.inp), ("block", self.block), ("block2", self.block2), ("out", self.out)]


def _data(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def _loss(out: dict, batch: tuple) -> torch.Tensor:
    return F.mse_loss(out["pred"], batch[1])


def _task(model, seed: int, **kw) -> ht.ModelTask:
    return ht.ModelTask(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), _data(4, seed), loss=_loss,
                        epochs=2, seed=seed, name=f"custom-{seed}-{model.__name__}", **kw)


@pytest.mark.parametrize("how", ["argument", "method"])
def test_declared_stages_train_exactly_like_the_plain_loop(how):
    tasks = ([_task(Net, s, stages=lambda m: [m.inp, m.block, m.block2, m.out]) for s in (0, 1)] if how == "argument"
             else [_task(Declared, s) for s in (0, 1)])
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=80_000) as rt:
        handles = [rt.submit(t) for t in tasks]
        models = [trained(h) for h in handles]
        stats = rt.stats()
    for t, m in zip(tasks, models):
        assert len(stats["tasks"][t.name]["shards"]) >= 2
        assert max_param_diff(plain_train(t)[0], m) == 0.0
    assert all(d["peak_bytes"] <= d["budget"] for d in stats["devices"])


def test_stages_must_own_every_trainable_parameter():
    with pytest.raises(ValueError, match=r"hold every trainable parameter of the model, but got "
                                         r"\(missing=\['block2.lin.weight', 'block2.lin.bias'\]\)"):
        extract_stages(Net(), lambda m: [m.inp, m.block, m.out])


def test_stages_must_not_bring_foreign_parameters():
    stray = nn.Linear(64, 64)
    with pytest.raises(ValueError, match=r"every stage parameter is one of the model's, but got "
                                         r"\(stage='1:Linear', parameter='weight'\)"):
        extract_stages(Net(), lambda m: [m.inp, stray, m.block, m.block2, m.out])


def test_stages_spec_returning_a_module_is_explained():
    with pytest.raises(TypeError, match=r"returns a non-empty list of modules .* \(type=Linear\)"):
        extract_stages(Net(), lambda m: m.inp)
    with pytest.raises(TypeError, match=r"`stages` is None or callable"):
        ht.ModelTask(Net, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), _data(1, 0), stages=[1, 2])


def test_model_that_cannot_be_cut_names_the_ways_out():
    task = ht.ModelTask(Net, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), _data(2, 0), loss=_loss)
    with ht.Runtime(devices=["cpu"], device_memory=30_000) as rt:
        with pytest.raises(PlanError) as err:
            rt.submit(task)
    msg = str(err.value)
    assert "stage 'Net' (#0) alone needs" in msg
    assert "The model Net is one stage" in msg and "GPT2LMHeadModel" in msg
    assert "ModelTask(..., stages=lambda m: [m.part1, m.part2, ...])" in msg and "hydra_stages()" in msg
