"""Attention with dropout routed to a task's generator in torch's math-path calls (device/sdpa.py): the same values,
input gradients and generator state as torch's own attention drawing from that generator (as the dispatch mode
routes it), for every kind of call it takes; the others, and a kind whose check fails, go the dispatch mode's way."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import lm_batches, make_gpt2
from reference import max_param_diff, plain_train, trained

import hydra_tune as ht
from hydra_tune.device import dispatch, sdpa
from hydra_tune.device.rng import TaskRNG


@pytest.fixture(autouse=True)
def no_lending_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    # quiet units (whose router takes the short form) stop for the process once any task lent the global generator
    monkeypatch.setattr(dispatch, "_LENT", [])


def _qkv(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype).requires_grad_() for _ in range(3)]


def _grads(out: torch.Tensor, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out.float().square().sum(), inputs)


CASES = [  # (q/k/v shape, mask: None, "bool" or "float", is_causal, scale, dtype)
    ((2, 3, 9, 8), None, True, None, torch.float32),      # GPT-2's: no mask, causal
    ((2, 3, 9, 8), None, False, 0.125, torch.float32),
    ((2, 3, 9, 8), "bool", False, None, torch.float32),
    ((2, 3, 9, 8), "float", False, 0.5, torch.float32),   # a padding mask (BERT's)
    ((4, 9, 16), None, True, None, torch.float32),        # 3-D
    ((1, 2, 5, 4), None, True, None, torch.float64),
]


@pytest.mark.parametrize("shape,mask_kind,causal,scale,dtype", CASES)
def test_short_form_equals_torch_attention_bit_for_bit(shape, mask_kind, causal, scale, dtype) -> None:
    q, k, v = _qkv(shape, dtype)
    g = torch.Generator().manual_seed(3)
    mask = None if mask_kind is None else torch.rand(shape[-2], shape[-2], generator=g) > 0.3 \
        if mask_kind == "bool" else torch.randn(shape[0], 1, shape[-2], shape[-2], generator=g).to(dtype)
    theirs = torch.Generator().manual_seed(11)
    with dispatch.UnitMode(theirs):  # torch's own attention, its bernoulli_ given the generator
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1, is_causal=causal,
                                                  scale=scale)
    ours = torch.Generator().manual_seed(11)
    got = sdpa.routed_sdpa((q, k, v), {"attn_mask": mask, "dropout_p": 0.1, "is_causal": causal, "scale": scale},
                           ours)
    assert got is not None
    assert torch.equal(got, expected) and got.stride() == expected.stride()
    assert all(torch.equal(a, b) for a, b in zip(_grads(got, [q, k, v]), _grads(expected, [q, k, v])))
    assert torch.equal(ours.get_state(), theirs.get_state())  # the stream goes on where torch's would


def test_uncommon_calls_are_left_to_the_dispatch_mode() -> None:
    gen = torch.Generator().manual_seed(1)
    before = gen.get_state()
    q, k, v = _qkv((2, 2, 5, 4))
    mask = torch.ones(5, 5, dtype=torch.bool)
    for args, kwargs in [((q, k, v), {}), ((q, k, v), {"dropout_p": 1.0}), ((q, k, v, None, 0.1), {"enable_gqa": True}),
                         ((q, k, v, mask, 0.1, True), {}), ((q, k, v.double(), None, 0.1), {}),
                         ((q.to("meta"), k.to("meta"), v.to("meta"), None, 0.1), {}),
                         ((q.bfloat16(), k.bfloat16(), v.bfloat16(), None, 0.1, True), {}),  # its check fails
                         ((q, k, v), {"dropout_p": 0.1, "other": 1})]:
        assert sdpa.routed_sdpa(args, kwargs, gen) is None, (args[3:], kwargs)
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION]):
        assert sdpa.routed_sdpa((q, k, v, None, 0.1), {}, gen) is None  # the user turned the math path off
    assert torch.equal(gen.get_state(), before)  # nothing drawn


def test_router_takes_the_short_form_only_where_the_check_matched(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _qkv((2, 2, 6, 4))
    kind = ("none", True, True, torch.float32)

    def through_router(verdict: bool) -> tuple[torch.Tensor, int]:
        monkeypatch.setattr(sdpa, "_verdicts", {kind: verdict})
        calls = []
        real = sdpa._sdpa
        monkeypatch.setattr(sdpa, "_sdpa", lambda *a: calls.append(1) or real(*a))
        with dispatch.router_for(TaskRNG(5)):
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
        return out, len(calls)

    short, taken = through_router(True)
    general, not_taken = through_router(False)
    assert (taken, not_taken) == (1, 0)
    assert torch.equal(short, general)  # the same draws from the task's stream either way


def test_the_check_reads_torch_attention_calls_and_values(monkeypatch: pytest.MonkeyPatch) -> None:
    kind = ("float", False, False, torch.float32)
    assert sdpa._check(*kind) is True
    real = sdpa._sdpa
    with monkeypatch.context() as m:  # the same calls, numbers apart (the scale nudged by 1e-5)
        m.setattr(sdpa, "_sdpa", lambda q, k, v, mask, p, c, s, g: real(q, k, v, mask, p, c, s * 1.00001, g))
        assert sdpa._check(*kind) is False
    with monkeypatch.context() as m:  # a call more (the numbers alike: a copy)
        m.setattr(sdpa, "_sdpa", lambda *a: real(*a).clone())
        assert sdpa._check(*kind) is False


def test_gpt2_with_attention_dropout_trains_exactly_through_the_short_form(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = sdpa._sdpa
    monkeypatch.setattr(sdpa, "_sdpa", lambda *a: calls.append(1) or real(*a))
    task = ht.ModelTask(lambda: make_gpt2(attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1),
                        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), lm_batches(6), epochs=2, seed=4)
    with ht.Runtime(devices=["cpu"]) as rt:
        model = trained(rt.submit(task))
    assert calls, "no attention took the short form"
    assert max_param_diff(model, plain_train(task)[0]) == 0.0
