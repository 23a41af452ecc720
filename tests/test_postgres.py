"""Optuna on a real PostgreSQL server (started here from the `pgserver` package): two worker processes, each with
its own node runtime server (as on two machines), share one study; a SIGKILLed process's trial is failed by the
heartbeat, and its task is freed by its node's server.

Needs the `postgres` extra (pgserver, psycopg2-binary: part of `test`); skipped with the reason otherwise.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

import pytest

optuna = pytest.importorskip("optuna")
pgserver = pytest.importorskip("pgserver", reason="PostgreSQL tests need pgserver: pip install 'hydra_tune[postgres]'")
pytest.importorskip("psycopg2", reason="PostgreSQL tests need psycopg2: pip install 'hydra_tune[postgres]'")
import optuna_worker as worker  # noqa: E402  (tests/ is on sys.path: conftest)

import hydra_tune as ht  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def pg_url():
    """A PostgreSQL server of its own in a temporary data directory, deleted afterwards; its SQLAlchemy URL."""
    data = tempfile.mkdtemp(prefix="htpg", dir="/tmp")   # short: the server's Unix socket lives in it
    server = pgserver.get_server(data, cleanup_mode="delete")
    uri = server.get_uri()   # postgresql://postgres:@/postgres?host=<socket dir>
    yield "postgresql+psycopg2://" + uri.split("://", 1)[1]   # psycopg2: SQLAlchemy 2.1 defaults to psycopg 3
    server.cleanup()
    shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
def machines(monkeypatch):
    """Two node-server directories: a process with one of them never finds the other's runtime server, as on two
    machines. This process uses the first."""
    dirs = [tempfile.mkdtemp(prefix=f"htm{i}", dir="/tmp") for i in range(2)]
    monkeypatch.setenv("HYDRA_TUNE_NODE_DIR", dirs[0])
    monkeypatch.setenv("HYDRA_TUNE_NODE_LINGER", "2")
    yield dirs
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def _start(url: str, study: str, n: int, mode: str, out: str, node_dir: str) -> subprocess.Popen:
    env = dict(os.environ, HYDRA_TUNE_NODE_DIR=node_dir)
    return subprocess.Popen([sys.executable, os.path.join(HERE, "optuna_worker.py"), url, study, str(n), mode, out],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _storage(url: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(url, heartbeat_interval=1)


def test_two_machines_share_one_postgres_study(pg_url, machines, tmp_path):
    outs = [str(tmp_path / f"w{i}.json") for i in range(2)]
    # the study is created once, as a deployment would; both workers then load it (load_if_exists)
    optuna.create_study(study_name="pg-shared", storage=pg_url, direction="minimize")
    procs = [_start(pg_url, "pg-shared", 3, "run", out, d) for out, d in zip(outs, machines)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    seen = [json.load(open(out)) for out in outs]
    assert seen[0]["server_pid"] != seen[1]["server_pid"]   # two node runtimes, one study
    trials = optuna.load_study(study_name="pg-shared", storage=pg_url).trials
    assert sorted(t.number for t in trials) == list(range(6))
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 6
    assert {n for s in seen for n, _, _ in s["trials"]} == set(range(6))   # each trial ran in one process only
    # every value PostgreSQL holds is what the same task gives when run alone on an in-process runtime
    with ht.Runtime(devices=["cpu"]) as rt:
        for t in trials:
            assert t.value == rt.submit(worker.task(t.params["lr"], 3)).result()["eval_loss"], t.number


def test_killed_machine_trial_is_failed_and_the_other_machine_goes_on(pg_url, machines, tmp_path):
    """SIGKILL a worker mid-trial: its node's server cancels the trial's task at once; the other machine's next
    optimize runs Optuna's fail_stale_trials itself (heartbeat 1 s, grace 2 s), so the dead trial is FAIL there
    without any manual step, and the new trial completes."""

    optuna.create_study(study_name="pg-killed", storage=pg_url, direction="minimize")
    proc = _start(pg_url, "pg-killed", 1, "hang", "-", machines[0])
    worker.kill_mid_trial(proc)   # that machine's server cancels the dead worker's task at once
    study = optuna.load_study(study_name="pg-killed", storage=_storage(pg_url))
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.RUNNING]   # until someone checks
    time.sleep(3)   # past 2 x heartbeat_interval since the dead trial's last heartbeat
    other = _start(pg_url, "pg-killed", 1, "run", str(tmp_path / "w.json"), machines[1])
    _, err = other.communicate(timeout=300)
    assert other.returncode == 0, err[-3000:]
    states = [t.state for t in optuna.load_study(study_name="pg-killed", storage=pg_url).trials]
    assert states == [optuna.trial.TrialState.FAIL, optuna.trial.TrialState.COMPLETE]
