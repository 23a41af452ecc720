"""A runtime with CPU devices sets torch's intra-op threads itself (device/threads.py): at most its share of the
cores per device, a lower count kept, HYDRA_TUNE_CPU_THREADS=n exactly n. Each case in a process of its own (the
test session's conftest sets one thread): forked from one interpreter that has imported torch and hydra_tune and
done no torch work, so every case starts as a fresh interpreter would, without paying for an interpreter start
and `import torch` each (7 cases: 18 s down to about 5 s on 2 busy cores)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading

import pytest

pytestmark = pytest.mark.serial   # counts threads against the cores: alone, after `make test`'s parallel run

_CASES = textwrap.dedent("""
    import json, os, sys, traceback
    import torch
    import torch._dynamo             # what the first optimizer imports (seconds): once here, not in every case
    import hydra_tune as ht


    def case(threads, devices):
        torch.set_num_threads(threads)
        seen = []

        class Probe(torch.nn.Module):          # records the count its device worker thread runs with
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 4)
            def forward(self, x):
                seen.append(torch.get_num_threads())
                return self.lin(x)

        task = ht.ModelTask(Probe, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), [(torch.ones(2, 4), None)],
                            loss=lambda out, b: out.sum())
        try:
            with ht.Runtime(devices=devices) as rt:
                main = torch.get_num_threads()
                rt.submit(task).result()
        except Exception as exc:
            print("CASE", json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        else:
            print("CASE", json.dumps({"main": main, "worker": seen[-1]}))

    for line in sys.stdin:           # one case a line: [threads, devices, HYDRA_TUNE_CPU_THREADS or null]
        threads, devices, env = json.loads(line)
        pid = os.fork()
        if pid == 0:                     # the case's own process
            try:
                if env is not None:
                    os.environ["HYDRA_TUNE_CPU_THREADS"] = env
                case(threads, devices)
                code = 0
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        if status:
            print("CASE", json.dumps({"crash": f"the case's process ended with status {status}"}), flush=True)
""")

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


_SERVER: dict = {}   # the interpreter the cases are forked from, started by the first case, ended with the module


@pytest.fixture(scope="module", autouse=True)
def _end_the_case_server():
    yield
    if _SERVER:
        proc = _SERVER.pop("proc")
        proc.kill()   # it holds nothing to save: no need to wait for torch's interpreter teardown
        proc.wait(timeout=60)
        proc.stdin.close()
        proc.stdout.close()
        _SERVER.pop("stderr").close()


def _run(threads: int, devices: list[str], env: str | None = None) -> dict:
    """The main and device threads' counts (or the runtime's error) of one case, HYDRA_TUNE_CPU_THREADS=``env``
    in its environment (unset for None)."""
    if not _SERVER:
        environ = {k: v for k, v in os.environ.items() if k != "HYDRA_TUNE_CPU_THREADS"}
        _SERVER["stderr"] = tempfile.TemporaryFile(mode="w+")
        _SERVER["proc"] = subprocess.Popen([sys.executable, "-c", _CASES], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=_SERVER["stderr"], text=True, env=environ)
    proc = _SERVER["proc"]
    proc.stdin.write(json.dumps([threads, devices, env]) + "\n")
    proc.stdin.flush()
    timer = threading.Timer(300, proc.kill)   # a case that hangs ends the process: readline then returns ""
    timer.start()
    try:
        for line in iter(proc.stdout.readline, ""):
            if line.startswith("CASE "):
                return json.loads(line[5:])
    finally:
        timer.cancel()
    _SERVER["stderr"].seek(0)
    raise AssertionError(f"the case process gave no answer: {_SERVER['stderr'].read()[-3000:]}")


def test_cpu_devices_get_their_share_of_the_cores():
    # torch set to more threads than the cores: each of the devices gets cores // devices (at least one)
    share = max(1, CORES // 2)
    assert _run(4 * CORES, ["cpu", "cpu"]) == {"main": share, "worker": share}
    assert _run(4 * CORES, ["cpu"]) == {"main": CORES, "worker": CORES}


def test_a_lower_count_is_kept_and_the_environment_sets_it_exactly():
    assert _run(1, ["cpu"]) == {"main": 1, "worker": 1}
    assert _run(1, ["cpu", "cpu"], env="3") == {"main": 3, "worker": 3}


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_environment_value_is_refused_at_the_runtime(value):
    assert _run(1, ["cpu"], env=value) == {"error": (
        f"ValueError: `HYDRA_TUNE_CPU_THREADS` is a positive int (intra-op threads per CPU device) when set must "
        f"hold, but got (HYDRA_TUNE_CPU_THREADS='{value}'). Fix: set e.g. HYDRA_TUNE_CPU_THREADS=2, or unset it "
        "for the runtime's share of the cores.")}


def test_the_rule():
    import torch

    from hydra_tune.device.threads import cpu_threads

    assert cpu_threads(0) is None                       # GPU runtimes leave the count alone
    assert cpu_threads(1) == min(torch.get_num_threads(), CORES)
    assert cpu_threads(CORES * 2) == 1                  # never below one
