"""The Device objects a runtime's ``devices`` and ``device_memory`` name: CPU stand-ins or GPUs, checked against
the machine.

    devices = resolve_devices(["cpu", "cpu"], budget=2**30)    # RuntimeConfig validated the values already
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from ..errors import rule_error
from .cuda import CudaDevice
from .devices import CpuDevice, Device
from .measured import Measurements

CUDA_MARGIN = 0.1  # of free memory left to the CUDA context, allocator slack and other processes


def _cuda_free_bytes(index: int) -> int:
    try:
        import pynvml  # optional extra `nvml`: sees memory held by other processes too

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML (not installed, no driver access): torch's view of this process's device
        free, _total = torch.cuda.mem_get_info(index)
        return int(free)


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_names(devices: int | str | Sequence[str] = "auto", n_cuda: int | None = None) -> list[str]:
    """The device names a ``RuntimeConfig``'s ``devices`` stands for on this machine: "auto" is every visible GPU,
    else one CPU device; a count is that many GPUs, or CPU devices where none is visible; names stay as given."""
    n_cuda = cuda_count() if n_cuda is None else n_cuda
    if devices == "auto":
        return [f"cuda:{i}" for i in range(n_cuda)] or ["cpu"]
    if isinstance(devices, int):
        return [f"cuda:{i}" for i in range(devices)] if n_cuda else ["cpu"] * devices
    return list(devices)


def resolve_devices(devices: int | str | Sequence[str] = "auto", budget: int | None = None) -> list[Device]:
    """The Device objects for a ``RuntimeConfig``'s ``devices`` and ``device_memory`` (bytes), which it has
    validated; what needs the machine (a GPU, its index, its free memory) is checked here."""
    n_cuda = cuda_count()
    names = device_names(devices, n_cuda)
    out: list[Device] = []
    records = Measurements()  # what one CPU stand-in counted holds for the others (measured.py)
    for i, name in enumerate(names):
        if name == "cpu" or re.fullmatch(r"cpu:\d+", name):
            out.append(CpuDevice(f"cpu:{i}", budget, records))
        else:  # "cuda" or "cuda:<index>"
            if n_cuda == 0:
                raise rule_error("a CUDA device is available (torch.cuda.device_count() > 0)", "use CPU "
                                 "stand-ins here, e.g. devices=['cpu', 'cpu'] with a device_memory budget, or "
                                 "run where a GPU is visible (a CUDA build of torch, CUDA_VISIBLE_DEVICES not "
                                 "empty)", device=name, device_count=0, torch_cuda=torch.version.cuda)
            name = "cuda:0" if name == "cuda" else name
            index = int(name.split(":")[1])
            if index >= n_cuda:
                raise rule_error("each `cuda:i` has `i < torch.cuda.device_count()`", "use an existing GPU "
                                 f"index (0 to {n_cuda - 1})", device=name, device_count=n_cuda)
            own = budget if budget is not None else int(_cuda_free_bytes(index) * (1 - CUDA_MARGIN))
            out.append(CudaDevice(name, own))
    return out
