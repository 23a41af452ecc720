"""A runtime (a node server) that runs for weeks: ended tasks' stats records and trace events stay in bounded
buffers (RuntimeConfig ``history`` and ``trace_events``), ``stats()["history"]`` counts what was dropped, and a churn
of client processes through the node server leaves its RSS, open files and threads flat (benchmarks/node_churn.py;
the long run is ``--tasks 2000``)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from reference import max_param_diff, plain_train

import hydra_tune as ht
from hydra_tune.config import RuntimeConfig

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _data(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(3)]


def _model():
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _task(i: int) -> ht.ModelTask:
    return ht.ModelTask(_model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), _data(i),
                        loss=lambda o, b: F.mse_loss(o, b[1]), epochs=2, seed=i, name=f"t{i}")


@pytest.mark.parametrize("bad", [{"history": -1}, {"history": "10"}, {"trace_events": True},
                                 {"trace_events": 2.5}])
def test_bounds_are_validated_with_the_rule_and_fix(bad):
    (name, value), = bad.items()
    with pytest.raises((ValueError, TypeError), match=rf"`{name}` is an int >= 0.*{re.escape(f'{name}={value!r}')}"
                       rf".*Fix: pass e\.g\. {name}="):
        RuntimeConfig(devices=["cpu"], **bad)


def test_defaults_are_bounded():
    cfg = RuntimeConfig(devices=["cpu"])
    assert cfg.history == 1000 and cfg.trace_events == 200_000
    assert RuntimeConfig(**cfg.as_dict()) == cfg  # travels to a node server whole


def test_ended_records_and_trace_events_keep_the_newest_and_count_the_dropped():
    cfg = RuntimeConfig(devices=["cpu"], history=2, trace_events=10)
    with ht.Runtime(config=cfg) as rt:
        handles = []
        for i in range(4):  # one after another: the end order is known
            handles.append(rt.submit(_task(i)))
            handles[-1].result(timeout=120)
        last = handles[-1].model()
        stats, trace = rt.stats(), rt.trace()
    assert sorted(stats["tasks"]) == ["t2", "t3"]            # the two newest ended tasks
    hist = stats["history"]
    assert hist["ended_kept"] == 2 and hist["ended_dropped"] == 2 and hist["ended_limit"] == 2
    assert len(trace.events) == hist["trace_events"] == 10 and hist["trace_limit"] == 10
    units = 4 * stats["tasks"]["t3"]["units"]  # every task ran as many units: each one was recorded, then dropped
    assert units > 10 and hist["trace_dropped"] + 10 >= units
    assert trace.events[-1].task == "t3"                     # the newest events stay
    # the bound changes nothing in training: the last task's weights are the plain loop's
    ref, _ = plain_train(_task(3))
    assert max_param_diff(last, ref) == 0.0


def test_zero_keeps_none():
    with ht.Runtime(config=RuntimeConfig(devices=["cpu"], history=0, trace_events=0)) as rt:
        rt.submit(_task(0)).result(timeout=60)
        stats = rt.stats()
        assert stats["tasks"] == {} and rt.trace().events == []
        assert stats["history"]["ended_dropped"] == 1 and stats["history"]["trace_dropped"] > 0


# serial: on 2 busy cores beside another xdist worker it once ended with one thread more (9 -> 10) than it began
@pytest.mark.serial
def test_node_server_churn_keeps_rss_fds_and_threads_flat(tmp_path):
    """benchmarks/node_churn.py --quick in its own process: rounds of 3 client processes (4 tasks each: finished,
    cancelled running, cancelled at once, left running at a disconnect) through one node server whose history bound
    is reached; its fds and threads back to baseline, RSS within tolerance, every task counted."""
    sys.path.insert(0, BENCH)
    import node_churn

    path = tmp_path / "churn.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "node_churn.py"), "--quick", "--json", str(path)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(path.read_text())
    assert node_churn.failures(r) == [] and proc.returncode == 0, proc.stdout[-3000:]
    hist = r["after"]["history"]
    assert hist["ended_dropped"] > 0 and hist["ended_kept"] == node_churn.QUICK_HISTORY  # the bound was reached
    assert hist["trace_dropped"] > 0 and r["after"]["fds"] == r["baseline"]["fds"]
    assert r["tasks_counted"] == r["tasks_total"] == 36
