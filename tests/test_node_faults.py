"""The node server and a client that dies mid-task: the server sees the connection end, cancels the client's task,
and runs at most one more unit of it, checked on the server's own clock (its trace and the moment it saw the client
go, ``stats()["server"]["departures"]``), not on the test's polling."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

import pytest
from test_node import _wait

from hydra_tune import node

CFG = dict(devices=["cpu", "cpu"], device_memory=30_000, policy="lrtf")
CLIENT = """
import sys, time, torch, hydra_tune as ht
from hydra_tune import node
rt = node.connect(devices=['cpu', 'cpu'], device_memory=30_000, policy='lrtf')
def loss(o, b):
    time.sleep(0.002)
    return torch.nn.functional.mse_loss(o, b[1])
g = torch.Generator().manual_seed(0)
data = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(8)]
h = rt.submit(ht.ModelTask(lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                                       torch.nn.Linear(32, 4)),
                           lambda m: torch.optim.SGD(m.parameters(), lr=0.01), data, loss=loss, epochs=10_000,
                           name='doomed'))
while h.status != 'running':
    time.sleep(0.01)
print(h.server_name, flush=True)
time.sleep(600)
"""


@pytest.fixture
def node_dir(monkeypatch):
    base = tempfile.mkdtemp(prefix="htn", dir="/tmp")   # short: socket paths are limited to 107 bytes
    monkeypatch.setenv("HYDRA_TUNE_NODE_DIR", base)
    monkeypatch.setenv("HYDRA_TUNE_NODE_LINGER", "2")
    return base


def test_server_runs_at_most_one_unit_of_a_killed_clients_task_after_seeing_it_go(node_dir):
    with node.connect(**CFG) as observer:
        proc = subprocess.Popen([sys.executable, "-c", CLIENT], stdout=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)))
        try:
            name = proc.stdout.readline().strip()
            assert name.endswith("/doomed"), name
            units = lambda: [e for e in observer.trace().units() if e.task == name]   # noqa: E731
            assert _wait(lambda: len(units()) >= 20)   # mid-training
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        assert _wait(lambda: observer.stats()["tasks"][name]["state"] == "cancelled")
        (gone,) = [d for d in observer.stats()["server"]["departures"] if d["pid"] == proc.pid]
        assert gone["cancelled"] == [name]
        ran = units()
        after = [e for e in ran if e.start >= gone["at"]]
        assert len(after) <= 1, (gone["at"], [(e.kind, e.start, e.end) for e in ran[-8:]])


def test_server_log_rotates_at_its_bound_under_client_churn(node_dir, monkeypatch):
    monkeypatch.setenv("HYDRA_TUNE_NODE_LOG_BYTES", "2048")
    log = node.server_files(**CFG)["log"]
    with node.connect(**CFG) as keeper:   # keeps the server up while clients come and go (2 log lines each)
        for _ in range(40):
            node.connect(**CFG).close()
        assert _wait(lambda: keeper.stats()["server"]["clients"] == 1)
        assert _wait(lambda: os.path.exists(log + ".1"))
        line = 200   # one line past the bound at most: the rotation follows the line that reached it
        assert os.path.getsize(log) < 2048 + line and os.path.getsize(log + ".1") < 2048 + line
        # The newest lines go to the new log. A client's last line may itself rotate it (where that happens depends
        # on the lines' lengths, which hold pids and paths), leaving the new log empty: the client after such a
        # rotation cannot fill it again, so within two more clients one's lines stay in the new log.
        def newest() -> str:
            with open(log) as f:
                return f.read()
        found = False
        for _ in range(3):
            node.connect(**CFG).close()
            found = _wait(lambda: "left; cancelled 0 unfinished task(s)" in newest(), 3.0)
            if found:
                break
        assert found, newest()
    assert _wait(lambda: not os.path.exists(log) and not os.path.exists(log + ".1"))   # retired: both removed


@pytest.mark.parametrize("value", ["lots", "100", "-5"])
def test_bad_log_bound_is_refused_before_a_server_starts(node_dir, monkeypatch, value):
    monkeypatch.setenv("HYDRA_TUNE_NODE_LOG_BYTES", value)
    with pytest.raises(Exception, match=r"`HYDRA_TUNE_NODE_LOG_BYTES` is a number of bytes >= 1024.*Fix: unset it"):
        node.connect(**CFG)
    assert not os.listdir(node_dir) or not [f for f in os.listdir(node_dir) if f.endswith(".sock")]
