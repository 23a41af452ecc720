"""Host-memory pressure in a search: an Optuna study whose concurrent trials together need about twice the runtime's
``host_memory`` runs every trial (the ones that do not fit yet wait in the host gate's queue, visible in
``stats()``; none is rejected), and each trial's model is the plain loop's, bit for bit."""
from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hydra_tune as ht

from reference import max_param_diff, plain_train

optuna = pytest.importorskip("optuna")
optuna.logging.set_verbosity(optuna.logging.WARNING)


def _data(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(6)]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))


def _slow_mse(out, batch):
    time.sleep(0.003)  # trials overlap: the queue is seen
    return F.mse_loss(out, batch[1])


def _task(lr: float, seed: int) -> ht.ModelTask:
    return ht.ModelTask(_mlp, lambda m: torch.optim.AdamW(m.parameters(), lr=lr), _data(seed), loss=_slow_mse,
                        epochs=3, seed=seed)


class _Queue(threading.Thread):
    """Polls the study's runtime: the most tasks waiting for host memory, and admitted, at one time."""

    def __init__(self, study) -> None:
        super().__init__(daemon=True)
        self.study, self.stop, self.waiting, self.admitted = study, False, 0, 0

    def run(self) -> None:
        while not self.stop:
            tasks = self.study.runtime_stats()["tasks"]
            self.waiting = max(self.waiting, sum(bool(t.get("waiting_for_host_memory")) for t in tasks.values()))
            self.admitted = max(self.admitted, len(self.study.runtime.host_memory()["admitted"]))
            time.sleep(0.005)


def test_optuna_trials_needing_twice_host_memory_all_run_queued_and_exact():
    with ht.Runtime(devices=["cpu", "cpu"]) as probe:
        one = probe.footprint(_task(1e-3, 0)).total
    budget = 2 * one + one // 2          # two trials at a time; the study runs four: ~2x the budget
    models: dict[int, tuple[float, int, nn.Module]] = {}

    def objective(trial):
        lr, seed = trial.suggest_float("lr", 1e-4, 1e-2, log=True), trial.number
        for m in ht.train(_task(lr, seed)):
            pass
        models[trial.number] = (lr, seed, ht.current_handle().model())
        return m["train_loss"]

    with ht.optuna_study(direction="minimize", devices=["cpu", "cpu"], host_memory=budget,
                         sampler=optuna.samplers.RandomSampler(seed=0)) as study:
        assert study.concurrency == 4
        queue = _Queue(study)
        queue.start()
        study.optimize(objective, n_trials=8)
        queue.stop = True
        queue.join()
        states = [t.state for t in study.trials]
    assert states == [optuna.trial.TrialState.COMPLETE] * 8     # none rejected, none failed
    assert queue.waiting >= 1 and 1 <= queue.admitted <= 2, (queue.waiting, queue.admitted)
    for number, (lr, seed, model) in sorted(models.items()):
        expected, _ = plain_train(_task(lr, seed))
        assert max_param_diff(model, expected) == 0.0, number
