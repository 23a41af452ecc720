"""State a forward keeps outside its parameters ends as in the plain loop, or is refused: buffers changed in place
(BatchNorm) or by reassignment (an EMA, a counter), Python attributes (a call counter annealing a temperature, a
list), the state of forward hooks (a closure counter), torch's parametrizations and norm hooks; unsharded, sharded
in each backward mode, with evaluation and after an out-of-memory retry. Submitting a task (the cost profile, the
footprint estimate) changes nothing of the user's objects."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hydra_tune as ht
from hydra_tune.device.devices import CpuDevice
from hydra_tune.training.residency import ShardCache
from hydra_tune.training.state import TaskState


class EmaCount(nn.Module):
    """Buffers updated by reassignment: an EMA of the input (training only) that the output uses, and a counter
    of every forward (training and eval)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.register_buffer("ema", torch.zeros(n))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.ema = 0.9 * self.ema + 0.1 * x.detach().mean(0)
        self.count = self.count + 1
        return self.lin(x - self.ema) * (1.0 + 0.01 * self.count)


class Annealed(nn.Module):
    """Python state changed by forward: a call counter annealing a temperature, and a list whose length scales."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.calls = 0
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            self.seen.append(x.shape[0])
        return self.lin(x) / (1.0 + 0.1 * self.calls + 0.01 * len(self.seen))


def _hooked_linear(n: int) -> nn.Linear:
    """A Linear whose forward pre-hook keeps state in its closure (a counter scaling the input)."""
    lin = nn.Linear(n, n)
    calls = 0

    def pre_hook(module: nn.Module, args: tuple) -> tuple:
        nonlocal calls
        calls += 1
        return (args[0] * (1.0 + 0.02 * calls),)

    lin.register_forward_pre_hook(pre_hook)
    lin.hook_calls = lambda: calls  # type: ignore[attr-defined]  (read by the tests)
    return lin


def stateful_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), EmaCount(32), nn.ReLU(), Annealed(32), nn.BatchNorm1d(32), nn.ReLU(),
                         _hooked_linear(32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _data(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def _loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.mse_loss(out, batch[1])


def _task(factory: Any = stateful_model, eval_data: Any = None, **kw: Any) -> ht.ModelTask:
    return ht.ModelTask(factory, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), _data(4, 1),
                        loss=_loss, eval_data=eval_data, epochs=2, seed=3, **kw)


def plain(task: ht.ModelTask) -> nn.Module:
    """The user's own loop: train each epoch, then evaluate it in eval mode without autograd."""
    torch.manual_seed(task.seed)
    model = task.model()
    model.train()
    opt = task.optimizer(model)
    for _ in range(task.epochs):
        for i, batch in enumerate(task.train_data):
            loss = task.loss(model(batch[0]), batch) / task.grad_accumulation
            loss.backward()
            if (i + 1) % task.grad_accumulation == 0:
                opt.step()
                opt.zero_grad()
        if task.eval_data is not None:
            model.eval()
            with torch.no_grad():
                for batch in task.eval_data:
                    task.loss(model(batch[0]), batch)
            model.train()
    return model


def python_state(model: nn.Module) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, m in model.named_modules():
        if isinstance(m, Annealed):
            out[name] = (m.calls, list(m.seen))
        if hasattr(m, "hook_calls"):
            out[name] = m.hook_calls()
    return out


def assert_same_state(expected: nn.Module, got: nn.Module) -> None:
    """Every parameter and buffer (integer ones too) equal bit for bit, and the Python state equal."""
    a, b = expected.state_dict(), got.state_dict()
    assert a.keys() == b.keys()
    diffs = {k: (a[k].double() - b[k].double()).abs().max().item() for k in a if not torch.equal(a[k], b[k])}
    assert diffs == {}, diffs
    assert python_state(expected) == python_state(got)


def run_forced(task: ht.ModelTask, budget: int, mode: str) -> TaskState:
    """Build ``task`` for ``budget`` and run all its segments on one CPU device with every shard but the last in
    ``mode`` (recompute, keep or offload)."""
    state = TaskState.build(task, budget)
    k = len(state.execs)
    assert k >= 3, state.plan
    flags = tuple(i < k - 1 for i in range(k))
    state.plan = dataclasses.replace(state.plan, keep=flags if mode == "keep" else (False,) * k,
                                     offload=flags if mode == "offload" else (False,) * k)
    device = CpuDevice("cpu:0", None)
    device.resident = ShardCache()
    for seg in state.segments(lambda m: None):
        for unit in seg.units:
            unit.run(device)
    device.resident.clear()
    return state


SHARDED = 20_000  # bytes: the stateful model in 5+ shards, EmaCount, Annealed and the hook in non-last ones


# -- buffers and Python state: unsharded, sharded, eval, out-of-memory ------------------------------------------
def test_unsharded_with_eval_matches_plain():
    task = _task(eval_data=_data(2, 9))
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        got = rt.submit(task).model()
    assert_same_state(plain(task), got)


@pytest.mark.parametrize("mode", ["recompute", "keep", "offload"])
def test_sharded_each_backward_mode_with_eval_matches_plain(mode):
    task = _task(eval_data=_data(2, 9))
    state = run_forced(task, SHARDED, mode)
    last = state.execs[-1].names
    assert not {"1:EmaCount", "3:Annealed", "4:BatchNorm1d", "6:Linear"} & set(last), last  # all in F/B shards
    assert_same_state(plain(task), state.model)


def test_sharded_grad_accumulation_on_runtime_matches_plain():
    task = _task(grad_accumulation=2)
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=SHARDED) as rt:
        h = rt.submit(task)
        got = h.model()
        assert len(rt.stats()["tasks"][task.name]["shards"]) >= 3
    assert_same_state(plain(task), got)


@pytest.mark.parametrize("budget,share", [(40_000, 0.7), (None, 0.5)])  # 3 shards -> 5; 1 -> 2 -> 7
def test_out_of_memory_retry_applies_each_update_once(budget, share):
    task = _task(eval_data=_data(1, 9))
    with ht.Runtime(devices=["cpu"], device_memory=budget) as rt:
        h = rt.submit(task)
        peak = rt.stats()["tasks"][task.name]["predicted_peak"]
        rt.devices[0].limit_memory(int(share * peak))  # a later unit fails after the stateful forwards ran
        got = h.model()
        assert rt.stats()["tasks"][task.name]["replans"] >= 1
    assert_same_state(plain(task), got)


# -- submit touches nothing of the user's objects -----------------------------------------------------------------
def test_a_python_counter_in_forward_trains_like_plain():
    def factory() -> nn.Module:
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), Annealed(32), nn.Linear(32, 4))

    task = _task(factory)
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        got = rt.submit(task).model()
    expected = plain(task)
    assert_same_state(expected, got)
    assert got[2].calls == 8  # 4 batches, 2 epochs: the profile's forwards did not count


def test_submit_and_footprint_leave_the_users_model_as_it_was():
    from hydra_tune.training.footprint import estimate_footprint

    model = stateful_model()
    model[6].weight.grad = torch.ones_like(model[6].weight)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    task = _task(model)
    rng = torch.get_rng_state()
    estimate_footprint(task, budget=SHARDED)
    TaskState.build(task, SHARDED)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert python_state(model) == {"3": (0, []), "6": 0}
    assert torch.equal(model[6].weight.grad, torch.ones_like(model[6].weight))
    assert all(p.grad is None for n, p in model.named_parameters() if not n.startswith("6."))
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training and all(m.training for m in model.modules())
