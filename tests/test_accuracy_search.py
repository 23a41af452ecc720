"""Accuracy-driven searches: Tune's ``stop={"accuracy": ...}``, ASHA on accuracy (mode="max") and an Optuna study
(direction="maximize") pruning on accuracy reported every N steps; the values they see equal the same tasks run
directly on a Runtime, and stopped or pruned trials' tasks are cancelled."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hydra_tune as ht

W = torch.Generator().manual_seed(5)
_PROJ = torch.randn(16, 4, generator=W)


def _data(n: int, seed: int) -> list:
    """A learnable 4-class problem: the label is the argmax of a fixed projection of x."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(32, 16, generator=g) for _ in range(n)]
    return [(x, (x @ _PROJ).argmax(-1)) for x in xs]


TRAIN, EVAL = _data(8, 0), _data(2, 1)


def accuracy(out, batch):
    return (out.argmax(-1) == batch[1]).sum(), batch[1].numel()


def make_task(lr: float, name: str | None = None, **kw) -> ht.ModelTask:
    kw.setdefault("epochs", None)        # until the search stops the trial
    kw.setdefault("eval_every", 4)
    return ht.ModelTask(lambda: nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)),
                        lambda m: torch.optim.SGD(m.parameters(), lr=lr), TRAIN, eval_data=EVAL,
                        loss=lambda out, b: F.cross_entropy(out, b[1]), metrics={"accuracy": accuracy}, seed=1,
                        name=name, **kw)


def _direct(lr: float, reports: int) -> list[dict]:
    with ht.Runtime(devices=["cpu"]) as rt:
        return list(rt.submit(make_task(lr, max_steps=4 * reports)).metrics())


KEYS = ("steps", "accuracy", "eval_loss")


# -- Optuna ---------------------------------------------------------------------------------------------------
def test_optuna_maximizes_and_prunes_on_accuracy():
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    lrs = [0.5, 1e-4, 0.2, 1e-5]

    def objective(trial):
        lr = trial.suggest_float("lr", 1e-5, 1.0, log=True)
        for m in ht.train(make_task(lr, max_steps=40)):
            trial.report(m["accuracy"], m["steps"])
            if trial.should_prune():
                raise optuna.TrialPruned()
        return m["accuracy"]

    # below 0.6 accuracy after 16 steps: pruned (a fixed threshold: which trials it prunes does not depend on order)
    pruner = optuna.pruners.ThresholdPruner(lower=0.6, n_warmup_steps=16)
    with ht.optuna_study(direction="maximize", pruner=pruner, devices=["cpu", "cpu"]) as study:
        for lr in lrs:
            study.enqueue_trial({"lr": lr})
        study.optimize(objective, n_trials=len(lrs))
        stats, names = study.runtime_stats(), study.trial_tasks
    states = [t.state for t in study.trials]
    P, C = optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.COMPLETE
    assert states == [C, P, C, P], states
    assert study.best_params["lr"] in (0.5, 0.2) and study.best_value > 0.6
    for t in study.trials:
        (name,) = names[t.number]
        assert stats["tasks"][name]["state"] == ("done" if t.state == C else "cancelled")
        seen = [(step, value) for step, value in sorted(t.intermediate_values.items())]
        direct = _direct(t.params["lr"], len(seen))
        assert seen == [(d["steps"], d["accuracy"]) for d in direct]
        if t.state == C:
            assert t.value == direct[-1]["accuracy"]


# -- Ray Tune -------------------------------------------------------------------------------------------------
def tune_fn(config: dict) -> None:
    from ray import tune

    for metrics in ht.train(make_task(config["lr"], name=tune.get_context().get_trial_id())):
        tune.report(metrics)


@pytest.fixture
def local_ray(local_ray):
    """conftest's shared local Ray (a Ray of this module's own cost 5-14 s to start)."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])   # tune_fn travels to the runtime actor


def _check_against_direct(results) -> None:
    for r in results:
        df = r.metrics_dataframe
        direct = _direct(r.config["lr"], len(df))
        assert [tuple(d[k] for k in KEYS) for d in direct] == list(zip(*(df[k] for k in KEYS)))


def test_tune_stop_on_accuracy_ends_trials_when_they_reach_it(local_ray, tmp_path):
    from ray import tune

    ex = ht.HydraExecutor(devices=["cpu"])
    results = tune.Tuner(ex.wrap(tune_fn), param_space={"lr": tune.grid_search([0.5, 1e-5])},
                         run_config=tune.RunConfig(callbacks=[ex], storage_path=str(tmp_path), name="stop",
                                                   stop={"accuracy": 0.8, "training_iteration": 12},
                                                   verbose=0)).fit()
    assert results.num_errors == 0, [r.error for r in results]
    by_lr = {r.config["lr"]: r.metrics for r in results}
    assert by_lr[0.5]["accuracy"] >= 0.8 and by_lr[0.5]["training_iteration"] < 12    # stopped by accuracy
    assert by_lr[1e-5]["accuracy"] < 0.8 and by_lr[1e-5]["training_iteration"] == 12   # by the iteration cap
    tasks = next(iter(ex.final_stats.values()))["tasks"]
    assert {t["state"] for t in tasks.values()} == {"cancelled"}   # epochs=None: only a stop ends them
    _check_against_direct(results)


def test_tune_asha_on_accuracy_stops_the_worst_trials(local_ray, tmp_path):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    ex = ht.HydraExecutor(devices=["cpu", "cpu"])
    asha = ASHAScheduler(max_t=8, grace_period=2, reduction_factor=2)
    results = tune.Tuner(ex.wrap(tune_fn), param_space={"lr": tune.grid_search([0.5, 0.2, 1e-4, 1e-5])},
                         tune_config=tune.TuneConfig(metric="accuracy", mode="max", scheduler=asha,
                                                     max_concurrent_trials=1),   # rung order fixed
                         run_config=tune.RunConfig(callbacks=[ex], storage_path=str(tmp_path), name="asha",
                                                   verbose=0)).fit()
    assert results.num_errors == 0, [r.error for r in results]
    iterations = {r.config["lr"]: r.metrics["training_iteration"] for r in results}
    assert max(iterations.values()) == 8 and min(iterations.values()) < 8, iterations
    assert iterations[1e-5] < 8, iterations                              # the slowest learner is stopped early
    assert results.get_best_result().config["lr"] in (0.5, 0.2)
    _check_against_direct(results)
