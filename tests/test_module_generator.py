"""A module that draws with a ``torch.Generator`` of its own (``torch.rand(..., generator=self.gen)``): the
generator's state is Python state of the module (training/pystate.py), so a recomputing backward replays the
forward's draws, and a checkpoint carries it to the resumed task; all as in the plain loop."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, sgd_loop
from test_resume_exactness import _run
from test_state_exactness import plain

import hydra_tune as ht
from hydra_tune.policy import partition
from hydra_tune.training import checkpoint

X = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 4, (64,), generator=torch.Generator().manual_seed(2))


class OwnMask(nn.Module):
    """Masks its input in training from a generator it owns, then a layer."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(32, 32)
        self.gen = torch.Generator().manual_seed(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            x = x * (torch.rand(x.shape, generator=self.gen) > 0.3)
        return torch.relu(self.f(x))


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), OwnMask(), OwnMask(), nn.Linear(32, 4))


def _task(**kw) -> ht.ModelTask:
    return ht.ModelTask(_net, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        [(X[i:i + 8], Y[i:i + 8]) for i in range(0, 64, 8)], loss=lambda o, b: F.cross_entropy(o, b[1]),
                        epochs=2, seed=3, name="own-generator", **kw)


def _states(model: nn.Module) -> list[torch.Tensor]:
    return [m.gen.get_state() for m in model.modules() if isinstance(m, OwnMask)]


@pytest.fixture
def recompute(monkeypatch):
    """CPU stand-ins offload where two copies beat a recompute: here none is offloaded, so a tight budget
    recomputes."""
    monkeypatch.setattr(partition, "choose_offload", lambda shards, keep, bandwidth: (False,) * len(shards))


def test_a_recomputed_forward_redraws_from_the_modules_own_generator(recompute):
    # before: the recompute drew the next numbers of the generator (another mask than its forward's: max abs
    # diff 0.014), and the generator ended two draws a step ahead of the plain loop's
    expected = plain(_task())
    with ht.Runtime(devices=["cpu"], device_memory="22KiB") as rt:
        handle = rt.submit(_task())
        handle.result()
        got = handle.model()
        stats = rt.stats()["tasks"]["own-generator"]
    recomputed = [i for i, names in enumerate(stats["shards"][:-1]) if "OwnMask" in " ".join(names)
                  and i not in stats["kept"] + stats["offloaded"]]
    assert recomputed  # (the last shard's backward follows its forward in one unit)
    assert max_param_diff(expected, got) == 0.0
    assert all(torch.equal(a, b) for a, b in zip(_states(expected), _states(got)))


def test_the_generators_state_survives_a_checkpoint(tmp_path, recompute):
    # before: the resumed task's generators started over from their seed (the checkpoint did not carry them)
    whole, _, requests = _run(_task(), ask_after=(3,), path=tmp_path, budget=22_000)
    path = requests[0].wait(0)
    assert checkpoint.load(path)["position"]["epoch"] == 1
    resumed, _, _ = _run(_task(resume_from=path), budget=22_000)
    assert max_param_diff(whole.model, resumed.model) == 0.0
    assert all(torch.equal(a, b) for a, b in zip(_states(whole.model), _states(resumed.model)))


def test_a_prepared_loop_with_a_modules_own_generator_trains_exactly(recompute):
    def run(rt=None):
        model = sgd_loop(_net, X, Y, rt)
        return {k: v.clone() for k, v in model.state_dict().items()}, _states(model)

    want = run()
    with ht.Runtime(devices=["cpu"], device_memory="22KiB") as rt:
        got = run(rt)
    assert all(torch.equal(want[0][k], got[0][k]) for k in want[0])
    assert all(torch.equal(a, b) for a, b in zip(want[1], got[1]))
