"""The start-up overhead is read after every runtime thread of a device has run a warm-up unit (issue 17, part 3).

A CPU device stand-in whose "library workspaces" are made per thread on first use, as cuBLAS's are on CUDA: the
overhead the runtime reports and plans with must include the worker's and the copy thread's.
"""
from __future__ import annotations

import threading

import torch

import hydra_tune as ht
from hydra_tune.device.devices import CpuDevice

WORKSPACE = 4096  # bytes one thread's first unit allocates and keeps (a cuBLAS workspace, on CUDA)


def test_overhead_counts_each_runtime_threads_workspace(monkeypatch):
    made: dict[str, int] = {}
    lock = threading.Lock()

    def warm_unit(self) -> None:
        a = torch.ones(8, 8, requires_grad=True)
        (a @ a).sum().backward()  # a forward and a backward, as a unit runs them
        with lock:
            made.setdefault(threading.current_thread().name, WORKSPACE)

    def held_bytes(self) -> int:
        with lock:
            return sum(made.values())

    monkeypatch.setattr(CpuDevice, "_warm_unit", warm_unit)
    monkeypatch.setattr(CpuDevice, "_held_bytes", held_bytes)
    with ht.Runtime(devices=["cpu"], device_memory=1 << 30) as rt:
        dev = rt.stats()["devices"][0]
        plan_budget = rt.devices[0].plan_budget
    names = sorted(made)
    copy = [n.startswith("hydra-copy-") for n in names]
    assert any(copy) and not all(copy), names
    assert dev["overhead_bytes"] == 2 * WORKSPACE, dev
    assert plan_budget == (1 << 30) - 2 * WORKSPACE


def test_cpu_stand_in_has_no_overhead():
    dev = CpuDevice("cpu:0", 1 << 20)
    dev.start(elsewhere=[lambda fn: fn()])
    assert dev.overhead == 0 and dev.plan_budget == 1 << 20
