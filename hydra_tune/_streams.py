"""Host <-> device copies behind one tiny interface, with a CPU stand-in.

    copier = make_copier(torch.device("cpu"))
    dev = copier.to_device(host_tensor)          # a real copy: the device's own memory
    back = copier.to_host(dev)                   # a real copy into host memory

On CUDA, copies go through a dedicated copy stream from pinned host buffers, and the compute stream waits on an
event, so a later prefetch can overlap the copy with compute. On CPU the same calls are plain clones, so every
code path above this module is exercised without a GPU.
"""
from __future__ import annotations

import torch


class HostCopier:
    """CPU stand-in: a "device" copy is a fresh tensor in the device's accounted memory."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone()

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone()

    def synchronize(self) -> None:
        """Wait for every copy issued so far (nothing to wait for on CPU)."""

    def prepare_host(self, tensors: list[torch.Tensor]) -> None:
        """Make host tensors that are copied in often cheap to copy (CPU: nothing to do)."""


class CudaCopier(HostCopier):
    """Copies on a side stream; the compute stream waits for them through an event."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.stream = torch.cuda.Stream(device=device)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        src = t.detach()
        if not src.is_pinned():
            src = src.pin_memory()
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            out = src.to(self.device, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.stream)
        compute.wait_event(done)
        out.record_stream(compute)
        return out

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t.detach(), non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return out

    def synchronize(self) -> None:
        self.stream.synchronize()
        torch.cuda.current_stream(self.device).synchronize()

    def prepare_host(self, tensors: list[torch.Tensor]) -> None:
        # Page-locked once, so every unit's copy-in is a direct DMA instead of a staging copy plus DMA.
        for t in tensors:
            if not t.is_pinned():
                t.data = t.data.pin_memory()


def make_copier(device: torch.device) -> HostCopier:
    """The copier for ``device``: CUDA streams for a GPU, plain copies for a CPU device."""
    return CudaCopier(device) if device.type == "cuda" else HostCopier(device)
