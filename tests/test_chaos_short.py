"""Faults at search scale, the short versions that run in `make test` (the long ones: tests/test_chaos.py and
tests/test_tune_chaos.py with HYDRA_TUNE_CHAOS=1, benchmarks/chaos_optuna.py, benchmarks/chaos_tune.py).

Every fault lands at an event, not a timer, so the number of faults and whom they hit do not depend on the machine's
load: an Optuna worker process is SIGKILLed once its trial has reported its first epoch, recorded a heartbeat and
trains in the node server; in a Tune search (on the tests' shared local Ray) a trial's proxy is SIGKILLed when it
reports epoch 2 and the runtime actor is killed when another trial reports epoch 2.
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


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting until {what}")
        time.sleep(0.02)


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


def test_optuna_worker_killed_mid_trial_is_failed_cancelled_and_replaced():
    optuna = pytest.importorskip("optuna")
    import warnings

    import chaos_optuna

    from hydra_tune import node

    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
    base = tempfile.mkdtemp(prefix="htq", dir="/tmp")   # short: socket paths are limited to 107 bytes
    saved = {k: os.environ.get(k) for k in ("HYDRA_TUNE_NODE_DIR", "HYDRA_TUNE_NODE_LINGER")}
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
            found: list = []
            _wait(lambda: found.append(_victim(pool, observer, db_path)) or found[-1], 120,
                  "a worker's trial reported epoch 1 with a heartbeat")
            victim, number, task = found[-1]
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
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        shutil.rmtree(base, ignore_errors=True)
