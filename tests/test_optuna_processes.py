"""Optuna across processes: two processes on one SQLite storage share one runtime; a killed process's trial is
failed by the heartbeat and its task is freed by the node's runtime server."""
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
import optuna_worker as worker  # noqa: E402  (tests/ is on sys.path: conftest)

import hydra_tune as ht  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def node_dir(monkeypatch):
    d = tempfile.mkdtemp(prefix="htn", dir="/tmp")   # short: a Unix socket path has ~107 bytes
    monkeypatch.setenv("HYDRA_TUNE_NODE_DIR", d)
    monkeypatch.setenv("HYDRA_TUNE_NODE_LINGER", "2")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _start(db: str, study: str, n: int, mode: str, out: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.join(HERE, "optuna_worker.py"), db, study, str(n), mode, out],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_processes_on_one_sqlite_storage_share_one_runtime(node_dir, tmp_path):
    db = f"sqlite:///{tmp_path / 'study.db'}"
    outs = [str(tmp_path / f"w{i}.json") for i in range(2)]
    procs = [_start(db, "shared", 3, "run", out) for out in outs]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    seen = [json.load(open(out)) for out in outs]
    assert seen[0]["pid"] != seen[1]["pid"]
    assert seen[0]["server_pid"] == seen[1]["server_pid"] not in (seen[0]["pid"], seen[1]["pid"])
    trials = optuna.load_study(study_name="shared", storage=db).trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 6
    # every value the storage holds is what the same task gives when run alone on an in-process runtime
    with ht.Runtime(devices=["cpu"]) as rt:
        for t in trials:
            assert t.value == rt.submit(worker.task(t.params["lr"], 3)).result()["eval_loss"], t.number


def test_killed_process_trial_is_failed_and_its_task_freed(node_dir, tmp_path):

    db = f"sqlite:///{tmp_path / 'study.db'}"
    proc = _start(db, "killed", 1, "hang", "-")
    stats = worker.kill_mid_trial(proc)   # its node's server cancels the dead worker's task at once
    assert all(d["current_bytes"] == 0 for d in stats["devices"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        storage = optuna.storages.RDBStorage(db, heartbeat_interval=1)
    study = optuna.load_study(study_name="killed", storage=storage)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.RUNNING]
    deadline = time.time() + 20   # the grace period is 2 x heartbeat_interval after its last heartbeat
    while study.trials[0].state == optuna.trial.TrialState.RUNNING and time.time() < deadline:
        time.sleep(0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)   # what Optuna runs before each trial of every process
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.FAIL]


def _objective(trial):
    for m in ht.train(worker.task(trial.suggest_float("lr", 0.01, 0.1), 2)):
        trial.report(m["eval_loss"], m["epoch"])
    return m["eval_loss"]


def test_journal_file_storage_runs_on_the_node_runtime(node_dir, tmp_path):
    from optuna.storages import JournalStorage
    try:
        from optuna.storages.journal import JournalFileBackend
    except ImportError:   # optuna < 4.0 (benchmarks/compat.sh): the same file backend under its first name
        from optuna.storages import JournalFileStorage as JournalFileBackend

    path = str(tmp_path / "journal.log")
    with ht.optuna_study(direction="minimize", storage=JournalStorage(JournalFileBackend(path)), study_name="j",
                         devices=worker.DEVICES, device_memory=worker.BUDGET) as study:
        assert type(study.runtime).__name__ == "NodeRuntime"   # persistent storage: other processes may join
        study.optimize(_objective, n_trials=3)
    reloaded = optuna.load_study(study_name="j", storage=JournalStorage(JournalFileBackend(path)))
    assert [t.state for t in reloaded.trials] == [optuna.trial.TrialState.COMPLETE] * 3
    with ht.Runtime(devices=["cpu"]) as rt:
        for t in reloaded.trials:
            assert t.value == rt.submit(worker.task(t.params["lr"], 2)).result()["eval_loss"]


def test_share_process_keeps_an_sqlite_study_in_this_process(node_dir, tmp_path):
    with ht.optuna_study(direction="minimize", storage=f"sqlite:///{tmp_path / 's.db'}", share="process",
                         devices=worker.DEVICES, device_memory=worker.BUDGET) as study:
        assert isinstance(study.runtime, ht.Runtime)
        study.optimize(_objective, n_trials=2)
        assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"]
    assert not os.listdir(node_dir) or not any(f.endswith(".sock") for f in os.listdir(node_dir))
