"""A prepared model's task is freed at once when its run ends: release(), garbage collection, a trial that leaves
its objective (pruned, failed) or a bind scope that ends; the runtime's stats show it."""
from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hydra_tune as ht
from hydra_tune import api

X, Y = torch.randn(8, 4), torch.randint(0, 2, (8,))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _steps(model, opt, n: int = 2) -> None:
    for _ in range(n):
        opt.zero_grad()
        F.cross_entropy(model(X), Y).backward()
        opt.step()


def _state(rt, name: str, timeout: float = 5.0) -> str:
    deadline = time.time() + timeout
    while True:
        state = rt.stats()["tasks"][name]["state"]
        if state not in ("running", "queued") or time.time() > deadline:
            return state
        time.sleep(0.02)
        gc.collect()


def test_release_and_garbage_collection_end_the_task():
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        m = _mlp()
        model, opt = ht.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1), runtime=rt, name="released")
        _steps(model, opt)
        assert rt.stats()["tasks"]["released"]["state"] == "running"
        model.release()
        assert _state(rt, "released") == "done"
        m2 = _mlp()
        model, opt = ht.prepare(m2, torch.optim.SGD(m2.parameters(), lr=0.1), runtime=rt, name="collected")
        _steps(model, opt)
        del model, opt
        gc.collect()
        assert _state(rt, "collected") == "done"
        assert rt.scheduler.counts()["admitted"] == 0


def test_an_exception_leaving_a_bind_scope_cancels_its_prepared_model_at_once():
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        keep = []   # the model stays referenced: only the scope's end may free its task
        with pytest.raises(KeyError):
            with api.bind(rt.submit):
                m = _mlp()
                model, opt = ht.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1), name="scoped")
                keep.append(model)
                _steps(model, opt)
                raise KeyError("pruned")
        assert _state(rt, "scoped", timeout=0.5) == "cancelled"
        with pytest.raises(ht.TaskCancelled, match=r"'scoped' was cancelled"):
            keep[0](X)


def test_pruned_optuna_trials_free_their_prepared_models():
    optuna = pytest.importorskip("optuna")

    class PruneOdd(optuna.pruners.BasePruner):
        def prune(self, study, trial) -> bool:
            return trial.number % 2 == 1

    held = []

    def objective(trial):
        torch.manual_seed(trial.number)
        m = _mlp()
        model, opt = ht.prepare(m, torch.optim.SGD(m.parameters(), lr=trial.suggest_float("lr", 1e-3, 1e-1)))
        held.append(model)   # kept alive on purpose: the trial's end, not garbage collection, frees it
        for epoch in range(3):
            _steps(model, opt, 1)
            trial.report(float(epoch), epoch)
            if trial.should_prune():
                raise optuna.TrialPruned()
        return 0.0

    with ht.optuna_study(direction="maximize", devices=["cpu"], device_memory=None, pruner=PruneOdd(),
                         sampler=optuna.samplers.RandomSampler(seed=0)) as study:
        study.optimize(objective, n_trials=4, n_jobs=2)
        stats = study.runtime_stats()
        names = study.trial_tasks
        states = {t.number: t.state for t in study.trials}
    assert [states[i] == optuna.trial.TrialState.PRUNED for i in range(4)] == [False, True, False, True]
    assert all(stats["tasks"][names[i][0]]["state"] in ("cancelled", "done") for i in range(4))
    assert not [n for n, s in stats["tasks"].items() if s["state"] in ("queued", "running")]
    assert all(d["current_bytes"] == 0 for d in stats["devices"])
