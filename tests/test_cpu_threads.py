"""A runtime with CPU devices sets torch's intra-op threads itself (device/threads.py): at most its share of the
cores per device, a lower count kept, HYDRA_TUNE_CPU_THREADS=n exactly n. Each case in a fresh interpreter (the
test session's conftest sets one thread)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    import hydra_tune as ht
    torch.set_num_threads(int(sys.argv[1]))
    seen = []

    class Probe(torch.nn.Module):          # records the count its device worker thread runs with
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
        def forward(self, x):
            seen.append(torch.get_num_threads())
            return self.lin(x)

    devices = json.loads(sys.argv[2])
    task = ht.ModelTask(Probe, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), [(torch.ones(2, 4), None)],
                        loss=lambda out, b: out.sum())
    try:
        with ht.Runtime(devices=devices) as rt:
            main = torch.get_num_threads()
            rt.submit(task).result()
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    else:
        print(json.dumps({"main": main, "worker": seen[-1]}))
""")

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _run(threads: int, devices: list[str], env: str | None = None) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "HYDRA_TUNE_CPU_THREADS"}
    if env is not None:
        environ["HYDRA_TUNE_CPU_THREADS"] = env
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(threads), json.dumps(devices)], capture_output=True,
                         text=True, timeout=300, env=environ, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


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
