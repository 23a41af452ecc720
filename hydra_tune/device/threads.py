"""Torch's intra-op thread count for a runtime's CPU devices (the one device-type rule about threads).

    set_cpu_threads(devices)        # before the device workers start
    cpu_threads(2) == 1             # on 2 cores: each of 2 CPU devices gets one
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from ..errors import rule_error
from .devices import CpuDevice, Device

__all__ = ["CPU_THREADS_ENV", "cpu_threads", "set_cpu_threads"]

CPU_THREADS_ENV = "HYDRA_TUNE_CPU_THREADS"


def cpu_threads(cpu_devices: int) -> int | None:
    """The intra-op thread count (``torch.set_num_threads``) a runtime with ``cpu_devices`` CPU devices runs with;
    None: torch's count is left alone (no CPU devices: a GPU runtime's host work keeps the user's setting).

        cpu_threads(2) == 1           # on 2 cores, torch's default count: each device one core
        cpu_threads(0) is None        # CUDA devices only

    The rule: each CPU device runs its units in its own worker thread with torch's intra-op pool, so N devices
    on C cores get at most max(1, C // N) threads each; a lower count already set (``torch.set_num_threads(1)``,
    Ray's OMP_NUM_THREADS=1) stays. ``HYDRA_TUNE_CPU_THREADS=<n>`` in the environment sets exactly n instead. The
    count is torch's, for the whole process: a plain loop run in the same process afterwards uses it too."""
    if cpu_devices == 0:
        return None
    given = os.environ.get(CPU_THREADS_ENV)
    if given is not None:
        if not given.strip().isdigit() or int(given) < 1:
            raise rule_error(f"`{CPU_THREADS_ENV}` is a positive int (intra-op threads per CPU device) when set",
                             f"set e.g. {CPU_THREADS_ENV}=2, or unset it for the runtime's share of the cores",
                             **{CPU_THREADS_ENV: given})
        return int(given)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(torch.get_num_threads(), max(1, cores // cpu_devices))


def set_cpu_threads(devices: Sequence[Device]) -> None:
    """Apply ``cpu_threads`` for ``devices`` (their CPU devices counted); GPU-only runtimes change nothing."""
    threads = cpu_threads(sum(isinstance(d, CpuDevice) for d in devices))
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
