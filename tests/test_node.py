"""The node runtime server: real server processes and client processes over its Unix socket, no mocks."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import node_sandbox, process_alive
from reference import max_param_diff, trained

import hydra_tune as ht
from hydra_tune import node
from hydra_tune.errors import HydraError, PlanError, RuntimeClosed, TaskCancelled

CFG = dict(devices=["cpu", "cpu"], device_memory=30_000, policy="lrtf")
_PIDS: list[int] = []   # every server these tests saw: all are gone at the end


def _data(n: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def _mse(out, batch):
    return F.mse_loss(out, batch[1])


def _slow_mse(out, batch):
    time.sleep(0.005)
    return F.mse_loss(out, batch[1])


def _sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.05)


def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _wide():
    return nn.Sequential(nn.Linear(16, 4096), nn.ReLU(), nn.Linear(4096, 4))  # 330 KB of weights in one stage


def _wait(cond, seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _connect(**cfg) -> node.NodeRuntime:
    rt = node.connect(**(cfg or CFG))
    if rt.pid not in _PIDS:
        _PIDS.append(rt.pid)
    return rt


def _client_code(body: str) -> str:
    """A client script: __main__ functions travel by value (cloudpickle)."""
    return ("import sys, time, json, torch, hydra_tune as ht\n"
            "assert 'hydra_tune.node' not in sys.modules  # `import hydra_tune` leaves it alone\n"
            "from hydra_tune import node\n"
            f"rt = node.connect(devices=['cpu', 'cpu'], device_memory={CFG['device_memory']})\n"
            "def loss(o, b):\n    time.sleep(0.005)\n    return torch.nn.functional.mse_loss(o, b[1])\n"
            "def task(name, epochs):\n"
            "    return ht.ModelTask(lambda: torch.nn.Sequential(torch.nn.Linear(16, 4)), lambda m: "
            "torch.optim.SGD(m.parameters(), lr=0.1), [(torch.randn(8, 16), torch.randn(8, 4))] * 20, loss=loss, "
            "epochs=epochs, name=name)\n" + body)


@pytest.fixture(scope="module", autouse=True)
def node_dir():
    with node_sandbox("htn", "3", _PIDS) as (base, _):
        yield base


def _tasks() -> list:
    return [ht.ModelTask(_mlp, _sgd, _data(6, seed=s), loss=_mse, epochs=2, seed=s, name=f"t{s}") for s in (1, 2)]


def _no_seconds(ms: list) -> list:
    return [{k: v for k, v in m.items() if k != "seconds"} for m in ms]


def test_remote_tasks_match_in_process_runtime_bit_for_bit():
    with ht.Runtime(**CFG) as local:
        handles = [local.submit(t) for t in _tasks()]
        expected = [(trained(h), list(h.metrics())) for h in handles]
    with _connect() as rt:
        assert rt.devices == 2
        handles = [rt.submit(t) for t in _tasks()]
        got = [(trained(h), list(h.metrics())) for h in handles]
        assert [h.status for h in handles] == ["done", "done"] and handles[0].result() == got[0][1][-1]
        assert {h.server_name for h in handles} <= set(rt.stats()["tasks"]) & set(rt.trace().tasks())
    for (m0, ms0), (m1, ms1) in zip(expected, got):
        assert max_param_diff(m0, m1) == 0.0
        assert _no_seconds(ms0) == _no_seconds(ms1) and len(ms1) == 2


def test_a_task_over_slices_of_one_dataset_trains_remotely_as_in_process():
    # the minibatches are views of one tensor: they travel as one storage (hydra_tune/shipping.py) and share it there
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(48, 16, generator=g), torch.randn(48, 4, generator=g)
    data = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 48, 8)]

    def task():
        return ht.ModelTask(_mlp, _sgd, data, loss=_mse, epochs=2, seed=4, name="sliced")
    with ht.Runtime(**CFG) as local:
        expected = trained(local.submit(task()))
    with _connect() as rt:
        got = trained(rt.submit(task()))
    assert max_param_diff(expected, got) == 0.0


def test_two_clients_share_one_server_and_see_each_others_tasks():
    with _connect() as a, _connect() as b:
        assert a.pid == b.pid == b.stats()["server"]["pid"] and a.stats()["server"]["clients"] >= 2
        hb = b.submit(ht.ModelTask(_mlp, _sgd, _data(2), loss=_mse, name="from-b"))
        hb.result(timeout=60)
        assert a.stats()["tasks"][hb.server_name]["state"] == "done"
        out = subprocess.run([sys.executable, "-c", _client_code(
            "h = rt.submit(task('sub', 1)); h.result(60)\n"
            "print(json.dumps({'pid': rt.stats()['server']['pid'], 'name': h.server_name}))")],
            capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        info = json.loads(out.stdout.strip().splitlines()[-1])
        assert info["pid"] == a.pid and a.stats()["tasks"][info["name"]]["state"] == "done"


# serial: beside another xdist worker on 2 busy cores the server's device bytes were read non-zero right after the
# handle ended cancelled (twice, and once in the serial run): the test now waits for them to reach zero
@pytest.mark.serial
def test_cancel_running_task_ends_it_cancelled_in_client_and_server():
    with _connect() as rt:
        h = rt.submit(ht.ModelTask(_mlp, _sgd, _data(100), loss=_slow_mse, epochs=50, name="victim"))
        assert _wait(lambda: h.status == "running", 30)
        h.cancel()
        with pytest.raises(TaskCancelled, match="task 'victim' was cancelled"):
            for _ in h.metrics():
                pass
        with pytest.raises(TaskCancelled):   # iterating after the end re-raises, as with TaskHandle
            list(h.metrics())
        h.cancel()                           # idempotent, no error after the end
        stats = rt.stats()
        assert h.status == "cancelled" and h.done() and stats["tasks"][h.server_name]["state"] == "cancelled"
        assert not [n for n, t in stats["tasks"].items() if t["state"] in ("queued", "running")]
        # the device bytes return to zero, though not always by the time the handle reads "cancelled": in 3 full
        # runs of the suite they were still counted a moment after (cause not found; see the closing note)
        assert _wait(lambda: all(d["current_bytes"] == 0 for d in rt.stats()["devices"]), 10), rt.stats()["devices"]


def test_checkpoint_taken_in_the_server_resumes_exactly(tmp_path):
    def task(**kw):
        return ht.ModelTask(_mlp, _sgd, _data(30), loss=_slow_mse, epochs=3, name="ck", **kw)

    with _connect() as rt:
        h = rt.submit(task())
        assert _wait(lambda: h.status == "running", 30)
        path = h.checkpoint(tmp_path / "ck.pt", timeout=30)
        full = trained(h)
        with pytest.raises(RuntimeError, match="needs a running task"):
            h.checkpoint(tmp_path / "late.pt")
        assert path == str(tmp_path / "ck.pt") and max_param_diff(full, trained(rt.submit(task(resume_from=path)))) == 0


def test_plan_error_and_unpicklable_task_raise_in_submit():
    with ht.Runtime(**CFG) as local, pytest.raises(PlanError) as expected:
        local.submit(ht.ModelTask(_wide, _sgd, _data(2), loss=_mse, name="wide"))
    lock = threading.Lock()

    def locked_mlp():
        with lock:
            return _mlp()

    with _connect() as rt:
        with pytest.raises(PlanError) as got:
            rt.submit(ht.ModelTask(_wide, _sgd, _data(2), loss=_mse, name="wide"))
        assert type(got.value) is type(expected.value) and str(got.value) == str(expected.value)
        with pytest.raises(node.TaskNotPicklable, match=r"pickles with cloudpickle.*field='model'.*_thread.lock.*"
                                                        r"Fix: define its factories at module level"):
            rt.submit(ht.ModelTask(locked_mlp, _sgd, _data(2), loss=_mse, name="locked"))
        assert "wide" not in str(rt.stats()["tasks"])


def test_files_are_private_and_an_open_base_dir_is_refused(node_dir, monkeypatch):
    with _connect() as rt:
        assert stat.S_IMODE(os.stat(rt.log).st_mode) == 0o600 and os.path.dirname(rt.socket) == node_dir
    fresh = os.path.join(node_dir, "b")
    monkeypatch.setenv("HYDRA_TUNE_NODE_DIR", fresh)
    files = node.server_files(**CFG)
    assert files["base"] == fresh and files["socket"].startswith(fresh + "/")
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(files["authkey"]).st_mode) == 0o600 and os.path.getsize(files["authkey"]) == 32
    os.chmod(fresh, 0o755)
    with pytest.raises(HydraError, match=rf"no group/other permissions.*path='{fresh}', mode='0o755'.*chmod 700"):
        node.connect(**CFG)
    monkeypatch.setenv("HYDRA_TUNE_NODE_DIR", os.path.join(node_dir, "x" * 100))
    with pytest.raises(HydraError, match="at most 107 bytes.*HYDRA_TUNE_NODE_DIR to a short directory"):
        node.server_files(**CFG)


def test_server_death_ends_handles_and_an_idle_server_exits_after_linger(monkeypatch):
    monkeypatch.setenv("HYDRA_TUNE_NODE_LINGER", "1")
    cfg = dict(CFG, device_memory=40_000)   # a server of its own
    rt = _connect(**cfg)
    h = rt.submit(ht.ModelTask(_mlp, _sgd, _data(100), loss=_slow_mse, epochs=50, name="long"))
    assert _wait(lambda: h.status == "running", 30)
    os.kill(rt.pid, signal.SIGKILL)
    with pytest.raises(RuntimeClosed, match=rf"server \(pid {rt.pid}\) ended before task 'long'.*\.log"):
        h.result(timeout=30)
    with pytest.raises(RuntimeClosed, match=rf"pid {rt.pid}"):
        rt.submit(ht.ModelTask(_mlp, _sgd, _data(2), loss=_mse))
    rt.close()
    with _connect(**cfg) as rt2:    # the killed server's socket is stale: a new server replaces it
        assert rt2.pid != rt.pid and rt2.submit(ht.ModelTask(_mlp, _sgd, _data(2), loss=_mse)).result(30)
        socket_path = rt2.stats()["server"]["socket"]
    assert _wait(lambda: not process_alive(rt2.pid), 15), "the idle server did not exit after its linger"
    assert not os.path.exists(socket_path)


def _drawn_width():
    import random

    width = random.choice([8, 16, 24, 32, 40, 48])
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4))


def test_a_factory_drawing_from_pythons_random_builds_in_the_server_what_it_builds_in_the_client():
    # before: the server's builds drew from the server's own generator (shared by every task it ever built), not
    # from the client's, which the plain loop's call draws from: another width than the plain loop's
    import random

    def task(s):
        return ht.ModelTask(_drawn_width, _sgd, _data(4, seed=s), loss=_mse, epochs=1, seed=s, name=f"w{s}")

    expected = []
    with ht.Runtime(**CFG) as local:
        for s in (3, 4, 5):
            random.seed(s)
            expected.append(trained(local.submit(task(s))))
    with _connect() as rt:
        got = []
        for s in (3, 4, 5):
            random.seed(s)
            got.append(trained(rt.submit(task(s))))
    assert [m[0].out_features for m in got] == [m[0].out_features for m in expected]
    assert all(max_param_diff(a, b) == 0.0 for a, b in zip(expected, got))
