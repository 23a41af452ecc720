"""One GPU as a runtime device: its memory measured by ``torch.cuda``'s statistics, its default generator carrying
the running task's CUDA stream for a unit.

    dev = CudaDevice("cuda:0", budget=None)          # resolve.py makes them from the names a runtime is given
    with dev.unit_scope(task_rng): ...               # the unit's CUDA draws come from the task's own stream

The base class and the CPU stand-ins that run the same residency, eviction and step code are in devices.py.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .devices import Device, ProfileDevice
from .dispatch import UnitMode, router_for
from .rng import TaskRNG
from .seeding import OnDevice, seeding_to


class CudaDevice(Device):
    """One GPU. Its default generator carries the running task's CUDA RNG stream for the unit's duration."""

    def __init__(self, name: str, budget: int | None) -> None:
        super().__init__(name, torch.device(name), budget)

    def start(self, elsewhere: Sequence[Callable[[Callable[[], None]], Any]] = ()) -> None:
        with torch.cuda.device(self.torch_device):
            self.copy_bandwidth = self._measure_bandwidth(64 << 20)
            self.overhead = self.warm_up(elsewhere)
        self.copier.counts.reset()

    def _warm_unit(self) -> None:
        # cuBLAS and cuBLASLt allocate a workspace per thread and stream through the caching allocator (each
        # runtime thread, and autograd's device thread for the backward): fp32 and bf16 matmuls make them now.
        dev = self.torch_device
        with torch.cuda.device(dev):
            a = torch.ones(64, 64, device=dev, requires_grad=True)
            (a @ a).sum().backward()
            if torch.cuda.is_bf16_supported():  # cuBLASLt's own workspace, for bf16 tasks
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    (a @ a).float().sum().backward()
            del a
            torch.cuda.synchronize(dev)

    def _held_bytes(self) -> int:
        dev = self.torch_device
        torch.cuda.synchronize(dev)
        held = int(torch.cuda.memory_allocated(dev))
        torch.cuda.reset_peak_memory_stats(dev)
        return held

    @contextlib.contextmanager
    def unit_scope(self, rng: TaskRNG) -> Iterator[UnitMode]:
        gen = torch.cuda.default_generators[self.torch_device.index]
        rng.start_accel(gen)
        try:  # the unit's torch.manual_seed & co. seed this generator only (the others hold other tasks' streams)
            with torch.cuda.device(self.torch_device), router_for(rng), seeding_to(OnDevice(rng.cpu, gen)):
                yield None
        finally:
            rng.accel_state = gen.get_state()

    def copy_scope(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.device(self.torch_device)

    def step_scope(self) -> contextlib.AbstractContextManager[Any]:
        # The host thread's current stream on this device is the default stream, as the worker's: the step's
        # kernels queue behind the units that made the gradients, and a later eviction's copy (same stream)
        # behind the step.
        return torch.cuda.device(self.torch_device)

    def profile_device(self) -> Device | None:
        return ProfileDevice(self.torch_device)  # the CPU's kernels save other tensors (SDPA's math path)

    def after_oom(self) -> None:
        torch.cuda.empty_cache()  # give the failed unit's cached blocks back, so the smaller plan starts clean

    def peak_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.torch_device))

    def current_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.torch_device))
