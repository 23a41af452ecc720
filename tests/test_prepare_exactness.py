"""hydra_tune.prepare: the user's own loop, unchanged but for one line, ends bit-identical to the plain loop.

Each test runs the same loop function twice, without and with ``prepare``, and compares every tensor of the
state dicts (max abs diff 0.0, fp32 on CPU) and what the loop reported (losses, accuracies).
"""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import lm_batches, make_gpt2

import hydra_tune as ht


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _mlp(p: float = 0.2) -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(p), nn.Linear(32, 32), nn.ReLU(), nn.Dropout(p),
                         nn.Linear(32, 4))


X = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 4, (64,), generator=torch.Generator().manual_seed(2))


def mlp_loop(prepare=None, epochs: int = 2, accumulate: int = 1):
    """The plain loop of a classifier: shuffled DataLoader, dropout, AdamW, clipping, warmup, per-epoch accuracy
    under no_grad; ``prepare``: the one adoption line."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if prepare is not None:
        model, opt = prepare(model, opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=16, shuffle=True)
    history = []
    for _ in range(epochs):
        model.train()
        for i, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y) / accumulate
            loss.backward()
            if (i + 1) % accumulate == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                sched.step()
                opt.zero_grad()
            history.append(loss.item())
        model.eval()
        with torch.no_grad():
            history.append((model(X).argmax(-1) == Y).sum().item())
    return {k: v.clone() for k, v in model.state_dict().items()}, history, model


def test_mlp_sharded_bit_identical_with_dropout_shuffle_clip_warmup_and_accumulation():
    plain, hist, _ = mlp_loop(accumulate=2)
    with ht.Runtime(devices=["cpu", "cpu"], device_memory="24KiB") as rt:
        ours, hist2, model = mlp_loop(lambda m, o: ht.prepare(m, o, runtime=rt), accumulate=2)
        stats = rt.stats()["tasks"][model.task.name]
    assert len(stats["shards"]) >= 3 and stats["steps"] == 4   # sharded; the user's steps counted
    assert _diff(plain, ours) == 0.0
    assert hist == hist2


def gpt2_loop(prepare=None, n: int = 6):
    """GPT-2 with tied embeddings and dropout 0.1, its own loss (labels=), AdamW with two groups, accumulation 2,
    clipping, warmup; an eval loss under no_grad at the end."""
    torch.manual_seed(0)
    model = make_gpt2()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    if prepare is not None:
        model, opt, sched = prepare(model, opt, sched)
    model.train()
    losses = []
    for i, batch in enumerate(lm_batches(n)):
        out = model(**batch)
        (out.loss / 2).backward()
        losses.append(out.loss.item())
        if i % 2 == 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
    model.eval()
    with torch.no_grad():
        losses.append(model(**lm_batches(1, seed=5)[0]).loss.item())
    return {k: v.clone() for k, v in model.state_dict().items()}, losses, model


def test_gpt2_sharded_bit_identical():
    plain, losses, _ = gpt2_loop()
    with ht.Runtime(devices=["cpu", "cpu"], device_memory="600KiB") as rt:
        ours, losses2, model = gpt2_loop(lambda m, o, s: ht.prepare(m, o, s, runtime=rt))
        shards = rt.stats()["tasks"][model.task.name]["shards"]
    assert len(shards) >= 4
    assert _diff(plain, ours) == 0.0
    assert losses == losses2
    assert model.module.lm_head.weight is model.module.transformer.wte.weight   # still tied


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cls, self.aux = nn.Linear(32, 4), nn.Linear(32, 1)

    def forward(self, h):
        return {"logits": self.cls(h), "aux": self.aux(h), "unused": self.aux(h) * 2}


class TwoHeads(nn.Module):
    """A custom-loss model: a dict of two outputs, one unused by the loss, combined by the user's own loss."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Dropout(0.1))
        self.heads = Heads()

    def forward(self, x):
        return self.heads(self.body(x))

    def hydra_stages(self):
        return [self.body, self.heads]


def custom_loop(prepare=None):
    """SGD with momentum, a two-stage model with dict outputs; the loss combines two of them."""
    torch.manual_seed(3)
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if prepare is not None:
        model, opt = prepare(model, opt, name="custom")
    for i in range(4):
        x, y = X[i * 16:(i + 1) * 16], Y[i * 16:(i + 1) * 16]
        out = model(x)
        loss = F.cross_entropy(out["logits"], y) + 0.1 * out["aux"].pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_custom_loss_model_two_stages_dict_output_unused_output_bit_identical():
    plain = custom_loop()
    with ht.Runtime(devices=["cpu"], device_memory="16KiB") as rt:
        ours = custom_loop(lambda m, o, **kw: ht.prepare(m, o, runtime=rt, **kw))
        assert len(rt.stats()["tasks"]["custom"]["shards"]) == 2
    assert _diff(plain, ours) == 0.0


def _thread_loop(model, seed: int, prepare=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if prepare is not None:
        model, opt = prepare(model, opt)
    else:
        torch.manual_seed(seed)   # what prepare(seed=seed) gives the model's draws (dropout)
    for i in range(6):
        x, y = X[(i % 4) * 16:(i % 4 + 1) * 16], Y[(i % 4) * 16:(i % 4 + 1) * 16]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_two_prepared_trials_in_threads_each_bit_identical_to_its_plain_loop():
    torch.manual_seed(0)
    models = [_mlp(0.3) for _ in range(2)]
    inits = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    plain = []
    for init, seed in zip(inits, (11, 12)):
        m = _mlp(0.3)
        m.load_state_dict(init)
        plain.append(_thread_loop(m, seed))
    results: dict[int, dict] = {}
    with ht.Runtime(devices=["cpu", "cpu"], device_memory="24KiB") as rt:
        def trial(i: int) -> None:
            results[i] = _thread_loop(models[i], 11 + i, lambda m, o: ht.prepare(m, o, seed=11 + i, runtime=rt))
        threads = [threading.Thread(target=trial, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        busy = {d["units"] > 0 for d in rt.stats()["devices"]}
    assert sorted(results) == [0, 1]
    assert all(_diff(p, results[i]) == 0.0 for i, p in enumerate(plain))
    assert busy == {True}   # both devices ran units


def test_outputs_come_back_on_the_input_device_and_state_dict_round_trips(tmp_path):
    torch.manual_seed(0)
    m = _mlp()
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        model, opt = ht.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1), runtime=rt)
        out = model(X[:4])
        assert out.device == X.device and out.requires_grad
        assert list(model.state_dict()) == list(m.state_dict())
        torch.save(model.state_dict(), tmp_path / "m.pt")
        other = _mlp()
        other.load_state_dict(torch.load(tmp_path / "m.pt"))
        assert _diff(other.state_dict(), m.state_dict()) == 0.0
        model.eval()
        assert not m.training and not model.training
        with torch.no_grad():
            assert not model(X[:4]).requires_grad


def eval_before_backward_loop(prepare=None):
    """model.eval() between the forward and its backward: the backward is still the (train-mode) forward's."""
    torch.manual_seed(4)
    model = _mlp(0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if prepare is not None:
        model, opt = prepare(model, opt)
    for i in range(3):
        model.train()
        loss = F.cross_entropy(model(X[:16]), Y[:16])
        model.eval()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_mode_change_between_forward_and_backward_keeps_the_forwards_dropout():
    plain = eval_before_backward_loop()
    with ht.Runtime(devices=["cpu"], device_memory="24KiB") as rt:   # recomputing shards
        ours = eval_before_backward_loop(lambda m, o: ht.prepare(m, o, runtime=rt))
    assert _diff(plain, ours) == 0.0


def test_deepcopy_and_whole_model_save_give_the_users_model(tmp_path):
    import copy

    m = _mlp()
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        model, opt = ht.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1), runtime=rt)
        F.cross_entropy(model(X), Y).backward()
        opt.step()
        ema = copy.deepcopy(model)   # the EMA / best-model idiom
        torch.save(model, tmp_path / "whole.pt")
        loaded = torch.load(tmp_path / "whole.pt", weights_only=False)
    for other in (ema, loaded):
        assert type(other) is nn.Sequential and _diff(other.state_dict(), m.state_dict()) == 0.0


def amp_loop(prepare=None):
    """The plain CPU mixed-precision loop: forward and loss inside torch.autocast(bf16)."""
    torch.manual_seed(0)
    model = _mlp(0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if prepare is not None:
        model, opt = prepare(model, opt)
    for i in range(4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(X[i * 16:(i + 1) * 16]), Y[i * 16:(i + 1) * 16])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_autocast_loop_bit_identical_with_precision_bf16():
    plain = amp_loop()
    with ht.Runtime(devices=["cpu"], device_memory="24KiB") as rt:
        ours = amp_loop(lambda m, o: ht.prepare(m, o, precision="bf16", runtime=rt))
    assert _diff(plain, ours) == 0.0


def _bn_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 128),
                         nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 4))


def oom_loop(prepare=None, squeeze=None):
    """BatchNorm and dropout; ``squeeze()`` between the second minibatch's forward and its backward (after the
    first step, while no unit runs) makes the device hold less than planned."""
    torch.manual_seed(5)
    model = _bn_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if prepare is not None:
        model, opt = prepare(model, opt)
    for i in range(4):
        loss = F.cross_entropy(model(X[i * 16:(i + 1) * 16]), Y[i * 16:(i + 1) * 16])
        if i == 1 and squeeze is not None:
            squeeze(model)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("FRACTION", [0.9, 0.6])
def test_device_out_of_memory_replans_a_prepared_model_and_ends_bit_identical(FRACTION):
    plain = oom_loop()
    with ht.Runtime(config=ht.RuntimeConfig(devices=["cpu"], device_memory=300_000, residency="off")) as rt:
        device = rt.devices[0]

        def squeeze(model):
            # Not FRACTION of the predicted peak at once: that peak counts the copy thread's prefetch next to the
            # largest unit, and whether the device really goes past 90% of it depends on when that copy lands
            # (the backward's unit alone stays under it), so the out-of-memory came or not by timing. Instead
            # the device has no room beyond what it holds now: the backward's first unit must copy its shard in,
            # so it runs out of memory whatever the copy thread does; from that out-of-memory on (before the
            # re-plan), the device has FRACTION of the plan's peak, which the re-planned minibatch and the rest
            # of the loop must fit.
            peak = rt.stats()["tasks"][model.task.name]["predicted_peak"]
            device.limit_memory(device.current_bytes())
            device.after_oom = lambda: device.limit_memory(int(FRACTION * peak))
        ours = oom_loop(lambda m, o: ht.prepare(m, o, runtime=rt, name="oom"), squeeze)
        replans = rt.stats()["tasks"]["oom"]["replans"]
    assert replans >= 1
    assert _diff(plain, ours) == 0.0   # buffers (BatchNorm statistics) included: updated once per minibatch


class PairInput(nn.Module):
    """A model whose one input is a tuple: model((a, b))."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, pair):
        return self.a(pair[0]) + self.b(pair[1])


def pair_loop(prepare=None):
    torch.manual_seed(6)
    model = PairInput()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if prepare is not None:
        model, opt = prepare(model, opt)
    for i in range(3):
        loss = F.cross_entropy(model((X[:16], X[16:32] * i)), Y[:16])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_tuple_input_reaches_the_model_whole():
    plain = pair_loop()
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        ours = pair_loop(lambda m, o: ht.prepare(m, o, runtime=rt))
    assert _diff(plain, ours) == 0.0
