"""nn.Dropout routed to a task's generator in four tensor calls (device/dropout.py): the same values, gradients and
generator state as torch's own dropout drawing from that generator, for every case it takes; the others, and a
torch whose dropout differs, go the dispatch mode's way."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hydra_tune.device import dispatch, dropout
from hydra_tune.device.rng import TaskRNG


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 33, generator=g)
    return [base, base.t(), base[:, ::2], torch.randn(2, 3, 4, 5, generator=g).permute(0, 2, 3, 1),
            base.to(torch.float64), base.to(torch.bfloat16), torch.randn(1, generator=g)]


def _torch_own(x: torch.Tensor, p: float, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """F.dropout as the dispatch mode routes it (UnitMode: the generator added to bernoulli_)."""
    gen = torch.Generator().manual_seed(seed)
    x = x.detach().requires_grad_()
    with dispatch.UnitMode(gen):
        out = F.dropout(x, p, True)
    (grad,) = torch.autograd.grad(out.float().square().sum(), x)
    return out, grad, gen.get_state()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.93])
def test_short_form_equals_torch_dropout_bit_for_bit(p: float) -> None:
    for i, x in enumerate(_inputs()):
        expected, expected_grad, expected_state = _torch_own(x, p, 100 + i)
        gen = torch.Generator().manual_seed(100 + i)
        leaf = x.detach().requires_grad_()
        got = dropout.routed_dropout((leaf, p, True, False), {}, gen)
        assert got is not None, (i, x.dtype, x.stride())
        (grad,) = torch.autograd.grad(got.float().square().sum(), leaf)
        assert torch.equal(got, expected) and got.stride() == expected.stride(), (i, x.dtype)
        assert torch.equal(grad, expected_grad), i
        assert torch.equal(gen.get_state(), expected_state), i  # the stream goes on where torch's would


def test_uncommon_calls_are_left_to_the_dispatch_mode() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 4)
    before = gen.get_state()
    for args, kwargs in [((x, 0.5, False, False), {}), ((x, 0.5, True, True), {}), ((x, 0.0, True), {}),
                         ((x, 1.0, True), {}), ((x.to(torch.int64), 0.5, True), {}),
                         ((torch.empty(0, 3), 0.5, True), {}), ((x.to("meta"), 0.5, True), {}),
                         ((nn.Parameter(x),), {"p": 0.5})]:
        assert dropout.routed_dropout(args, kwargs, gen) is None, (args[1:], kwargs)
    assert torch.equal(gen.get_state(), before)  # nothing drawn


def test_keyword_arguments_take_the_short_form() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 7)
    got = dropout.routed_dropout((), {"input": x, "p": 0.25, "training": True}, gen)
    expected, _, _ = _torch_own(x, 0.25, 2)
    assert got is not None and torch.equal(got, expected)


def _router_dropout(monkeypatch: pytest.MonkeyPatch, verdict: bool) -> tuple[torch.Tensor, int]:
    monkeypatch.setattr(dropout, "_verdict", [verdict])
    calls = []
    real = dropout.dropped
    monkeypatch.setattr(dropout, "dropped", lambda *a: calls.append(1) or real(*a))
    rng = TaskRNG(5)
    layer = nn.Dropout(0.3)
    with dispatch.router_for(rng):
        out = layer(torch.ones(8, 16))
    return out, len(calls)


def test_router_takes_the_short_form_only_where_torch_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    short, taken = _router_dropout(monkeypatch, True)
    general, not_taken = _router_dropout(monkeypatch, False)
    assert (taken, not_taken) == (1, 0)
    assert torch.equal(short, general)  # the same draws from the task's stream either way
    expected, _, _ = _torch_own(torch.ones(8, 16), 0.3, 5)
    assert torch.equal(short, expected)


def test_the_check_reads_torch_dropout_ops_and_values(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dropout.matches_torch()  # the process's verdict first: a first check elsewhere meanwhile reads no patch
    assert dropout._check() is True  # this torch's CPU dropout is the four ops
    with monkeypatch.context() as m:  # a torch whose dropout makes other ops
        m.setattr(dropout, "_EXPECTED", ("aten.native_dropout.default",))
        assert dropout._check() is False
    real = dropout.dropped
    monkeypatch.setattr(dropout, "dropped", lambda x, p, g: real(x, p, g) * (1 - p))  # other values
    assert dropout._check() is False


@pytest.mark.parametrize("context", ["meta", "router", "unit", "no_grad", "inference", "offload", "autocast"])
def test_the_first_check_reads_torch_whatever_the_caller_runs_under(monkeypatch: pytest.MonkeyPatch,
                                                                    context: str) -> None:
    """The verdict is taken once per process, at the first dropout the router sees: that may be inside a unit's
    dispatch mode, a meta-device context, the router itself or a no_grad block (a prepared model's evaluation in
    train mode) or an offloading forward's saved-tensor hooks. It must read torch's own dropout there too (a meta
    probe compares nothing; the router around the check would route the check's own dropout into a second check;
    without autograd its gradients raise; hooks that copy saved tensors put their copies into the recording)."""
    monkeypatch.setattr(dropout, "_verdict", [])
    scopes = {"meta": lambda: torch.device("meta"), "router": lambda: dispatch.router_for(TaskRNG(1)),
              "unit": lambda: dispatch.UnitMode(torch.Generator().manual_seed(1), dispatch.MemoryAccount()),
              "no_grad": torch.no_grad, "inference": torch.inference_mode,
              "offload": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t),
              "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}
    with scopes[context]():
        assert dropout.matches_torch() is True
