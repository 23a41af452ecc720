"""Faults at search scale, the short versions that run in `make test` (the long ones: tests/test_chaos.py and
tests/test_tune_chaos.py with HYDRA_TUNE_CHAOS=1, benchmarks/chaos_optuna.py, benchmarks/chaos_tune.py).

Every fault lands at an event, not a timer, so the number of faults and whom they hit do not depend on the machine's
load: an Optuna worker process is SIGKILLed once its trial has reported its first epoch, recorded a heartbeat and
trains in the node server; in a Tune search (on the tests' shared local Ray) a trial's proxy is SIGKILLed when it
reports epoch 2 and the runtime actor is killed at the first report of epoch 3 (Tune callbacks in the driver). The
node-removal fault needs a cluster of its own (35-60 s to start): it stays in the opt-in 3-node search.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)


def _wait_for(find, timeout: float, what: str):
    """The first truthy value of ``find()``, polled every 20 ms."""
    deadline = time.monotonic() + timeout
    while not (found := find()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting until {what}")
        time.sleep(0.02)
    return found


# -- Optuna: a worker process SIGKILLed mid-trial and restarted ------------------------------------------------------
EPOCHS = 12   # a trial trains ~1-2 s: the kill lands seconds before its end, whatever the load


def _victim(pool, observer, db_path: str):
    """The first worker whose trial reported epoch 1, recorded a heartbeat and is training in the server now."""
    import chaos_optuna

    for w in pool:
        for number, task in list(w.running.items()):
            st = observer.stats()["tasks"].get(task)
            if (st is not None and st["state"] == "running" and chaos_optuna.has_heartbeat(db_path, number)
                    and w.proc.poll() is None):
                return w, number, task
    return None


def test_optuna_chaos_worker_writes_each_line_in_one_write(monkeypatch):
    """The worker's trials run in threads: a line written in two writes (print's text, then its newline) can be split
    by another thread's line, and the driver read "START 0START 1" (its reader thread died on it)."""
    import io

    import chaos_optuna

    writes: list[str] = []

    class Recorder(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

    monkeypatch.setattr(sys, "stdout", Recorder())
    chaos_optuna.say("START 3")
    assert writes == ["START 3\n"]


def test_optuna_worker_killed_mid_trial_is_failed_cancelled_and_replaced(monkeypatch):
    optuna = pytest.importorskip("optuna")
    import warnings

    import chaos_optuna

    from hydra_tune import node

    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
    base = tempfile.mkdtemp(prefix="htq", dir="/tmp")   # short: socket paths are limited to 107 bytes
    for k in ("HYDRA_TUNE_NODE_DIR", "HYDRA_TUNE_NODE_LINGER"):   # node_env sets them: restored after the test
        monkeypatch.setenv(k, "")
    pool: list = []
    try:
        env = chaos_optuna.node_env(base)
        db_path, n_trials = f"{base}/study.db", 2
        storage = f"sqlite:///{db_path}"
        optuna.create_study(storage=storage, study_name="short", direction="minimize")
        args = [storage, "short", str(n_trials), str(EPOCHS), "1"]   # one trial at a time: the kill hits exactly it
        observer = node.connect(devices=chaos_optuna.DEVICES, device_memory=chaos_optuna.BUDGET)
        server_pid = observer.pid
        try:
            pool += [chaos_optuna.Worker(args, env) for _ in range(2)]
            victim, number, task = _wait_for(lambda: _victim(pool, observer, db_path), 120,
                                             "a worker's trial reported epoch 1 with a heartbeat")
            killed, _ = chaos_optuna.kill_and_replace(pool, victim, observer, args, env)
        finally:
            observer.close()
        for w in pool:
            w.proc.wait(timeout=300)
        assert all(w.proc.returncode == 0 for w in pool), ["".join(w.err)[-2000:] for w in pool]
        # the server ended the dead client's task by cancelling it (it had epochs left)
        assert [(k["trial"], k["task"], k["state"]) for k in killed] == [(number, task, "cancelled")], killed
        states, never_beat = chaos_optuna.study_end(storage, "short", db_path)
        assert states[str(number)] == "FAIL" and never_beat == []   # heartbeat + fail_stale_trials
        assert sum(s == "COMPLETE" for s in states.values()) >= n_trials, states
        assert "RUNNING" not in states.values(), states
        assert not chaos_optuna.server_outlives(server_pid)   # the server lingered out after the last client
    finally:
        for w in pool:
            if w.proc.poll() is None:
                w.proc.kill()
        shutil.rmtree(base, ignore_errors=True)


# -- Tune: a trial's proxy SIGKILLed and the runtime actor killed, each once, in an ASHA search ------------------------
TRIALS, TUNE_EPOCHS = 3, 4   # ASHA (grace 1, reduction 2, max_t 4 epochs): a trial ends at epoch 1, 2 or 4


def _faults_callback():
    """A Tune callback that SIGKILLs the proxy of the first trial to report epoch 2 and kills the runtime actor at the
    first report of epoch 3 (the first trial past ASHA's rung 2 always goes on to epoch 4, so both happen)."""
    import signal

    import ray
    from ray import tune

    from hydra_tune.integrations import _tune_proxy

    class Faults(tune.Callback):
        def __init__(self) -> None:
            self.done: list[tuple[str, str, int]] = []   # (kind, trial id, epoch it reported)
            self.killed: list[tuple[str, float]] = []     # (trial id, time) of train_fn threads the actor took along

        def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
            kinds = [k for k, _, _ in self.done]
            if result["epoch"] == 2 and "proxy" not in kinds:
                os.kill(result["pid"], signal.SIGKILL)
                self.done.append(("proxy", trial.trial_id, 2))
            elif result["epoch"] == 3 and "actor" not in kinds:
                actor = ray.get_actor(_tune_proxy.actor_name(result["proxy_node"]), namespace=_tune_proxy.NAMESPACE)
                threads = ray.get(actor.stats.remote())["threads"]
                ray.kill(actor, no_restart=True)
                self.killed += [(t, time.time()) for t in threads]
                self.done.append(("actor", trial.trial_id, 3))

    return Faults()


def _direct_losses(config: dict, rt) -> list[tuple[int, float]]:
    """The trial's task run straight on the in-process runtime ``rt``, fault-free: (epoch, train loss) per epoch."""
    import chaos_tune

    import hydra_tune as ht

    return [(m["epoch"], m["train_loss"]) for m in ht.train(chaos_tune.make_task(config, "direct", None), rt)]


def test_tune_search_with_killed_proxy_and_runtime_actor_loses_nothing_and_resumes_exactly(local_ray, tmp_path):
    ray = pytest.importorskip("ray")
    import chaos_tune
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    import hydra_tune as ht

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    ex = ht.HydraExecutor(devices=["cpu"], report_proxy_modules=True)
    watch, faults = chaos_tune.Watch(ex), _faults_callback()
    space = {"i": tune.grid_search(list(range(TRIALS))), "n": TRIALS, "nb": 8, "epochs": TUNE_EPOCHS,
             "scratch": str(scratch)}
    tuner = tune.Tuner(ex.wrap(chaos_tune.train_fn), param_space=space,
                       tune_config=tune.TuneConfig(metric="loss", mode="min", max_concurrent_trials=TRIALS,
                                                   scheduler=ASHAScheduler(time_attr="epoch", max_t=TUNE_EPOCHS,
                                                                           grace_period=1, reduction_factor=2)),
                       run_config=tune.RunConfig(name="short", storage_path=str(tmp_path / "storage"), verbose=0,
                                                 callbacks=[faults, watch, ex],   # watch sees the runtimes before ex
                                                 failure_config=tune.FailureConfig(max_failures=2)))   # stops them
    try:
        results = tuner.fit()
    finally:
        ex.shutdown()
    assert [k for k, _, _ in faults.done] == ["proxy", "actor"], faults.done
    # the proxy's trial restarted; a trial whose train_fn the actor kill took along restarted too, unless it had sent
    # its last result already (the task trains ahead of train_fn): the checks below find any trial lost either way
    assert watch.restarted_after(faults.done[0][1], 0.0), (faults.done, watch.recoveries)
    assert results.num_errors == 0, [r.error for r in results]
    # no trial lost: each ended at one of its scheduler's ends (an ASHA rung or max_t). ASHA counts the task's own
    # epochs, not Tune's training_iteration: a checkpoint taken when train_fn handles epoch k's metrics holds the task
    # at its next step boundary, which can be past the end of epoch k+1 when train_fn lagged (it waits for Tune's
    # ack of each report while the task trains on); a trial restored from it reports epoch k+2 as iteration k+1
    assert sorted(r.config["i"] for r in results) == list(range(TRIALS))
    assert all(r.metrics["epoch"] in (1, 2, TUNE_EPOCHS) for r in results), [r.metrics["epoch"] for r in results]
    # exact resume: every report, repeated epochs after a restore included, equals the fault-free direct run's
    resumed = 0
    with ht.Runtime(devices=["cpu"]) as rt:
        for r in results:
            df = r.metrics_dataframe
            direct = dict(_direct_losses(r.config, rt))
            rows = [(int(e), float(v)) for e, v in zip(df["epoch"], df["loss"])]
            assert [(e, direct[e]) for e, _ in rows] == rows, r.config["i"]
            assert max(e for e, _ in rows) == r.metrics["epoch"]
            resumed += bool(df["resumed"].any())
    assert resumed >= 1   # at least the proxy's trial restarted from a checkpoint
    # no orphans: no train_fn thread nor task alive in the runtime at the end, no runtime actor after shutdown, no
    # proxy/runtime process, no checkpoint temp file, no trial folder left (but that of a trial whose thread the actor
    # kill took along before its train_fn's `finally` could run, and which Tune did not restart: no incarnation of it
    # came to remove it)
    assert watch.at_end["runtime_pids"], watch.at_end   # it read the runtimes' threads and tasks before they stopped
    left = chaos_tune.orphans(watch, str(tmp_path), str(scratch), faults.killed)
    assert chaos_tune.orphan_count(left) == 0, ({k: v for k, v in left.items() if v},   # what was left, and why
                                                 faults.killed, watch.recoveries)
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("hydra_rt_")]
