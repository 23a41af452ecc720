"""hydra_tune.prepare: what the user's loop does with a prepared model's output on its own side of the graph.

In-place ops on the output (``logits /= T``), loss terms over the parameters (an explicit L2 penalty), and the
backwards the bridge cannot see (``loss.backward(inputs=...)``: autograd then skips the model, whose parameters
are not on the user's graph), each against the same loop without ``prepare``.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hydra_tune as ht

X = torch.randn(48, 16, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 4, (48,), generator=torch.Generator().manual_seed(2))
BUDGETS = ["64MiB", "12KiB"]  # the state resident on the device; spilled, one layer a shard


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))


def _run(loop, budget: str | None) -> tuple[dict, list]:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if budget is None:
        return loop(model, opt)
    with ht.Runtime(devices=["cpu"], device_memory=budget) as rt:
        model, opt = ht.prepare(model, opt, runtime=rt)
        out = loop(model, opt)
        model.release()
    return out


def _same(a: tuple[dict, list], b: tuple[dict, list]) -> bool:
    return a[1] == b[1] and all(torch.equal(a[0][k], b[0][k]) for k in a[0])


def inplace_output_loop(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, list]:
    """A temperature applied in place to the logits, then a clamp in place; an L2 penalty over the parameters."""
    losses = []
    for s in range(6):
        logits = model(X[s * 8:(s + 1) * 8])
        logits /= 2.0
        logits.clamp_(-3.0, 3.0)
        loss = F.cross_entropy(logits, Y[s * 8:(s + 1) * 8]) + 1e-2 * sum(p.pow(2).sum() for p in model.parameters())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.clone() for k, v in model.state_dict().items()}, losses


@pytest.mark.parametrize("budget", BUDGETS)
def test_in_place_ops_on_the_output_and_a_penalty_over_the_parameters_train_exactly(budget):
    # before: the output was a view the bridge returned of its input, and torch refused the loop's in-place op
    # ("Output 0 of Bridge is a view and is being modified inplace")
    assert _same(_run(inplace_output_loop, None), _run(inplace_output_loop, budget))


def restricted_backward_loop(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, list]:
    """Every other step backpropagates into the last layer only (``inputs=``)."""
    losses = []
    for s in range(4):
        loss = F.cross_entropy(model(X[s * 8:(s + 1) * 8]), Y[s * 8:(s + 1) * 8])
        opt.zero_grad()
        loss.backward(inputs=list(model[3].parameters())) if s % 2 else loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.clone() for k, v in model.state_dict().items()}, losses


@pytest.mark.parametrize("budget", BUDGETS)
def test_a_backward_restricted_with_inputs_is_not_silent(budget):
    # autograd runs only what leads to ``inputs``: the model's parameters are not on the loop's graph, so the bridge
    # never runs and the step finds no gradients where the plain loop's has the last layer's (weights 0.08 apart)
    plain = _run(restricted_backward_loop, None)
    with pytest.warns(RuntimeWarning, match=r"inputs=.*do not reach a prepared model's parameters"):
        ours = _run(restricted_backward_loop, budget)
    assert not _same(plain, ours)  # what the warning is about


def logged_forward_loop(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, list]:
    """A forward for logging between backward and step, with autograd on (dropout draws, no backward)."""
    losses = []
    for s in range(4):
        x, y = X[s * 8:(s + 1) * 8], Y[s * 8:(s + 1) * 8]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        losses.append((model(x).argmax(-1) == y).sum().item())
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}, losses


def test_a_forward_left_without_backward_before_the_step_warns_once_and_trains_exactly():
    plain = _run(logged_forward_loop, None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ours = _run(logged_forward_loop, "64MiB")
    told = [w for w in seen if "had no backward through the model" in str(w.message)]
    assert len(told) == 1 and told[0].filename == __file__  # once, pointing at the loop's optimizer.step()
    assert _same(plain, ours)


def test_an_ordinary_loop_is_not_warned():
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*had no backward through the model")
        _run(inplace_output_loop, "64MiB")
