"""A study with persistent storage shares the node's runtime server (another process) for its ModelTasks; a
prepared model, driven by this process's loop, trains on a runtime in this process instead (with a
RuntimeWarning), and equals its plain run."""
from __future__ import annotations

import os
import pickle
import shutil
import tempfile

import pytest
from test_prepare_exactness import _diff
from test_prepare_streams import seeded_trial

import hydra_tune as ht


class _NodeClient:
    """Stands for ``hydra_tune.node.connect(...)`` (no server process started): a task submitted to it is
    pickled, as the real client sends it to the server."""

    devices = 1

    def __init__(self, config=None) -> None:
        self.submitted = 0

    def submit(self, task):
        pickle.dumps(task)  # a prepared task refuses this (PreparedTask.__reduce__)
        self.submitted += 1
        raise AssertionError("a ModelTask would train on the server")

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


@pytest.fixture
def node_dir(monkeypatch):
    """HYDRA_TUNE_NODE_SERVER_TEST=1: the node's real runtime server (a process: seconds), else a stand-in."""
    if os.environ.get("HYDRA_TUNE_NODE_SERVER_TEST") != "1":
        from hydra_tune import node

        monkeypatch.setattr(node, "connect", _NodeClient)
        yield None
        return
    d = tempfile.mkdtemp(prefix="htn", dir="/tmp")   # this test's own node server (a short Unix socket path)
    monkeypatch.setenv("HYDRA_TUNE_NODE_DIR", d)
    monkeypatch.setenv("HYDRA_TUNE_NODE_LINGER", "1")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_prepared_model_in_a_sqlite_study_trains_on_a_process_local_runtime(node_dir, tmp_path):
    import optuna

    want = seeded_trial(5)
    got = {}
    study = ht.optuna_study(storage=f"sqlite:///{tmp_path}/hpo.db", devices=["cpu"], device_memory="24KiB",
                            sampler=optuna.samplers.RandomSampler(seed=0))
    try:
        def objective(trial: optuna.Trial) -> float:
            got["result"] = seeded_trial(5, ht.prepare)
            return 0.0

        with pytest.warns(RuntimeWarning, match="prepared models train on a runtime in this process"):
            study.optimize(objective, n_trials=1, n_jobs=1)
        assert study.trials[0].state == optuna.trial.TrialState.COMPLETE
    finally:
        study.close()
    assert _diff(want[0], got["result"][0]) == 0.0 and want[1] == got["result"][1]
