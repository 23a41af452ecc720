"""Each device's ``unit_cpu_seconds``: the CPU time of the threads that ran its units, during them (the light path's
units and the general path's alike), and the progress line's off-CPU share for CPU devices that waited."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import hydra_tune as ht
from hydra_tune.runtime.progress import OFF_CPU_SHOWN, status_line


def _task(name: str, width: int) -> ht.ModelTask:
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)) for _ in range(30)]
    return ht.ModelTask(lambda: nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                              nn.Linear(width, 4)),
                        lambda m: torch.optim.SGD(m.parameters(), lr=0.01), data,
                        loss=lambda out, b: F.mse_loss(out, b[1]), epochs=1, seed=1, name=name)


def _device(memory: str | None, task: ht.ModelTask) -> tuple[dict, dict]:
    with ht.Runtime(devices=["cpu"], device_memory=memory) as rt:
        rt.submit(task).result(timeout=120)
        stats = rt.stats()
    return stats["devices"][0], stats["tasks"][task.name]


def test_light_and_general_paths_count_their_units_cpu_time():
    light, light_task = _device(None, _task("light", 64))
    general, general_task = _device("70KiB", _task("sharded", 64))
    assert len(light_task["shards"]) == 1 and len(general_task["shards"]) > 1  # the two paths, as meant
    for device in (light, general):
        # a thread's CPU time in a span is at most the span's wall time (the clocks' ticks aside)
        assert 0.0 < device["unit_cpu_seconds"] <= device["busy_seconds"] + 0.01 * device["units"]


def test_status_line_shows_a_cpu_devices_off_cpu_share():
    before = {"devices": [{"name": "cpu:0", "busy_seconds": 1.0, "unit_cpu_seconds": 0.9},
                          {"name": "cpu:1", "busy_seconds": 1.0, "unit_cpu_seconds": 0.9},
                          {"name": "cuda:0", "busy_seconds": 1.0, "unit_cpu_seconds": 0.1}],
              "tasks": {}}
    now = {"devices": [{"name": "cpu:0", "busy_seconds": 2.0, "unit_cpu_seconds": 1.5},   # 40% of 1 s off the CPU
                       {"name": "cpu:1", "busy_seconds": 2.0, "unit_cpu_seconds": 1.9 - OFF_CPU_SHOWN / 2},
                       {"name": "cuda:0", "busy_seconds": 2.0, "unit_cpu_seconds": 0.2}],  # a GPU's wait: not shown
           "tasks": {}}
    line = status_line(now, before, 2.0)
    assert "(cpu:0 50% (off-CPU 40%), cpu:1 50%, cuda:0 50%)" in line, line
