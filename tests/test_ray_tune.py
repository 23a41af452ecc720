"""Ray Tune integration on a real local Ray: ASHA drop-in form (stopped trials' tasks cancelled), metrics equal to a
direct Runtime run, torch-free proxies, exact checkpoint/restore through Tune's Checkpoint after a failure, and a
head + 2 worker multi-node cluster where each trial is trained by its own node's runtime."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import pytest
import torch
import torch.nn.functional as F

import hydra_tune as ht

ray = pytest.importorskip("ray")
from ray import cloudpickle, tune  # noqa: E402
from ray.tune.schedulers import ASHAScheduler  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the train_fns below travel to the runtime actors

EPOCHS = 6
KEYS = ("epoch", "train_loss", "steps")


def make_task(config: dict, name: str, resume_from: str | None = None) -> ht.ModelTask:
    """A small MLP task; PBT's config sets ``resume_hparams="task"`` so an explored lr applies after exploit.
    ``pace``: seconds each step's loss sleeps, so that an epoch lasts long enough on the wall clock (for a stop or a
    kill to land mid-task) without the CPU work of more batches; the numbers are the same with or without it."""
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(32, 32, generator=g), torch.randn(32, 4, generator=g)) for _ in range(config.get("nb", 24))]
    pace = config.get("pace", 0.0)

    def loss(out, b):
        if pace:
            time.sleep(pace)
        return F.mse_loss(out, b[1])

    return ht.ModelTask(
        lambda: torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Dropout(0.1), torch.nn.ReLU(),
                                    torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4)),
        lambda m: torch.optim.AdamW(m.parameters(), lr=config["lr"], weight_decay=0.01), data,
        loss=loss, epochs=config.get("epochs", EPOCHS), seed=config.get("seed", 1),
        name=name, resume_from=resume_from, resume_hparams=config.get("resume_hparams", "checkpoint"))


def asha_fn(config: dict) -> None:
    ctx = tune.get_context()
    task = make_task(config, f"{ctx.get_trial_id()}")
    for metrics in ht.train(task):
        tune.report(dict(metrics, runtime_node=ray.get_runtime_context().get_node_id(), runtime_pid=os.getpid(),
                         trial_seen=ctx.get_trial_id()))


def ckpt_fn(config: dict) -> None:
    ctx = tune.get_context()
    resume, tmp = None, tempfile.mkdtemp()
    ck = tune.get_checkpoint()
    if ck is not None:
        with ck.as_directory() as d:
            resume = shutil.copy(os.path.join(d, "task.pt"), os.path.join(tmp, "resume.pt"))
    task = make_task(config, f"{ctx.get_trial_id()}-{'resumed' if resume else 'first'}-{time.time_ns()}",
                     resume_from=resume)
    for metrics in ht.train(task):
        d = tempfile.mkdtemp()
        saved = ht.save_checkpoint(os.path.join(d, "task.pt"), timeout=60)   # None once the task has finished
        tune.report(dict(metrics, resumed=resume is not None),
                    checkpoint=tune.Checkpoint.from_directory(d) if saved else None)
        if metrics["epoch"] == config["fail_at"] and not os.path.exists(config["marker"]):
            open(config["marker"], "w").close()
            raise RuntimeError("injected failure after a checkpoint")
    torch.save(ht.current_handle().model().state_dict(), config["out"])


# It runs a cluster of its own (shutting down any local Ray): conftest runs it after the tests that share the local
# Ray (they are moved together), and `ray` puts it in their xdist group, so no other process's Ray runs beside it.
# Head + 1 worker node, 2 trials (one per node, as proxy_cpus=1 makes them): a node that starts costs ~5-10 s on 2
# busy cores. HYDRA_TUNE_BIG_TESTS=1 runs it with the head + 2 workers and 3 trials it had before.
@pytest.mark.ray
def test_multi_node_trials_train_on_their_own_node():
    from ray.cluster_utils import Cluster

    n_workers = 2 if os.environ.get("HYDRA_TUNE_BIG_TESTS") == "1" else 1
    lrs = [1e-2, 1e-3, 1e-4][: n_workers + 1]
    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=1) for _ in range(n_workers)]
    cluster.wait_for_nodes()
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        ex = ht.HydraExecutor(devices=["cpu"], proxy_cpus=1, report_proxy_modules=True)
        results = tune.Tuner(ex.wrap(asha_fn), param_space={"lr": tune.grid_search(lrs),
                                                            "epochs": 2, "nb": 8},
                             tune_config=tune.TuneConfig(max_concurrent_trials=len(lrs)),
                             run_config=tune.RunConfig(callbacks=[ex], verbose=0,
                                                       storage_path=tempfile.mkdtemp())).fit()
        assert results.num_errors == 0, [r.error for r in results]
        used = {r.metrics["runtime_node"] for r in results}
        assert {w.node_id for w in workers} <= used, used
        for r in results:   # the trial's proxy and the runtime that trained it share a node
            assert r.metrics["runtime_node"] == r.metrics["proxy_node"]
            stats = ex.final_stats[r.metrics["runtime_node"]]
            assert stats["tasks"][r.metrics["trial_id"]]["state"] == "done"
        assert len(ex.final_stats) == len(lrs)   # one runtime per node, each trained a trial
    finally:
        ray.shutdown()
        cluster.shutdown()


def _direct(config: dict) -> tuple[list[dict], dict]:
    """The trial's task straight on an in-process Runtime (without ``pace``: its sleeps change no number)."""
    with ht.Runtime(devices=["cpu"]) as rt:
        h = rt.submit(make_task(dict(config, pace=0.0), "direct"))
        return list(h.metrics()), h.model().state_dict()


def test_asha_drop_in_cancels_stopped_trials_and_matches_direct_runs(local_ray, tmp_path):
    ex = ht.HydraExecutor(devices=["cpu"], report_proxy_modules=True)
    # epochs of >= 0.2 s (24 steps sleeping 8 ms each in the loss, as 96 steps without sleeps took): ASHA's stops
    # land mid-task; the direct runs below are 4x cheaper than with 96 batches
    space = {"lr": tune.grid_search([3e-2, 1e-2, 1e-3, 1e-4]), "nb": 24, "pace": 0.008}
    tuner = tune.Tuner(ex.wrap(asha_fn), param_space=space,
                       tune_config=tune.TuneConfig(metric="train_loss", mode="min", max_concurrent_trials=4,
                                                   scheduler=ASHAScheduler(max_t=EPOCHS, grace_period=1,
                                                                           reduction_factor=2)),
                       run_config=tune.RunConfig(callbacks=[ex], storage_path=str(tmp_path), name="asha", verbose=0))
    results = tuner.fit()
    assert results.num_errors == 0, [r.error for r in results]
    stopped = [r for r in results if r.metrics["training_iteration"] < EPOCHS]
    assert len(results) == 4 and stopped, [r.metrics["training_iteration"] for r in results]
    node_stats = ex.final_stats
    assert len(node_stats) == 1
    tasks = next(iter(node_stats.values()))["tasks"]
    for r in results:
        m = r.metrics
        assert all(k in m for k in KEYS + ("runtime_pid", "trial_seen")), m
        assert m["trial_seen"] == m["trial_id"]
        assert m["proxy_torch_loaded"] is False and m["proxy_hydra_tune_loaded"] is False   # (c)
        assert m["runtime_pid"] != m["pid"]                      # trained in the runtime actor, not the proxy
        df = r.metrics_dataframe
        assert list(df["epoch"]) == list(range(1, len(df) + 1))  # every report reached Tune
        expected = "done" if m["training_iteration"] == EPOCHS else "cancelled"
        assert tasks[m["trial_id"]]["state"] == expected, (m["trial_id"], tasks[m["trial_id"]])
        # (b) same task straight on a Runtime, for the epochs the trial ran (epoch k never depends on later ones)
        direct, _ = _direct(dict(r.config, epochs=len(df)))
        assert [(d["epoch"], d["train_loss"], d["steps"]) for d in direct[: len(df)]] == list(
            zip(df["epoch"], df["train_loss"], df["steps"]))
    assert sum(t["state"] == "cancelled" for t in tasks.values()) == len(stopped)


def test_wrap_alone_creates_runtimes_lazily(local_ray, tmp_path):
    ex = ht.HydraExecutor(devices=["cpu"], report_proxy_modules=True)
    results = tune.Tuner(ex.wrap(asha_fn), param_space={"lr": tune.grid_search([1e-2, 1e-3]), "epochs": 2, "nb": 8},
                         run_config=tune.RunConfig(storage_path=str(tmp_path), name="lazy", verbose=0)).fit()
    assert results.num_errors == 0, [r.error for r in results]
    assert {r.metrics["runtime_pid"] for r in results} != {r.metrics["pid"] for r in results}
    assert len({r.metrics["runtime_pid"] for r in results}) == 1          # one shared runtime on the node
    ex.shutdown()                                                         # removes the detached runtimes by name
    assert all(t["state"] == "done" for st in ex.final_stats.values() for t in st["tasks"].values())
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("hydra_rt_")]


@pytest.mark.parametrize("bad", [{"host_memory": "lots"}, {"policy": "sjf"}, {"device_memory": 0},
                                 {"devices": ["cpu"], "config": ht.RuntimeConfig(devices=["cpu"])}])
def test_bad_runtime_settings_raise_at_the_executor_with_the_runtimes_message(bad):
    kw = dict({"devices": ["cpu"]}, **bad)
    with pytest.raises(Exception) as expected:
        ht.Runtime(**kw)
    with pytest.raises(type(expected.value)) as got:
        ht.HydraExecutor(**kw)
    assert str(got.value) == str(expected.value)


def test_runtime_settings_and_config_reach_every_nodes_runtime(local_ray, monkeypatch):
    from hydra_tune.runtime.progress import ENV

    monkeypatch.delenv(ENV, raising=False)
    ht.HydraExecutor(devices=["cpu"]).shutdown()   # no runtime actor left from an earlier test (it keeps its settings)
    # each runtime actor costs a process start: the two executors check every setting, `progress=` given and not
    # (tests/test_progress_rates.py checks its validation and its reading of the environment)
    for ex, progress in ((ht.HydraExecutor(devices=["cpu"], host_memory="1GiB", policy="fifo", progress=7), 7.0),
                         (ht.HydraExecutor(config=ht.RuntimeConfig(devices=["cpu", "cpu"], host_memory="1GiB",
                                                                   policy="fifo")), None)):
        try:
            where = ex.start_runtimes()
            assert [w["progress"] for w in where.values()] == [progress]
            (stats,) = ex.runtime_stats().values()
            assert stats["policy"] == "fifo" and stats["host"]["budget"] == 1 << 30
            assert stats["device_names"] == [f"cpu:{i}" for i in range(len(ex.config.devices))]
        finally:
            ex.shutdown()


def test_restore_after_failure_is_bit_identical(local_ray, tmp_path):
    config = {"lr": 1e-2, "epochs": 4, "fail_at": 2, "marker": str(tmp_path / "failed"), "out": str(tmp_path / "w.pt")}
    ex = ht.HydraExecutor(devices=["cpu"])
    results = tune.Tuner(ex.wrap(ckpt_fn), param_space=config,
                         run_config=tune.RunConfig(callbacks=[ex], storage_path=str(tmp_path), name="ckpt", verbose=0,
                                                   failure_config=tune.FailureConfig(max_failures=1))).fit()
    assert results.num_errors == 0, [r.error for r in results]
    assert os.path.exists(config["marker"])                       # it did fail once
    r = results[0]
    assert r.metrics["resumed"] is True and r.metrics["epoch"] == 4
    direct, weights = _direct(config)
    got = torch.load(config["out"])
    assert all(torch.equal(weights[k], got[k]) for k in weights)  # bit-identical to the uninterrupted run
    assert r.metrics["train_loss"] == direct[-1]["train_loss"]


@pytest.mark.serial   # one CI run in six of stop 41, beside the parallel run's other worker, ended a trial at epoch
@pytest.mark.filterwarnings("ignore:Consider boosting PBT performance")   # 3 (no error); alone it passed every time
def test_pbt_exploit_restores_other_trials_checkpoints(local_ray, tmp_path):
    from ray.tune.schedulers import PopulationBasedTraining

    ex = ht.HydraExecutor(devices=["cpu"])
    space = {"lr": tune.grid_search([1e-2, 1e-4]), "epochs": 6, "nb": 16, "fail_at": -1, "resume_hparams": "task",
             "marker": str(tmp_path / "unused"), "out": str(tmp_path / "w.pt")}
    pbt = PopulationBasedTraining(time_attr="training_iteration", perturbation_interval=2, quantile_fraction=0.5,
                                  synch=True, hyperparam_mutations={"lr": [1e-2, 1e-3, 1e-4]})
    results = tune.Tuner(ex.wrap(ckpt_fn), param_space=space,
                         tune_config=tune.TuneConfig(metric="train_loss", mode="min", scheduler=pbt),
                         run_config=tune.RunConfig(callbacks=[ex], storage_path=str(tmp_path), name="pbt",
                                                   verbose=0)).fit()
    assert results.num_errors == 0, [r.error for r in results]
    assert all(r.metrics["epoch"] == 6 for r in results), [r.metrics for r in results]
    assert any(r.metrics["resumed"] for r in results)             # an exploit restored a checkpoint
    assert all(r.metrics["lr"] == r.config["lr"] for r in results)  # ... and the explored lr applies
    tasks = next(iter(ex.final_stats.values()))["tasks"]
    assert len(tasks) > 2 and all(t["state"] in ("done", "cancelled") for t in tasks.values()), tasks


def test_killed_runtime_actor_trials_resume_from_last_checkpoint(local_ray, tmp_path):
    import threading
    import time

    from hydra_tune.integrations import _tune_proxy

    # epochs of >= 0.16 s (16 steps sleeping 10 ms each in the loss): the kill lands before the last one ends
    config = {"lr": 1e-2, "epochs": 5, "nb": 16, "pace": 0.01, "fail_at": -1, "marker": str(tmp_path / "unused"),
              "out": str(tmp_path / "w.pt")}
    ex = ht.HydraExecutor(devices=["cpu"])
    killed: list[float] = []

    def killer() -> None:   # kill the node's runtime actor once the trial has reported a checkpoint
        deadline = time.time() + 60
        while time.time() < deadline and not killed:
            trial_dirs = list((tmp_path / "kill").glob("*/checkpoint_000001"))
            if trial_dirs:
                node = ray.get_runtime_context().get_node_id()
                ray.kill(ray.get_actor(_tune_proxy.actor_name(node), namespace=_tune_proxy.NAMESPACE),
                         no_restart=True)
                killed.append(time.time())
            time.sleep(0.05)

    threading.Thread(target=killer, daemon=True).start()
    results = tune.Tuner(ex.wrap(ckpt_fn), param_space=config,
                         run_config=tune.RunConfig(callbacks=[ex], storage_path=str(tmp_path), name="kill", verbose=0,
                                                   failure_config=tune.FailureConfig(max_failures=2))).fit()
    assert killed, "the runtime actor was never killed"
    assert results.num_errors == 0, [r.error for r in results]
    r = results[0]
    assert r.metrics["resumed"] is True and r.metrics["epoch"] == 5
    _, weights = _direct(config)
    got = torch.load(config["out"])
    assert all(torch.equal(weights[k], got[k]) for k in weights)
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("hydra_rt_")]
