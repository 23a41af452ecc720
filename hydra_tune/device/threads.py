"""Torch's intra-op threads for a runtime's CPU devices (the device-type rules about threads).

    set_cpu_threads(devices)        # before the device workers start
    cpu_threads(2) == 1             # on 2 cores: each of 2 CPU devices gets one
    release_idle_pool()             # a thread about to wait for the devices frees its idle OpenMP workers
    adopt_thread_count()            # first in a thread the runtime starts: the process's count, not OpenMP's default
"""
from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable, Sequence

import torch

from ..errors import rule_error
from .devices import CpuDevice, Device

__all__ = ["CPU_THREADS_ENV", "adopt_thread_count", "cpu_threads", "release_idle_pool", "set_cpu_threads"]

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


def adopt_thread_count() -> None:
    """First thing in a thread the runtime starts (device workers, task host threads, the admission thread): the
    thread takes the process's intra-op count. Why: OpenMP's count is per thread, and a new thread keeps the
    library's default (every core) until torch reads its own count there; what torch does not run through its
    own parallel loops first (MKL's FFT) ran with that default, and a multi-threaded FFT rounds otherwise than
    the plain loop's, in the last bits (tests/test_cpu_threads.py). Reading the count applies it."""
    torch.get_num_threads()


def release_idle_pool() -> bool:
    """Free the calling thread's idle OpenMP worker threads (GNU libgomp's ``omp_pause_resource_all``), before it
    waits for the runtime's devices; whether libgomp took the request (False: no libgomp of torch's was found).

        release_idle_pool()          # TaskHandle.wait/watch do it when they are about to block, and a device
                                     # worker with nothing to run (Scheduler.take's on_idle)

    Why: every thread that ran a multi-threaded torch op keeps its own team of OpenMP workers, asleep between
    parallel regions. Once the process holds more OpenMP threads than cores (the user's thread that built the data,
    plus a device worker's team), libgomp stops spinning between regions, and every parallel op of the threads
    still working pays a sleep and a wake-up (README: the Threads bullet, and "CPU devices at torch's default
    threads" under Performance; benchmarks/small_trials.py, part 4). Releasing an idle team changes nothing else:
    the thread's next parallel op starts a team of the same size, so the same thread count and the same results."""
    pause = _pause()
    return pause is not None and pause(1) == 0   # omp_pause_soft: the calling thread's pool only


@functools.cache   # looked up once per process
def _pause() -> Callable[[int], int] | None:
    """``omp_pause_resource_all`` of torch's libgomp among the loaded ones (Linux: /proc/self/maps). Other packages bundle copies of their own
    (scikit-learn's wheels do) whose pools are not torch's; with none in torch's folder (a build that links the
    system's), the one libgomp loaded. Elsewhere (LLVM's libomp spins by time instead; not measured): None."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {fields[5].strip() for fields in (line.split(None, 5) for line in maps)
                     if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith("libgomp")}
    except OSError:
        return None
    own = [p for p in paths if p.startswith(os.path.dirname(torch.__file__) + os.sep)]
    chosen = own if own else list(paths) if len(paths) == 1 else []
    for path in chosen:
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):   # unreadable, or a libgomp older than OpenMP 5.0
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None
