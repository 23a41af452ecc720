"""Trace: Chrome trace-event JSON, save/load, summary numbers, Recorder, and the Gantt plot (hand-built traces)."""
from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from hydra_tune.runtime.trace import COMPUTE, COPY, Event, Recorder, Trace

DEVICES = ["cuda:0", "cuda:1"]


def hand_trace() -> Trace:
    """Two devices, three tasks (first seen: z, a, m), dyadic times so every number below is exact."""
    return Trace(list(DEVICES), [
        Event(1, "trial-z", 0, "F", 0.25, 1.0, segment=0),
        Event(0, "trial-a", 1, "H2D", 0.5, 0.625, bytes=4096, lane=COPY),
        Event(0, "trial-a", 0, "F", 0.5, 0.75, segment=1),
        Event(0, "trial-a", 1, "L", 0.75, 1.25, segment=1),
        Event(1, "trial-m", 0, "B", 1.0, 2.0, segment=2),
        Event(1, "trial-m", 0, "D2H", 2.0, 2.125, bytes=1024, lane=COPY),
    ])


# ----------------------------------------------------------------------------------------------- summary numbers

def test_makespan_busy_tasks_exact():
    t = hand_trace()
    assert t.makespan() == 1.75            # units only: 0.25 .. 2.0 (the D2H copy ends later, at 2.125)
    assert t.busy() == [0.75, 1.75]        # 0.25 + 0.5 on cuda:0; 0.75 + 1.0 on cuda:1; copies excluded
    assert t.tasks() == ["trial-z", "trial-a", "trial-m"]
    assert [e.kind for e in t.units()] == ["F", "F", "L", "B"]
    assert [e.kind for e in t.copies()] == ["H2D", "D2H"]
    assert t.events[0].seconds == 0.75


def test_empty_trace_summary():
    t = Trace(["cpu", "cpu"])
    assert t.makespan() == 0.0
    assert t.busy() == [0.0, 0.0]
    assert t.tasks() == []


# ----------------------------------------------------------------------------------------------- chrome JSON

def test_to_chrome_is_valid_trace_event_json():
    t = hand_trace()
    obj = json.loads(json.dumps(t.to_chrome(), allow_nan=False))   # strict JSON, survives a round trip
    assert obj == t.to_chrome()
    evs = obj["traceEvents"]
    xs = [e for e in evs if e["ph"] == "X"]
    assert len(xs) == len(t.events)
    for e in xs:
        for key in ("name", "ph", "ts", "dur", "pid", "tid"):
            assert key in e, (key, e)
        assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0
        assert e["tid"] == (0 if e["cat"] == COMPUTE else 1)
        assert e["pid"] in range(len(DEVICES))
    assert {e["ph"] for e in evs} <= {"X", "M"}

    names = [e for e in evs if e["ph"] == "M" and e["name"] == "process_name"]
    assert sorted((e["pid"], e["args"]["name"]) for e in names) == [(0, "cuda:0"), (1, "cuda:1")]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"}
    assert threads == {(0, 0): COMPUTE, (0, 1): COPY, (1, 0): COMPUTE, (1, 1): COPY}
    assert obj["otherData"]["devices"] == DEVICES


def test_to_chrome_exact_microseconds_and_lanes():
    xs = {e["name"]: e for e in hand_trace().to_chrome()["traceEvents"] if e["ph"] == "X"}
    assert set(xs) == {"trial-z F0", "trial-a H2D1", "trial-a F0", "trial-a L1", "trial-m B0", "trial-m D2H0"}
    got = {n: (e["pid"], e["tid"], e["ts"], e["dur"]) for n, e in xs.items()}
    assert got == {
        "trial-z F0": (1, 0, 250000.0, 750000.0),
        "trial-a H2D1": (0, 1, 500000.0, 125000.0),
        "trial-a F0": (0, 0, 500000.0, 250000.0),
        "trial-a L1": (0, 0, 750000.0, 500000.0),
        "trial-m B0": (1, 0, 1000000.0, 1000000.0),
        "trial-m D2H0": (1, 1, 2000000.0, 125000.0),
    }
    h2d = xs["trial-a H2D1"]["args"]
    assert {k: h2d[k] for k in ("task", "shard", "kind", "bytes", "segment")} == {
        "task": "trial-a", "shard": 1, "kind": "H2D", "bytes": 4096, "segment": -1}
    assert xs["trial-a L1"]["args"]["segment"] == 1


def test_save_load_round_trips_exactly(tmp_path):
    t = hand_trace()
    path = tmp_path / "trace.json"
    t.save(path)
    with open(path) as f:
        assert json.load(f) == t.to_chrome()
    back = Trace.load(str(path))
    assert back.devices == t.devices
    assert back.events == t.events
    assert back.makespan() == t.makespan() and back.busy() == t.busy()


def test_save_load_round_trips_unsorted_perf_counter_times(tmp_path):
    t = Trace(["cpu"], [Event(0, "late", 0, "F", 0.3, 0.3 + 0.1234567891),
                        Event(0, "early", 0, "F", 0.1, 0.1 + 1 / 3)])
    t.save(tmp_path / "t.json")
    assert Trace.load(tmp_path / "t.json").events == t.events


# ----------------------------------------------------------------------------------------------- Recorder

def test_recorder_shifts_by_origin_and_snapshots_a_copy():
    r = Recorder(DEVICES, origin=100.0)
    r.add(0, "a", 0, "F", 100.5, 100.75, segment=3)
    r.add(1, "a", 1, "H2D", 101.0, 101.5, nbytes=8, lane=COPY)
    snap = r.snapshot()
    assert snap.devices == DEVICES
    assert snap.events == [Event(0, "a", 0, "F", 0.5, 0.75, 0, COMPUTE, 3), Event(1, "a", 1, "H2D", 1.0, 1.5, 8, COPY)]
    r.extend([Event(1, "b", 0, "F", 2.0, 3.0)])
    assert len(snap.events) == 2 and len(r.snapshot().events) == 3


def test_recorder_is_thread_safe():
    r = Recorder(["cpu"], origin=0.0)

    def work(i: int) -> None:
        for j in range(500):
            r.add(0, f"t{i}", 0, "F", float(j), float(j) + 0.5)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    snap = r.snapshot()
    assert len(snap.events) == 2000
    assert snap.busy() == [1000.0]


# ----------------------------------------------------------------------------------------------- plot

PNG = b"\x89PNG\r\n\x1a\n"


def _read_png(path) -> bytes:
    data = path.read_bytes()
    assert data[:8] == PNG, data[:16]
    assert len(data) > 5000
    return data


def test_plot_timeline_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    from hydra_tune.sim.plot import plot_timeline

    t = hand_trace()
    assert len(t.devices) == 2 and len(t.tasks()) == 3 and t.copies()
    plot_timeline(t, tmp_path / "timeline.png", title="hand trace")
    with_copies = _read_png(tmp_path / "timeline.png")
    plot_timeline(t, str(tmp_path / "units.png"), copies=False)
    assert _read_png(tmp_path / "units.png") != with_copies


@pytest.mark.parametrize("case", ["many_tasks", "empty", "no_copies_in_trace"])
def test_plot_timeline_edge_cases(tmp_path, case):
    pytest.importorskip("matplotlib")
    from hydra_tune.sim.plot import plot_timeline

    if case == "many_tasks":   # more than 20 tasks: legend says "+N more"
        t = Trace([f"cuda:{d}" for d in range(4)],
                  [Event(i % 4, f"trial-{i}", 0, "F", 0.1 * i, 0.1 * i + 0.3) for i in range(25)])
    elif case == "empty":
        t = Trace(["cpu"])
    else:
        t = Trace(list(DEVICES), hand_trace().units())
    plot_timeline(t, tmp_path / "t.png")
    _read_png(tmp_path / "t.png")


def test_plot_timeline_rejects_unknown_device(tmp_path):
    pytest.importorskip("matplotlib")
    from hydra_tune.sim.plot import plot_timeline

    t = Trace(["cpu"], [Event(2, "a", 0, "F", 0.0, 1.0)])
    with pytest.raises(ValueError, match=r"device 2.*1 device"):
        plot_timeline(t, tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()


def test_plot_timeline_without_matplotlib_says_how_to_fix(tmp_path, monkeypatch):
    from hydra_tune.sim.plot import plot_timeline

    monkeypatch.setitem(sys.modules, "matplotlib", None)   # makes `import matplotlib` raise ImportError
    with pytest.raises(ImportError) as info:
        plot_timeline(hand_trace(), tmp_path / "t.png")
    assert str(info.value) == ("plot_timeline needs matplotlib, but got (matplotlib=missing). "
                               "Fix: pip install 'hydra_tune[plot]' or pip install matplotlib.")


def test_import_plot_is_light_and_plotting_leaves_pyplot_alone(tmp_path):
    code = ("import sys, hydra_tune, hydra_tune.sim.plot\n"
            "print('matplotlib' in sys.modules)\n"
            "from hydra_tune.runtime.trace import Event, Trace\n"
            "try:\n"
            "    import matplotlib\n"
            "except ImportError:\n"
            "    print('skip'); raise SystemExit\n"
            "t = Trace(['cpu'], [Event(0, 'a', 0, 'F', 0.0, 1.0)])\n"
            f"hydra_tune.sim.plot.plot_timeline(t, {str(tmp_path / 'p.png')!r})\n"
            "print('matplotlib.pyplot' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = out.stdout.split()
    assert lines[0] == "False", "import hydra_tune.sim.plot imported matplotlib"
    if lines[1:] != ["skip"]:
        assert lines[1:] == ["False"], "plot_timeline imported pyplot"


def test_overlap_is_the_share_of_copy_time_under_compute():
    t = Trace(["cpu:0", "cpu:1"], [
        Event(0, "a", 0, "F", 0.0, 1.0), Event(0, "a", 1, "F", 2.0, 3.0),
        Event(0, "a", 1, "H2D", 0.5, 2.5, 8, COPY),      # 0.5 s under F0, 0.5 s under F1, 1.0 s exposed
        Event(1, "b", 0, "F", 0.0, 1.0)])               # no copies on device 1
    assert t.overlap() == [0.5, 0.0]
