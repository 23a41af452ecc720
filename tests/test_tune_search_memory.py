"""Host-memory pressure in a Ray Tune search (the Tune half of tests/test_search_memory.py): concurrent trials that
together need about twice the node runtime's ``host_memory`` all run to their end (the ones that do not fit yet
wait in the host gate's queue, visible in ``HydraExecutor.runtime_stats()``; none is rejected or failed), and each
trial's model is the plain loop's, bit for bit."""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hydra_tune as ht

from reference import max_param_diff, plain_train

ray = pytest.importorskip("ray")
from ray import cloudpickle, tune  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # train_fn travels to the runtime actor


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))


def _slow_mse(out, batch):
    time.sleep(0.1)  # a trial takes ~1.2 s: Tune starts the next ones while it trains, and the queue is seen
    return F.mse_loss(out, batch[1])


def _task(seed: int) -> ht.ModelTask:
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(6)]
    return ht.ModelTask(_mlp, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3 * (seed + 1)), data,
                        loss=_slow_mse, epochs=2, seed=seed, name=f"seed{seed}")


def train_fn(config: dict) -> None:
    for m in ht.train(_task(config["seed"])):
        tune.report({"loss": m["train_loss"], "epoch": m["epoch"]})
    torch.save(ht.current_handle().model().state_dict(), os.path.join(config["out"], f"{config['seed']}.pt"))


class _Queue(threading.Thread):
    """Polls the node runtimes: the most tasks waiting for host memory, and admitted, at one time."""

    def __init__(self, ex: ht.HydraExecutor) -> None:
        super().__init__(daemon=True)
        self.ex, self.stop, self.waiting, self.admitted = ex, False, 0, 0

    def run(self) -> None:
        while not self.stop:
            for st in self.ex.runtime_stats().values():
                tasks = [t for t in st["tasks"].values() if t["state"] not in ("done", "cancelled", "failed")]
                self.waiting = max(self.waiting, sum(bool(t.get("waiting_for_host_memory")) for t in tasks))
                self.admitted = max(self.admitted, len(st["host"]["admitted"]))
            time.sleep(0.02)


def test_tune_trials_needing_twice_host_memory_all_run_queued_and_exact(local_ray, tmp_path):
    with ht.Runtime(devices=["cpu", "cpu"]) as probe:
        one = probe.footprint(_task(0)).total
    budget = 2 * one + one // 2          # two trials at a time; Tune runs four at once: ~2x the budget
    ex = ht.HydraExecutor(devices=["cpu", "cpu"], host_memory=budget)
    queue = _Queue(ex)
    tuner = tune.Tuner(ex.wrap(train_fn), param_space={"seed": tune.grid_search(list(range(4))), "out": str(tmp_path)},
                       tune_config=tune.TuneConfig(max_concurrent_trials=4),
                       run_config=tune.RunConfig(callbacks=[ex], storage_path=str(tmp_path / "tune"), name="mem",
                                                 verbose=0))
    queue.start()
    try:
        results = tuner.fit()
    finally:
        queue.stop = True
        queue.join()
    assert results.num_errors == 0, [r.error for r in results]
    assert sorted(r.metrics["epoch"] for r in results) == [2] * 4          # every trial ran to its end
    (stats,) = ex.final_stats.values()
    assert all(stats["tasks"][f"seed{s}"]["state"] == "done" for s in range(4)), stats["tasks"]
    assert queue.waiting >= 1 and 1 <= queue.admitted <= 2, (queue.waiting, queue.admitted)
    for seed in range(4):
        expected, _ = plain_train(_task(seed))
        model = _mlp()
        model.load_state_dict(torch.load(tmp_path / f"{seed}.pt"))
        assert max_param_diff(model, expected) == 0.0, seed
