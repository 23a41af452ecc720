"""The progress line's samples/s (from the tasks' ``samples_trained`` counters), and ``progress=`` on the Ray Tune
executor and the Optuna study: validated once where it is given, meaning what ``Runtime(progress=N)`` means."""
from __future__ import annotations

import logging
import threading
import time

import pytest
from test_progress import LOGGER, _task

import hydra_tune as ht
from hydra_tune.runtime.progress import ENV, status_line


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def _wait_for(caplog, pred, seconds: float = 120) -> str:
    deadline = time.monotonic() + seconds
    while True:
        hits = [ln for ln in _lines(caplog) if pred(ln)]
        if hits:
            return hits[0]
        assert time.monotonic() < deadline, _lines(caplog)
        time.sleep(0.05)


def _progress_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hydra_tune-progress"]


def test_status_line_shows_samples_and_steps_per_second():
    before = {"devices": [{"name": "cpu0", "busy_seconds": 1.0}],
              "tasks": {"a": {"state": "running", "steps": 10, "samples_trained": 320}}}
    now = {"devices": [{"name": "cpu0", "busy_seconds": 2.0}],
           "tasks": {"a": {"state": "running", "steps": 30, "samples_trained": 960},
                     "b": {"state": "done", "steps": 4, "samples_trained": 40}}}
    assert status_line(now, before, 2.0) == ("hydra_tune: tasks 1 running, 0 queued, 1 done | devices busy 1/1 "
                                             "(cpu0 50%) | 340.0 samples/s, 12.0 steps/s")


def test_tasks_count_the_samples_they_trained_and_the_line_shows_their_rate(monkeypatch, caplog):
    monkeypatch.delenv(ENV, raising=False)
    caplog.set_level(logging.INFO, logger=LOGGER)
    with ht.Runtime(devices=["cpu", "cpu"], progress=0.2) as rt:
        handles = [rt.submit(_task(f"s{i}", batches=150)) for i in range(2)]
        line = _wait_for(caplog, lambda ln: "samples/s" in ln and " 0.0 samples/s" not in ln)
        for h in handles:
            h.result(timeout=300)
        tasks = rt.stats()["tasks"]
    assert [tasks[f"s{i}"]["samples_trained"] for i in range(2)] == [150 * 16] * 2   # 150 batches of 16
    assert line.endswith("steps/s") and float(line.split("| ")[-1].split(" samples/s")[0]) > 0


# -- Optuna ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, -2, "30", True])
def test_optuna_study_refuses_a_bad_progress(value):
    pytest.importorskip("optuna")
    with pytest.raises(ValueError, match="`progress` is None \\(off\\) or a number of seconds > 0"):
        ht.optuna_study(devices=["cpu"], progress=value)


def test_optuna_study_with_its_own_runtime_logs_progress(monkeypatch, caplog):
    optuna = pytest.importorskip("optuna")
    monkeypatch.delenv(ENV, raising=False)
    caplog.set_level(logging.INFO, logger=LOGGER)
    with ht.optuna_study(devices=["cpu"], progress=0.2, sampler=optuna.samplers.RandomSampler(seed=0)) as study:
        assert study.runtime.progress == 0.2
        study.optimize(lambda trial: list(ht.train(_task(f"o{trial.number}", batches=40)))[-1]["train_loss"],
                       n_trials=2)
        _wait_for(caplog, lambda ln: "samples/s" in ln)
    with ht.optuna_study(devices=["cpu"]) as quiet:   # unset: off
        assert quiet.runtime.progress is None


def test_optuna_study_on_a_given_runtime_logs_its_status_until_closed(monkeypatch, caplog):
    pytest.importorskip("optuna")
    monkeypatch.delenv(ENV, raising=False)
    caplog.set_level(logging.INFO, logger=LOGGER)
    before = len(_progress_threads())
    with ht.Runtime(devices=["cpu"]) as rt:
        study = ht.optuna_study(runtime=rt, progress=0.1)
        assert len(_progress_threads()) == before + 1
        study.optimize(lambda trial: list(ht.train(_task(f"g{trial.number}", batches=40)))[-1]["train_loss"],
                       n_trials=1)
        _wait_for(caplog, lambda ln: "1 done" in ln)
        study.close()
        assert len(_progress_threads()) == before


# -- Ray Tune --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, -1, "10", True, float("inf")])
def test_hydra_executor_refuses_a_bad_progress(value, monkeypatch):
    pytest.importorskip("ray")
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(ValueError, match="`progress` is None \\(off\\) or a number of seconds > 0"):
        ht.HydraExecutor(devices=["cpu"], progress=value)


def test_hydra_executor_reads_the_environment_once_in_the_driver(monkeypatch):
    pytest.importorskip("ray")
    monkeypatch.setenv(ENV, "soon")
    with pytest.raises(ValueError, match=f"`{ENV}` is a number of seconds > 0"):
        ht.HydraExecutor(devices=["cpu"])
    monkeypatch.setenv(ENV, "2.5")
    assert ht.HydraExecutor(devices=["cpu"]).runtime_settings()["progress"] == 2.5
    monkeypatch.delenv(ENV)
    assert ht.HydraExecutor(devices=["cpu"]).runtime_settings()["progress"] is None
    assert ht.HydraExecutor(devices=["cpu"], progress=7).runtime_settings()["progress"] == 7.0


# That every node's runtime actor gets the executor's `progress` (7, and None when not given) is checked where the
# runtime actors are started anyway: tests/test_ray_tune.py::test_runtime_settings_and_config_reach_every_nodes_runtime.
