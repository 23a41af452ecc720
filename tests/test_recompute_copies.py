"""A recomputing B unit with saved buffers (training/shard.py ``load``) holds one copy of its shard, not two."""
from __future__ import annotations

import torch
import torch.nn as nn

from hydra_tune.device.devices import CpuDevice
from hydra_tune.device.rng import TaskRNG
from hydra_tune.stages.base import Stage
from hydra_tune.training.residency import ShardCache
from hydra_tune.training.shard import ShardExec
from hydra_tune.training.store import HostStore


def _backward_peak(drop_first: bool) -> tuple[int, int]:
    """(the device's peak over B, the shard's bytes) for a BatchNorm shard whose F left its copies resident;
    ``drop_first``: that copy dropped before B, as if none had been left."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
    ex = ShardExec(0, [Stage(f"{i}:{type(m).__name__}", m) for i, m in enumerate(model)])
    device = CpuDevice("cpu:0", 1 << 30)  # (a budget: its account counts)
    device.measuring, device.resident = True, ShardCache()  # (counted op by op)
    store, rng = HostStore(), TaskRNG(0)
    store.carries[0] = torch.randn(16, 8)
    ex.forward(device, store, rng)  # a plain F: B recomputes it from the saved input, RNG and buffers
    assert len(device.resident) == 1 and 0 in store.buffers
    if drop_first:
        device.resident.drop(ex)
    store.out_grads[0] = [torch.ones(16, 4)]
    device.account.peak = device.account.current  # (its peak over B from here)
    ex.backward(device, store, rng)
    shard = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return device.account.peak, shard


def test_a_recomputing_backward_with_saved_buffers_holds_one_copy_of_its_shard():
    # B recomputes F from the buffers as they were before it (BatchNorm's statistics), so it copies the shard in
    # afresh; the copy F left resident holds them as F left them, which no later unit can use either. Before: it
    # stayed held beside the fresh one for the whole unit, a second copy of the shard the plan does not count.
    stale, shard = _backward_peak(drop_first=False)
    fresh, _ = _backward_peak(drop_first=True)
    assert fresh > shard  # (the unit's own copy and activations)
    assert stale == fresh, f"{stale - fresh} bytes more: the shard is {shard}"
