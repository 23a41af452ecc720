"""Modules with torch's inference fast path (nn.MultiheadAttention, nn.TransformerEncoderLayer/Encoder) take it in
a unit when the plain loop takes it: eval outputs and a frozen eval-mode encoder's features are bit-identical.

Before device/fastpath.py, a measured unit's torch-function mode (and the light router's) made
``torch.overrides.has_torch_function`` true, so those modules took their composite path there: the first
evaluation of a model with nn.MultiheadAttention was ~1e-7 off the plain loop's, and a frozen eval-mode encoder
in front of a trained head shifted the head's weights.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import plain_train

import hydra_tune as ht
from hydra_tune.device import dispatch
from hydra_tune.device.fastpath import fast_path_modules

X = torch.randn(32, 12, 16, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 4, (32,), generator=torch.Generator().manual_seed(2))


class SelfAttention(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, dropout=dropout, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0] + x


class Pool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


def _attention_model() -> nn.Module:
    return nn.Sequential(SelfAttention(), nn.LayerNorm(16), SelfAttention(), Pool(), nn.Linear(16, 4))


def _loop(prepare=None) -> tuple[dict, list[float]]:
    torch.manual_seed(0)
    model = _attention_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if prepare is not None:
        model, opt = prepare(model, opt)
    history = []
    for _ in range(2):
        model.train()
        for i in range(0, 32, 8):
            loss = F.cross_entropy(model(X[i:i + 8]), Y[i:i + 8])
            loss.backward()
            opt.step()
            opt.zero_grad()
            history.append(loss.item())
        model.eval()
        with torch.no_grad():
            history.extend(model(X).flatten().tolist())
    return {k: v.clone() for k, v in model.state_dict().items()}, history


def test_fast_path_modules_are_found_by_type():
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2, enable_nested_tensor=False)
    model = nn.Sequential(SelfAttention(), enc, nn.Linear(16, 4))
    found = fast_path_modules(model)
    assert model[0].attn in found and enc in found and all(layer in found for layer in enc.layers)
    assert fast_path_modules(nn.Linear(2, 2)) == ()


@pytest.mark.parametrize("memory", [None, "96KiB"])
def test_prepared_eval_of_multihead_attention_is_bit_identical(memory):
    plain, hist = _loop()
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=memory) as rt:
        ours, hist2 = _loop(lambda m, o: ht.prepare(m, o, runtime=rt))
        shards = len(next(iter(rt.stats()["tasks"].values()))["shards"])
    assert (shards > 1) == (memory is not None)
    assert hist2 == hist                       # every eval output of both evaluations, the first (measured) too
    assert all(torch.equal(plain[k], ours[k]) for k in plain)


class FrozenFeatures(nn.Module):
    """A frozen transformer encoder that stays in eval mode (a feature extractor) whatever mode its model is in."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).requires_grad_(False)

    def train(self, mode: bool = True) -> FrozenFeatures:
        super().train(mode)
        self.encoder.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


def _frozen_encoder_head() -> nn.Module:
    """Frozen eval-mode features, a trained head with dropout."""
    return nn.Sequential(FrozenFeatures(), Pool(), nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 4))


def _encoder_task(model=None) -> ht.ModelTask:
    batches = [(X[i:i + 8], Y[i:i + 8]) for i in range(0, 32, 8)]
    def optimizer(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    return ht.ModelTask(model or _frozen_encoder_head, optimizer, batches,
                        loss=lambda out, b: F.cross_entropy(out, b[1]), epochs=2, seed=3)


def test_frozen_eval_mode_encoder_in_a_trained_model_is_bit_identical():
    plain, _ = plain_train(_encoder_task())
    assert not plain[0].encoder.training and plain[4].training
    task = _encoder_task()
    with ht.Runtime(devices=["cpu", "cpu"]) as rt:
        handle = rt.submit(task)
        handle.result()
        got = handle.model()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), got.state_dict().values()))


class AttentionThenDropout(nn.Module):
    """One stage: attention, then a dropout of its own (drawing in training mode whatever mode the attention is in)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, dropout=0.1, batch_first=True)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.attn(x, x, x, need_weights=False)[0]) + x


def _freezing_loop(prepare=None) -> dict:
    """The attention is switched to eval mode after the first epoch (frozen); the dropout after it keeps drawing."""
    torch.manual_seed(0)
    model = nn.Sequential(AttentionThenDropout(), Pool(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if prepare is not None:
        model, opt = prepare(model, opt)
    model.train()
    for epoch in range(3):
        if epoch == 1:
            model[0].attn.eval()
        for i in range(0, 32, 8):
            F.cross_entropy(model(X[i:i + 8]), Y[i:i + 8]).backward()
            opt.step()
            opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("lent", [False, True])
def test_a_draw_beside_an_eval_mode_attention_is_routed_after_a_rerun(lent, monkeypatch):
    """The first minibatch after the switch drew with the router set aside (the stage was routed: quietly, or with
    the whole unit once a task lent the global generator, ``lent``), reran counted, and the task stayed counted."""
    # lent: as after an earlier task in this process lent it (then quiet units stop for the process); else as in a
    # fresh process whatever ran in this one before
    monkeypatch.setattr(dispatch, "_LENT", [True] if lent else [])
    plain = _freezing_loop()
    with ht.Runtime(devices=["cpu"]) as rt:
        ours = _freezing_loop(lambda m, o: ht.prepare(m, o, runtime=rt))
        counts = rt.stats()["devices"][0]["unrouted"]
    assert all(torch.equal(plain[k], ours[k]) for k in plain)
    assert counts["fast_path_reruns"] == 1 and (counts["quiet"] == 0) == lent


def _frozen_prefix_model() -> nn.Module:
    """Frozen layers before the frozen eval-mode encoder: the encoder's input requires no gradient in the plain loop
    (nothing before it trains), so its fast path runs there."""
    return nn.Sequential(nn.Linear(16, 512).requires_grad_(False), nn.Linear(512, 16).requires_grad_(False),
                         FrozenFeatures(), Pool(), nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 4))


def test_a_carry_computed_from_frozen_weights_alone_requires_no_gradient_in_its_shard():
    """Before, every later shard's input required a gradient: the encoder there took its composite path (7e-8 off)
    and the frozen Linear's stage was planned with its input's gradient (it alone needed 460 KiB: no plan fit)."""
    plain, _ = plain_train(_encoder_task(_frozen_prefix_model))
    with ht.Runtime(devices=["cpu"], device_memory="300KiB") as rt:
        handle = rt.submit(_encoder_task(_frozen_prefix_model))
        handle.result()
        shards = rt.stats()["tasks"][handle.name]["shards"]
        got = handle.model()
    assert [s[0] for s in shards[:3]] == ["0:Linear", "1:Linear", "2:FrozenFeatures"], shards
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), got.state_dict().values()))


class _RecordingDevice:
    """What ``native_scope`` asks of a device: the error for an unrouted draw (a CUDA device's names the fix)."""

    name = "cuda:0"

    def __init__(self) -> None:
        self.asked: list[str] = []

    def unrouted_draw(self, stage: str) -> BaseException:
        self.asked.append(stage)
        return RuntimeError(f"unrouted draw in {stage}")


def test_the_router_is_set_aside_around_an_eval_mode_attention_and_a_draw_there_raises_the_devices_error(
        monkeypatch):
    """The scope the CUDA device's units get (the router around the whole unit, no UnitMode): the attention sees
    no mode, the router is back after the stage, and a CPU draw meanwhile raises the device's error."""
    from hydra_tune.device.dispatch import router_for
    from hydra_tune.device.fastpath import native_scope
    from hydra_tune.device.rng import TaskRNG

    monkeypatch.setattr(dispatch, "_LENT", [])
    attn = SelfAttention().eval()
    fast, device = fast_path_modules(attn), _RecordingDevice()
    router = router_for(TaskRNG(0))
    with router:
        with native_scope(fast, device, "0:SelfAttention"):
            assert not torch._C._is_torch_function_mode_enabled()
            with torch.no_grad():
                attn(X[:2])
        assert torch._C._len_torch_function_stack() == 1          # the router is back
        with pytest.raises(RuntimeError, match="unrouted draw in 0:SelfAttention"):
            with native_scope(fast, device, "0:SelfAttention"):
                torch.rand(3)                                       # a draw from the global generator
        assert torch._C._len_torch_function_stack() == 1
    assert device.asked == ["0:SelfAttention"]
    attn.train()
    assert isinstance(native_scope(fast, device, "x"), type(contextlib.nullcontext()))  # training: nothing set aside
