"""Optuna integration in one process: grouping, pruning frees tasks, values equal direct runs, ask/tell, errors."""
from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import lm_batches, make_gpt2

import hydra_tune as ht

optuna = pytest.importorskip("optuna")
optuna.logging.set_verbosity(optuna.logging.WARNING)


def _data(n: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _mse(out, batch):
    return F.mse_loss(out, batch[1])


def _mlp_task(lr: float, epochs: int = 4, model=_mlp, loss=_mse, seed: int = 0) -> ht.ModelTask:
    return ht.ModelTask(model, lambda m: torch.optim.SGD(m.parameters(), lr=lr), _data(6, seed), eval_data=_data(2, 9),
                        loss=loss, epochs=epochs)


def _study(**kw):
    kw.setdefault("devices", ["cpu", "cpu"])
    kw.setdefault("device_memory", "64KiB")   # the MLP's 3 layers become 2+ shards
    kw.setdefault("sampler", optuna.samplers.TPESampler(seed=0))
    return ht.optuna_study(direction="minimize", **kw)


class _OddTrialsAtEpoch2(optuna.pruners.BasePruner):
    """Prunes odd-numbered trials once they reported epoch 2: which trials a MedianPruner prunes depends on the
    order concurrent trials finish in; this test is about what pruning frees, so the choice is fixed."""

    def prune(self, study, trial) -> bool:
        return trial.number % 2 == 1 and (trial.last_step or 0) >= 2


def test_pruned_trials_tasks_are_cancelled_and_freed():
    models: dict[int, list] = {}

    def objective(trial):
        lr = trial.suggest_float("lr", 1e-3, 1.0, log=True)

        def make():   # remember every model this trial's task builds
            m = _mlp()
            models.setdefault(trial.number, []).append(weakref.ref(m))
            return m
        for m in ht.train(_mlp_task(lr, epochs=5, model=make)):
            trial.report(m["eval_loss"], m["epoch"])
            if trial.should_prune():
                raise optuna.TrialPruned()
        return m["eval_loss"]

    with _study(pruner=_OddTrialsAtEpoch2()) as study:
        study.optimize(objective, n_trials=10)
        stats = study.runtime_stats()
        trials = study.trials
        names = study.trial_tasks
        gc.collect()
        pruned = [t for t in trials if t.state == optuna.trial.TrialState.PRUNED]
        early = [t for t in pruned if t.last_step < 5]
        assert [t.number for t in early] == [1, 3, 5, 7, 9] and all(t.last_step == 2 for t in early), \
            [(t.number, t.intermediate_values) for t in trials]
        assert [t.state for t in trials].count(optuna.trial.TrialState.COMPLETE) >= 2
        for t in early:
            (name,) = names[t.number]
            task = stats["tasks"][name]
            # the task trains ahead of its trial: on a loaded machine it may have trained its 5 epochs (and be
            # done: nothing left to cancel) before the trial read epoch 2; otherwise the prune cancelled it
            assert task["state"] == "cancelled" or (task["state"] == "done" and task["epoch"] == 5), (t.number, task)
        deadline = time.time() + 5   # a cancelled task is dropped at its unit boundary, by the device's worker
        alive = [t.number for t in early for ref in models[t.number] if ref() is not None]
        while alive and time.time() < deadline:
            time.sleep(0.05)
            gc.collect()
            alive = [t.number for t in early for ref in models[t.number] if ref() is not None]
        assert not alive, f"the models of pruned trials {alive} are still alive"
        assert study.cancelled_tasks == len(early)
        assert not [n for n, s in stats["tasks"].items() if s["state"] in ("queued", "running")]
        assert all(d["current_bytes"] == 0 for d in stats["devices"])


class _RecordingTPE(optuna.samplers.TPESampler):
    """TPE that remembers the values it was told (what the sampler 'sees')."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.seen: dict[int, list] = {}

    def after_trial(self, study, trial, state, values) -> None:
        self.seen[trial.number] = (state, values, dict(trial.params))
        super().after_trial(study, trial, state, values)


def _gpt2_task(params: dict) -> ht.ModelTask:
    return ht.ModelTask(make_gpt2, lambda m: torch.optim.AdamW(m.parameters(), lr=params["lr"],
                                                               weight_decay=params["wd"]),
                        lm_batches(3, seed=1), eval_data=lm_batches(1, seed=2), epochs=2, grad_clip_norm=1.0, seed=3)


def test_values_tpe_sees_equal_the_same_tasks_run_directly_on_a_runtime():
    sampler = _RecordingTPE(seed=0, n_startup_trials=2)

    def objective(trial):
        params = {"lr": trial.suggest_float("lr", 1e-4, 1e-2, log=True), "wd": trial.suggest_float("wd", 0.0, 0.1)}
        for m in ht.train(_gpt2_task(params)):
            trial.report(m["eval_loss"], m["epoch"])
        return m["eval_loss"]

    with _study(sampler=sampler, device_memory="600KiB") as study:   # GPT-2 in several shards, dropout on
        study.optimize(objective, n_trials=5)
        assert isinstance(study.sampler, ht.integrations.optuna.HydraSampler) and study.sampler.base is sampler
        stats = study.runtime_stats()
    assert max(len(s["shards"]) for s in stats["tasks"].values()) >= 2
    assert sorted(sampler.seen) == [0, 1, 2, 3, 4]
    with ht.Runtime(devices=["cpu"]) as rt:   # alone, unsharded, one device
        for number, (state, values, params) in sampler.seen.items():
            assert state == optuna.trial.TrialState.COMPLETE
            direct = rt.submit(_gpt2_task(params)).result()["eval_loss"]
            assert values == [direct], (number, values, direct)


def test_default_concurrency_groups_trials_and_explicit_n_jobs_is_respected():
    lock, running, peak = threading.Lock(), [0], [0]

    def objective(trial):
        lr = trial.suggest_float("lr", 0.01, 0.1)
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        try:
            for m in ht.train(_mlp_task(lr, epochs=3)):
                pass
            return m["eval_loss"]
        finally:
            with lock:
                running[0] -= 1

    with _study() as study:
        assert study.concurrency == 4   # 2 per device
        study.optimize(objective, n_trials=8)
        assert peak[0] == 4
        peak[0] = 0
        study.optimize(objective, n_trials=2, n_jobs=1)
        assert peak[0] == 1
        assert len(study.trials) == 10


def test_ask_tell_batch_trains_together_and_tell_cancels_the_rest():
    with _study() as study:
        trials = [study.ask() for _ in range(3)]
        handles = [study.submit(t, _mlp_task(t.suggest_float("lr", 0.01, 0.1), epochs=e))   # the last one runs
                   for t, e in zip(trials, (20, 20, 500))]                                   # long: tell ends it
        for t, h in zip(trials[:2], handles[:2]):
            study.tell(t, h.result()["eval_loss"])
        study.tell(trials[2], state=optuna.trial.TrialState.PRUNED)   # told before its task finished
        with pytest.raises(ht.TaskCancelled):
            handles[2].result()
        trace = study.runtime.trace()
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE", "PRUNED"]
    assert [t.value for t in study.trials[:2]] == [h.result()["eval_loss"] for h in handles[:2]]
    spans = {}
    for e in trace.events:
        if e.lane != "copy":
            lo, hi = spans.get(e.task, (e.start, e.end))
            spans[e.task] = (min(lo, e.start), max(hi, e.end))
    first_end = min(hi for _, hi in spans.values())
    assert sum(lo < first_end for lo, _ in spans.values()) == 3, "the batch's tasks should run at the same time"


def test_objective_exceptions_propagate_as_optuna_expects():
    def failing_loss(out, batch):   # fails in training (batch 4), not while the task is measured at submit
        if batch[1][0, 0] == 1234.0:
            raise RuntimeError("loss exploded")
        return _mse(out, batch)

    def objective(trial):
        kind = ["ok", "user", "task", "unfinished"][trial.number % 4]
        lr = trial.suggest_float("lr", 0.01, 0.1)
        if kind == "task":   # the task's own error reaches the objective through train()
            task = _mlp_task(lr, loss=failing_loss)
            task.train_data[3][1][0, 0] = 1234.0
            for _ in ht.train(task):
                pass
        metrics = ht.train(_mlp_task(lr, epochs=4 if kind == "ok" else 500))   # the others must be cancelled
        first = next(metrics)
        if kind == "user":
            raise ValueError("objective bug")
        if kind == "unfinished":
            leaked.append(metrics)   # the generator stays referenced: only the study can end its task
            return first["eval_loss"]
        return list(metrics)[-1]["eval_loss"]

    leaked: list = []
    with _study() as study:
        with pytest.raises(ValueError, match="objective bug"):
            study.optimize(objective, n_trials=2, n_jobs=1)
        study.optimize(objective, n_trials=6, catch=(ValueError, RuntimeError))
        states = [t.state.name for t in study.trials]
        stats = study.runtime_stats()["tasks"]
        names = study.trial_tasks
        assert states[:2] == ["COMPLETE", "FAIL"]
        assert states[2:] == ["FAIL", "COMPLETE", "COMPLETE", "FAIL", "FAIL", "COMPLETE"]
        assert stats[names[2][0]]["state"] == "failed"
        for number in (1, 3, 5, 7):   # tasks whose trial ended before them: cancelled, not left running
            assert stats[names[number][0]]["state"] == "cancelled", (number, stats[names[number][0]])
        assert len(leaked) == 2 and all(s["state"] in ("done", "failed", "cancelled") for s in stats.values())


def test_bad_arguments_are_explained():
    with pytest.raises(ValueError, match=r"`share` in .* must hold, but got \(share='cluster'\)"):
        ht.optuna_study(share="cluster")
    with pytest.raises(TypeError, match="`sampler` is an optuna.samplers.BaseSampler"):
        ht.optuna_study(sampler="tpe", devices=["cpu"])
    with _study() as study, pytest.raises(TypeError, match="`trial` is an optuna.Trial of this study"):
        study.submit(object(), _mlp_task(0.1))


@pytest.mark.parametrize("bad", [{"host_memory": "lots"}, {"policy": "sjf"}, {"host_memory": -1},
                                 {"devices": ["cpu"], "config": ht.RuntimeConfig(devices=["cpu"])}])
def test_bad_runtime_settings_raise_at_the_study_with_the_runtimes_message(bad):
    kw = dict({"devices": ["cpu"]}, **bad)
    with pytest.raises(Exception) as expected:
        ht.Runtime(**kw)
    storage = optuna.storages.InMemoryStorage()
    with pytest.raises(type(expected.value)) as got:
        ht.optuna_study(direction="minimize", storage=storage, **kw)
    assert str(got.value) == str(expected.value)
    assert storage.get_all_studies() == []      # raised before the study was created


def test_runtime_settings_and_config_reach_the_studys_runtime():
    with _study(host_memory="1GiB", policy="fifo") as study:
        stats = study.runtime_stats()
        assert stats["policy"] == "fifo" and stats["host"]["budget"] == 1 << 30
    config = ht.RuntimeConfig(devices=["cpu"], host_memory=123456789, policy="round_robin")
    with ht.optuna_study(direction="minimize", config=config) as study:
        assert study.runtime.config is config
        stats = study.runtime_stats()
        assert stats["policy"] == "round_robin" and stats["host"]["budget"] == 123456789
        assert len(stats["devices"]) == 1


def test_current_handle_in_a_trial_is_that_trials_latest_task():
    seen = []

    def objective(trial):
        with pytest.raises(RuntimeError, match="was started in this thread before"):
            ht.current_handle()   # one thread runs every trial (n_jobs=1): the last trial's task is not this one's
        for m in ht.train(_mlp_task(0.1, epochs=1)):
            pass
        seen.append(ht.current_handle().name)
        return m["eval_loss"]

    with _study() as study:
        study.optimize(objective, n_trials=3, n_jobs=1)
        assert seen == [study.trial_tasks[n][0] for n in range(3)]


def test_example_runs_and_reports(tmp_path, capsys):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import optuna_gpt2

    assert optuna_gpt2.main(["--trials", "5", "--epochs", "2", "--train-batches", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "best trial" in out and "5 trials:" in out and "devices busy: cpu:0" in out
    assert ht.Trace.load(str(tmp_path / "optuna_trace.json")).events
