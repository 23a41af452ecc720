"""The memory model is measured on the device the task runs on when that device measures itself (a GPU: issue
17, part 4), the CPU profile otherwise, and a device profile that runs out of memory falls back to the CPU's.

The stand-in "GPU" is a CPU device whose profile device rounds every allocation to 4 KiB (as CUDA's caching
allocator rounds to 512 bytes): a plan built for it must predict from its own measurement.
"""
from __future__ import annotations

import pytest
import torch
from conftest import lm_batches, make_gpt2

import hydra_tune as ht
from hydra_tune.device.devices import CpuDevice, ProfileDevice
from hydra_tune.training.state import TaskState

GRANULE = 4096


class RoundingGpu(CpuDevice):
    """A device that profiles itself; its allocator rounds to GRANULE; ``limit``: its profile runs out there."""

    def __init__(self, limit: int | None = None) -> None:
        super().__init__("cpu:0", None)
        self.limit = limit

    def profile_device(self) -> ProfileDevice:
        dev = ProfileDevice(torch.device("cpu"))
        dev.account.granule = GRANULE
        dev.account.limit = self.limit
        return dev


def _task() -> ht.ModelTask:
    return ht.ModelTask(lambda: make_gpt2(n_layer=2, n_embd=24), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        lm_batches(1), seed=11)


def test_plan_uses_the_devices_own_measurement():
    cpu = TaskState.build(_task(), None)
    gpu = TaskState.build(_task(), None, device=RoundingGpu())
    assert [c.name for c in cpu.costs] == [c.name for c in gpu.costs]
    for c, g in zip(cpu.costs, gpu.costs):
        for field in ("fwd_peak", "saved_bytes", "grad_fwd_peak", "bwd_peak"):
            assert getattr(g, field) % GRANULE == 0, (c.name, field)  # differences of rounded sizes
    assert any(g.saved_bytes > c.saved_bytes for c, g in zip(cpu.costs, gpu.costs))
    again = TaskState.build(_task(), None, device=RoundingGpu())  # measured once per architecture and device
    assert [c.bwd_peak for c in again.costs] == [c.bwd_peak for c in gpu.costs]
    assert gpu.plan.shards[0].backward_peak != cpu.plan.shards[0].backward_peak


def test_device_profile_out_of_memory_falls_back_to_the_cpu_profile():
    task = ht.ModelTask(lambda: make_gpt2(n_layer=2, n_embd=20), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        lm_batches(1), seed=12)  # another architecture: not profiled on this device yet
    with pytest.warns(RuntimeWarning, match="could not measure the model's stages on cpu:0"):
        state = TaskState.build(task, None, device=RoundingGpu(limit=GRANULE))
    cpu = TaskState.build(task, None)
    assert [c.bwd_peak for c in state.costs] == [c.bwd_peak for c in cpu.costs]


def test_runtime_profiles_on_its_devices_when_each_profiles_itself(monkeypatch):
    made: list[ProfileDevice] = []

    def profile_device(self: CpuDevice) -> ProfileDevice:
        made.append(RoundingGpu().profile_device())
        return made[-1]

    monkeypatch.setattr(CpuDevice, "profile_device", profile_device)
    task = ht.ModelTask(lambda: make_gpt2(n_layer=2, n_embd=28), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        lm_batches(1), seed=13)  # an architecture no other test profiled on this "device"
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        rt.submit(task).result()
    assert any(d.account.peak > 0 and d.account.peak % GRANULE == 0 for d in made), "not profiled on the device"
