"""Faults at search scale, the long Optuna chaos studies (opt-in: HYDRA_TUNE_CHAOS=1): an Optuna study on SQLite
whose worker processes are SIGKILLed at seeded random moments mid-trial and restarted reaches its trials; every
killed trial that recorded a heartbeat is failed (one killed before its first heartbeat stays RUNNING: an Optuna
limitation the benchmark lists), the node server cancels the dead worker's task and lingers out after the last
client (benchmarks/chaos_optuna.py --quick); the same on JournalStorage, which has no heartbeat. `make test` runs
the short, event-driven version: tests/test_chaos_short.py (one kill, exactly when a trial has reported its first
epoch, recorded a heartbeat and trains in the server)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("optuna")
# 50-100 s and timing-sensitive on a loaded 2-core machine (how many kills land before the study ends): kept out
# of `make test`'s time budget; benchmarks/chaos_optuna.py is the full run.
_REASON = "slow chaos study: run with HYDRA_TUNE_CHAOS=1 (or benchmarks/chaos_optuna.py)"
pytestmark = [pytest.mark.skipif(os.environ.get("HYDRA_TUNE_CHAOS") != "1", reason=_REASON),
              pytest.mark.serial]   # kill timing depends on load: alone, after the parallel run
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def test_optuna_study_survives_killed_workers(tmp_path):
    sys.path.insert(0, BENCH)
    import chaos_optuna

    path = tmp_path / "chaos.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "chaos_optuna.py"), "--quick", "--json", str(path)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(path.read_text())
    assert chaos_optuna.failures(r) == [] and proc.returncode == 0, proc.stdout[-3000:]
    assert r["kills"] == 2 and r["killed_failed"] == r["killed_trials"] >= 2 and r["complete"] >= 4
    # a trial killed before its first heartbeat stays RUNNING (Optuna's limit, listed by the benchmark); all others end
    assert not r["server_left"] and r["running_left"] == len(r["running_without_heartbeat"])


def test_optuna_journal_study_killed_workers_trials_stay_running_until_told(tmp_path):
    """JournalStorage has no heartbeat (optuna 5.0.0): Optuna leaves exactly the killed workers' trials RUNNING; the
    node server still cancels their tasks, and ``study.tell(n, state=FAIL)`` (the benchmark's driver) fails them."""
    sys.path.insert(0, BENCH)
    import chaos_optuna

    path = tmp_path / "chaos.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "chaos_optuna.py"), "--quick", "--journal", "--json",
                           str(path)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(path.read_text())
    assert chaos_optuna.failures(r) == [] and proc.returncode == 0, proc.stdout[-3000:]
    assert r["storage"] == "journal" and r["kills"] == 2 and r["complete"] >= 4
    assert r["left_running_by_optuna"] and set(r["left_running_by_optuna"]) <= set(r["killed_begun"])
    assert r["running_left"] == 0 and all(r["states"][str(n)] == "FAIL" for n in r["left_running_by_optuna"])
    assert all(k["state"] in ("cancelled", "done") for k in r["killed"]) and not r["server_left"]
