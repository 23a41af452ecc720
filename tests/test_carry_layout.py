"""A gradient crosses a shard boundary in the layout autograd made it, as in the plain loop.

Some kernels' summation order follows their inputs' memory layout (a mean over a transposed view, a Linear's
weight gradient, GroupNorm's backward). Between shards the carry's gradient used to be read from the input leaf's
``.grad``, which autograd copies into the leaf's own strides (its layout rule for ``.grad``): where the plain loop
handed the previous op a contiguous gradient, the previous shard got a transposed one, and the weights ended
~1e-8 off (tests below fail before the fix: training/carry.py ``CarryLeaves``).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import plain_train

import hydra_tune as ht

X = torch.randn(32, 12, 16, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 4, (32,), generator=torch.Generator().manual_seed(2))
BATCHES = [(X[i:i + 8], Y[i:i + 8]) for i in range(0, 32, 8)]


class ChannelsFirst(nn.Module):
    """Runs ``m`` over (batch, channels, length) and hands back a transposed view: a non-contiguous carry."""

    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m(x.transpose(1, 2)).transpose(1, 2)


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.5


class Pool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


def _model() -> nn.Module:
    return nn.Sequential(ChannelsFirst(nn.Conv1d(16, 16, 3, padding=1)), ChannelsFirst(nn.GroupNorm(4, 16)),
                         nn.GELU(), Scale(), Pool(), nn.Linear(16, 4))


def _task() -> ht.ModelTask:
    return ht.ModelTask(_model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), BATCHES,
                        loss=lambda out, b: F.cross_entropy(out, b[1]), epochs=2, seed=0)


def test_transposed_carries_train_bit_identical_across_shards():
    plain, _ = plain_train(_task())
    with ht.Runtime(devices=["cpu", "cpu"], device_memory="30KiB") as rt:
        handle = rt.submit(_task())
        handle.result()
        shards = rt.stats()["tasks"][handle.name]["shards"]
        got = handle.model()
    assert len(shards) >= 3, shards
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), got.state_dict().values()))


def _loop(prepare=None) -> dict:
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if prepare is not None:
        model, opt = prepare(model, opt)
    for _ in range(2):
        for x, y in BATCHES:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_prepared_transposed_carries_bit_identical_across_shards():
    plain = _loop()
    with ht.Runtime(devices=["cpu"], device_memory="30KiB") as rt:
        ours = _loop(lambda m, o: ht.prepare(m, o, runtime=rt))
        assert len(next(iter(rt.stats()["tasks"].values()))["shards"]) >= 3
    assert all(torch.equal(plain[k], ours[k]) for k in plain)


class EveryOther(nn.Module):
    """Hands on a strided view (every other feature): a carry with gaps in its storage."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., ::2]


class Broadcast(nn.Module):
    """Hands on a broadcast view (the mean expanded over the features): a carry whose elements share memory."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(-1, keepdim=True).expand(-1, -1, 16)


class RowSum(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(-1, keepdim=True) * x


def _views_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), EveryOther(), RowSum(), Broadcast(), RowSum(), Pool(),
                         nn.Linear(16, 4))


@pytest.mark.parametrize("memory,boundary", [("60KiB", "2:EveryOther"), ("70KiB", "4:Broadcast")])
def test_strided_and_broadcast_carries_keep_their_layout_across_shards(memory, boundary):
    task = ht.ModelTask(_views_model, lambda m: torch.optim.SGD(m.parameters(), lr=0.05), BATCHES,
                        loss=lambda out, b: F.cross_entropy(out, b[1]), epochs=2, seed=0)
    plain, _ = plain_train(task)
    with ht.Runtime(devices=["cpu"], device_memory=memory) as rt:
        handle = rt.submit(task)
        handle.result()
        shards = rt.stats()["tasks"][handle.name]["shards"]
        got = handle.model()
    assert boundary in [s[-1] for s in shards[:-1]], shards     # the view is a carry between two shards
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), got.state_dict().values()))
