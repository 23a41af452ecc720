"""A thread that waits for the runtime lets its idle OpenMP team go (device/threads.py ``release_idle_pool``): with
a second thread's team alive, libgomp puts its waits to sleep and a CPU device's every parallel op pays a wake-up.
Checked by the process's OS threads (Linux, torch's libgomp): the caller's pool is gone after ``result()``, so its
next parallel op starts its worker thread again; where scikit-learn is installed its own libgomp is loaded too, and
the release still ends torch's team. In a fresh interpreter with 2 intra-op threads (the test session
runs with one)."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent("""
    import json, os, threading, time
    import torch
    try:
        import sklearn.utils   # bundles a libgomp of its own: the release must pick torch's
    except ImportError:
        pass
    from hydra_tune.device import threads

    def os_threads():
        return len(os.listdir("/proc/self/task"))

    def native_threads():                              # OS threads that run no Python: OpenMP's workers
        return os_threads() - len(threading.enumerate())

    def settled():
        last, same_since = os_threads(), time.monotonic()
        while time.monotonic() - same_since < 0.3:     # threads that end with a task (its host thread) are gone
            time.sleep(0.02)
            now = os_threads()
            if now != last:
                last, same_since = now, time.monotonic()
        return last

    def parallel_op():
        torch.ones(1 << 20).add_(1)                    # above torch's grain: a parallel region of 2 threads

    out = {"found": threads._pause() is not None}
    torch.set_num_threads(2)
    parallel_op()
    before = settled()
    out["released"] = threads.release_idle_pool()
    out["after_release"] = settled()
    parallel_op()
    out["after_next_op"] = settled()

    cases = os.environ["CASES"].split(",")
    if "result" in cases:
        import hydra_tune as ht
        task = ht.ModelTask(lambda: torch.nn.Linear(4, 4), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                            [(torch.ones(2, 4), None)] * 20, loss=lambda out, b: out.sum(), name="t")
        with ht.Runtime(devices=["cpu"]) as rt:
            parallel_op()                              # the caller's team, alive while it submits
            rt.submit(task).result()
            out["after_result"] = settled()
            parallel_op()                              # the team was released: its thread starts again
            out["after_result_op"] = settled()
    if "idle_device" in cases:
        import hydra_tune as ht
        seen = []

        class Probe(torch.nn.Module):          # a parallel op in the device's unit: its worker's team is alive
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 4)
            def forward(self, x):
                parallel_op()
                # the fewest over 0.2 s: a runtime thread starting meanwhile (its OS thread exists before Python
                # lists it) reads as one more native thread for a moment; the team's worker stays (one CI failure:
                # 6 - 4 != 1 under load)
                readings, end = [], time.monotonic() + 0.2
                while time.monotonic() < end:
                    readings.append(native_threads())
                    time.sleep(0.01)
                seen.append(min(readings))
                return self.lin(x)

        task = ht.ModelTask(Probe, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), [(torch.ones(2, 4), None)],
                            loss=lambda out, b: out.sum(), name="p")
        threads.release_idle_pool()                  # the caller has no team: only the device's counts below
        with ht.Runtime(devices=["cpu"]) as rt:
            rt.submit(task).result()
            settled()
            out["in_unit"], out["idle"] = seen[-1], native_threads()
    out["before"] = before
    print("OUT", json.dumps(out))
""")


@functools.cache
def _run() -> dict:
    """The script's readings, every case in one fresh interpreter (each case a runtime of its own, in turn; a
    process's start with torch and scikit-learn imported is most of a case's time)."""
    env = dict(os.environ, CASES="result,idle_device", HYDRA_TUNE_CPU_THREADS="2", OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("OUT "))
    return json.loads(line[4:])


def _outputs() -> dict:
    out = _run()
    if not out["found"]:
        pytest.skip("torch's OpenMP runtime here is not GNU libgomp loaded from a file (nothing to release)")
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp pools are looked up in /proc/self/maps")
def test_release_idle_pool_ends_the_calling_threads_idle_openmp_workers() -> None:
    out = _outputs()
    assert out["released"] is True
    assert out["after_release"] == out["before"] - 1      # the team's one worker thread ended
    assert out["after_next_op"] == out["before"]          # and the next parallel op started it again


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp pools are looked up in /proc/self/maps")
def test_waiting_for_a_result_releases_the_waiting_threads_team() -> None:
    out = _outputs()
    # without the release in TaskHandle.wait the caller's team outlives the wait: its next op starts no thread
    assert out["after_result_op"] == out["after_result"] + 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp pools are looked up in /proc/self/maps")
def test_an_idle_device_lets_its_team_go() -> None:
    out = _outputs()
    # between the unit and the idle runtime the device worker's OpenMP worker ends (without the release in
    # Scheduler.take's wait it stays: the user's own torch ops, run while the runtime is idle, would pay libgomp's
    # sleeps). Counted as OS threads that run no Python, so the runtime's own threads that come and go with a task
    # (its host thread, under load an admission or copy thread) do not enter the count
    assert out["in_unit"] - out["idle"] == 1
