"""A prepared model's modules, parameters and buffers stay the ones it was prepared with: what swaps one without
passing through the prepared model (``torch.func.functional_call``, a parametrization, an assignment on a submodule
the user holds) is refused at the next forward, naming the swapped slots. Before the check the units ran the
planned tensors and silently ignored the swapped ones on a tight budget (and, under ``no_grad``, on any budget).
A refused call leaves the trial as it was: the loop goes on and ends exact against the plain loop (max abs
difference 0.0, fp32 on CPU), on a runtime where the state stays on its device and on one with a tight budget."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hydra_tune as ht

X = torch.randn(48, 16, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 4, (48,), generator=torch.Generator().manual_seed(2))
SWAPPED = "keeps the modules, parameters and buffers it was prepared with in their places"


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


@pytest.fixture(scope="module", params=["64MiB", "12KiB"], ids=["resident", "tight-budget"])
def rt(request):
    with ht.Runtime(devices=["cpu"], device_memory=request.param) as runtime:
        yield runtime


def _loop(make, between, rt=None, steps: int = 6) -> dict:
    """A plain classifier loop; ``between(model, step)`` runs after each step; ``rt``: prepared there."""
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if rt is not None:
        model, opt = ht.prepare(model, opt, runtime=rt)
    for s in range(steps):
        loss = F.cross_entropy(model(X[s * 8:(s + 1) * 8]), Y[s * 8:(s + 1) * 8])
        opt.zero_grad()
        loss.backward()
        opt.step()
        between(model, s)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if rt is not None:
        model.release()
    return state


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) == 0.0


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_functional_call_with_other_weights_is_refused_and_the_trial_goes_on(rt, grad):
    # before: the call returned the output of the trial's own weights (tight budget; resident under no_grad)
    refused = []

    def between(model, step):
        if step != 2 or not hasattr(model, "hydra_task"):   # the prepared loop only (the plain one would run it)
            return
        params = {"3.weight": torch.zeros(4, 32)}
        model.eval()
        with torch.set_grad_enabled(grad), pytest.raises(RuntimeError, match=SWAPPED) as info:
            torch.func.functional_call(model, params, (X[:8],))
        model.train()
        refused.append(str(info.value))
    _same(_loop(_mlp, between), _loop(_mlp, between, rt))
    assert len(refused) == 1 and "changed=['3.weight']" in refused[0] and "copy.deepcopy(model)" in refused[0]


def test_functional_call_over_buffers_only_is_refused(rt):
    model, _ = _prepared(rt)
    model(X[:8])
    model.eval()
    with torch.no_grad(), pytest.raises(RuntimeError, match=SWAPPED + r".*changed=\['1.running_mean'\]"):
        torch.func.functional_call(model, {"1.running_mean": torch.ones(32)}, (X[:8],))
    model.release()


def _prepared(rt):
    model = _mlp()
    return ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), runtime=rt)


@pytest.mark.parametrize("swap, changed", [
    (lambda net: setattr(net[3], "weight", nn.Parameter(torch.zeros(4, 32))), "'3.weight'"),
    (lambda net: setattr(net, "2", nn.Tanh()), "'2'"),
    (lambda net: torch.nn.utils.parametrize.register_parametrization(net[3], "weight", _Half()),
     "'3.weight', '3 (slots added)'"),
    (lambda net: net[1].register_buffer("extra", torch.zeros(1)), "'1 (slots added)'"),
], ids=["parameter", "module", "parametrize", "new-buffer"])
def test_a_slot_swapped_on_a_submodule_the_user_holds_is_refused_at_the_next_forward(rt, swap, changed):
    net = _mlp()
    model, _ = ht.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), runtime=rt)
    model(X[:8])
    swap(net)  # the user's own reference to the model: the prepared model never sees this call
    with pytest.raises(RuntimeError, match=SWAPPED) as info:
        model(X[:8])
    assert f"changed=[{changed}]" in str(info.value)
    model.release()


class _Half(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * 0.5

    def right_inverse(self, w: torch.Tensor) -> torch.Tensor:
        return w * 2.0


class Counting(nn.Module):
    """A forward that reassigns its own buffer (not a swap: the plain loop does the same)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        return self.lin(x) * (1 + 0.01 * self.calls)


def test_a_forward_that_reassigns_its_own_buffer_trains_exactly(rt):
    state = _loop(Counting, lambda model, step: None, rt)
    _same(_loop(Counting, lambda model, step: None), state)
    assert state["calls"].item() == 6
