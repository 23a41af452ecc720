"""A task's own copy of a DataLoader with persistent workers shuts its workers down when the task ends (left to the
garbage collector they live on, and their shutdown stalls some later allocation for seconds per worker)."""
from __future__ import annotations

import multiprocessing
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import hydra_tune as ht


def _workers_alive(before: set[int], wait: float = 3.0) -> list[int]:
    deadline = time.monotonic() + wait
    while True:
        alive = [p.pid for p in multiprocessing.active_children() if p.pid not in before]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def test_persistent_workers_end_with_their_task():
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 2))
    loader = DataLoader(data, batch_size=4, shuffle=True, num_workers=2, persistent_workers=True)
    before = {p.pid for p in multiprocessing.active_children()}
    task = ht.ModelTask(lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
                        lambda m: torch.optim.SGD(m.parameters(), lr=0.1), loader, epochs=2,
                        loss=lambda out, batch: F.mse_loss(out, batch[1]), eval_data=loader, name="pw")
    with ht.Runtime(devices=["cpu"]) as rt:
        handle = rt.submit(task)
        handle.result()
        # the runtime (and the handle, holding the task's model) still live: only the task's end shut them down
        assert _workers_alive(before) == []
