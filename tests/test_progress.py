"""Runtime(progress=N): a one-line status (tasks by state, devices busy, steps/s) every N seconds at INFO on the
``hydra_tune.progress`` logger; off by default; bad values refused before any device starts."""
from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
import torch.nn.functional as F

import hydra_tune as ht
from hydra_tune.runtime.progress import ENV, status_line

LOGGER = "hydra_tune.progress"


def _task(name: str, batches: int = 400, epochs: int = 1) -> ht.ModelTask:
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)) for _ in range(batches)]
    return ht.ModelTask(lambda: torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)),
                        lambda m: torch.optim.SGD(m.parameters(), lr=0.01), data,
                        loss=lambda out, b: F.mse_loss(out, b[1]), epochs=epochs, seed=1, name=name)


def _progress_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hydra_tune-progress"]


def test_off_by_default(monkeypatch, caplog):
    monkeypatch.delenv(ENV, raising=False)
    caplog.set_level(logging.INFO, logger=LOGGER)
    before = len(_progress_threads())
    with ht.Runtime(devices=["cpu"]) as rt:
        assert len(_progress_threads()) == before
        rt.submit(_task("quiet", batches=20)).result(timeout=120)
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_status_lines_while_training_and_none_after_close(monkeypatch, caplog):
    monkeypatch.delenv(ENV, raising=False)
    caplog.set_level(logging.INFO, logger=LOGGER)
    rt = ht.Runtime(devices=["cpu", "cpu"], progress=0.2)
    try:
        handles = [rt.submit(_task(f"t{i}")) for i in range(3)]
        deadline = time.monotonic() + 120
        while not any("running" in r.getMessage() and "steps/s" in r.getMessage() and
                      not r.getMessage().endswith(" 0.0 steps/s") for r in caplog.records if r.name == LOGGER):
            assert time.monotonic() < deadline, "no progress line with work in it within 120 s"
            time.sleep(0.05)
        for h in handles:
            h.result(timeout=300)
    finally:
        rt.close()
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == LOGGER)
    busy = [ln for ln in lines if "devices busy 0/2" not in ln]
    assert busy and all(ln.startswith("hydra_tune: tasks ") and "(cpu" in ln for ln in lines)
    n = len(lines)
    time.sleep(0.6)   # three intervals after close: the thread has stopped
    assert len([r for r in caplog.records if r.name == LOGGER]) == n
    assert not _progress_threads()


def test_environment_turns_it_on(monkeypatch, caplog):
    monkeypatch.setenv(ENV, "0.1")
    caplog.set_level(logging.INFO, logger=LOGGER)
    with ht.Runtime(devices=["cpu"]):
        assert _progress_threads()
        deadline = time.monotonic() + 30
        while not [r for r in caplog.records if r.name == LOGGER]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert "tasks 0 running, 0 queued" in caplog.records[0].getMessage()


@pytest.mark.parametrize("value", [0, -1, "10", True, float("inf"), float("nan")])
def test_bad_progress_refused(value, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(ValueError, match=r"`progress` is None \(off\) or a number of seconds > 0 must hold, but got "
                                         r"\(progress=.*\)\. Fix: pass e\.g\. progress=30"):
        ht.Runtime(devices=["cpu"], progress=value)
    assert not _progress_threads()


def test_bad_environment_value_refused(monkeypatch):
    monkeypatch.setenv(ENV, "soon")
    with pytest.raises(ValueError, match=f"`{ENV}` is a number of seconds > 0 .*{ENV}='soon'"):
        ht.Runtime(devices=["cpu"])


def test_status_line_counts_an_interval():
    before = {"devices": [{"name": "cpu0", "busy_seconds": 1.0}, {"name": "cpu1", "busy_seconds": 2.0}],
              "tasks": {"a": {"state": "running", "steps": 10}, "b": {"state": "queued", "steps": 0}}}
    now = {"devices": [{"name": "cpu0", "busy_seconds": 2.5}, {"name": "cpu1", "busy_seconds": 2.0}],
           "tasks": {"a": {"state": "running", "steps": 30}, "b": {"state": "running", "steps": 5},
                     "c": {"state": "done", "steps": 7}, "d": {"state": "queued", "waiting_for_host_memory": True}}}
    line = status_line(now, before, 2.0)
    assert line == ("hydra_tune: tasks 2 running, 1 queued, 1 done | devices busy 1/2 (cpu0 75%, cpu1 0%) | "
                    "0.0 samples/s, 16.0 steps/s")
