"""Host <-> device copies behind one tiny interface, with a CPU stand-in.

    copier = make_copier(torch.device("cpu"))
    dev = copier.to_device(host_tensor)          # a real copy: the device's own memory
    back = copier.to_host(dev)                   # a real copy into host memory
    copier.release(dev); copier.refill(dev, host_tensor)   # free its bytes, keep the tensor; later fill it again
    with copier.charged_to(task_counts): ...     # this thread's copies and waits count for that task too
    copier.write_back(home, dev); copier.wait_written()    # a device tensor's values into an existing host tensor

Every copy is counted (device/counts.py) by direction and category (``what``: state, buffers, activations,
batches) in the copier's ``counts`` and in the counts of the task this thread works for (``charged_to``), and so
is every call that makes the host wait for the device (a copy out with ``wait=True``, ``read``, ``synchronize``).

On CUDA, copies go through a dedicated copy stream from pinned host buffers, and the compute stream waits on an
event, so a later prefetch can overlap the copy with compute. On CPU the same calls are plain clones, so every
code path above this module is exercised without a GPU.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from .counts import CopyCounts


def alias(t: torch.Tensor, shape: Any = None, stride: Any = None) -> torch.Tensor:
    """A tensor over ``t``'s storage with its own version counter (not a view; ``shape``/``stride``: viewed so
    instead of as ``t``): writing it does not invalidate autograd's saved references to ``t`` (whose storage we
    refill with the very values it held), and steps of ``t`` do not move its counter (the shared frozen pool)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.shape if shape is None else shape,
        t.stride() if stride is None else stride)


def _spread(t: torch.Tensor) -> bool:
    """Whether ``t`` has gaps or shared elements in its storage span (a strided slice, a broadcast view): a plain
    copy would make it contiguous, and some kernels' summation order follows the layout they are handed."""
    return t.layout is torch.strided and not t.is_nested and t.numel() > 1 and not _dense(t)


def _over_span(t: torch.Tensor, copy: Any) -> torch.Tensor:
    """A copy of spread ``t`` with its sizes and strides: ``copy`` (a copier's method) copies the storage span
    ``t`` reads, as one contiguous run, and the result views that copy as ``t`` viewed its storage. A new tensor,
    not a view (autograd treats it as any copied carry)."""
    span = 1 + sum(stride * (size - 1) for size, stride in zip(t.shape, t.stride()))
    return alias(copy(t.detach().as_strided((span,), (1,))), t.shape, t.stride())


class _Charged:
    """``HostCopier.charged_to``'s block: a class, as every unit and segment enters one."""

    __slots__ = ("_local", "_counts", "_outer")

    def __init__(self, local: threading.local, counts: CopyCounts | None) -> None:
        self._local, self._counts = local, counts

    def __enter__(self) -> None:
        self._outer = getattr(self._local, "task", None)
        self._local.task = self._counts

    def __exit__(self, *exc: object) -> None:
        self._local.task = self._outer


class HostCopier:
    """CPU stand-in: a "device" copy is a fresh tensor in the device's accounted memory."""

    def __init__(self, device: torch.device, account: Any = None) -> None:
        self.device = device
        self.account = account  # the CPU device's MemoryAccount: resize_ bypasses the dispatch mode
        self.counts = CopyCounts()  # everything this device's copier moved, and the waits
        self._local = threading.local()

    def moved(self) -> int:
        """Bytes this thread has copied through this copier so far (for the trace)."""
        return getattr(self._local, "bytes", 0)

    def charged_to(self, counts: CopyCounts | None) -> _Charged:
        """Inside (``with copier.charged_to(counts):``): this thread's copies and waits also count in ``counts``
        (a task's)."""
        return _Charged(self._local, counts)

    def _count(self, t: torch.Tensor, direction: str = "h2d", what: str = "activations") -> None:
        nbytes = t.numel() * t.element_size()
        local = self._local
        local.bytes = getattr(local, "bytes", 0) + nbytes  # (moved(), inline: twice per unit)
        self.counts.add(direction, what, nbytes)
        task = getattr(local, "task", None)
        if task is not None:
            task.add(direction, what, nbytes)

    def _waited(self) -> None:
        self.counts.waited()
        task = getattr(self._local, "task", None)
        if task is not None:
            task.waited()

    def to_device(self, t: torch.Tensor, what: str = "activations") -> torch.Tensor:
        if _spread(t):  # its layout kept, as the plain loop's next op would see it (so in every copy below)
            return _over_span(t, lambda flat: self.to_device(flat, what))
        self._count(t, "h2d", what)
        src = t.detach()
        if src.device == self.device or src.device.type == "meta":  # a footprint's meta model stays on meta
            return src.clone()
        return src.to(self.device, copy=True)  # a profile device's GPU

    def to_host(self, t: torch.Tensor, wait: bool = True, what: str = "activations") -> torch.Tensor:
        """A copy in host memory; with ``wait=False`` it may still be in flight (CUDA) until the device's next
        waiting copy out or ``wait_copies_out()``, which every unit makes before it ends."""
        if _spread(t):
            return _over_span(t, lambda flat: self.to_host(flat, wait, what))
        self._count(t, "d2h", what)
        if wait:
            self._waited()
        src = t.detach()
        return src.clone() if src.device.type in ("cpu", "meta") else src.to("cpu", copy=True)

    def read(self, t: torch.Tensor) -> float:
        """A device scalar's value on the host (a loss): the host waits for the device."""
        self._waited()
        return float(t.detach().item())

    def host_like(self, t: torch.Tensor) -> torch.Tensor:
        """An empty host tensor to write ``t`` back into (CUDA: page-locked, so the copy is a direct DMA)."""
        return torch.empty(t.shape, dtype=t.dtype)

    def write_back(self, home: torch.Tensor, t: torch.Tensor, what: str = "state") -> None:
        """Copy device tensor ``t``'s values into host tensor ``home`` (same shape and dtype); on CUDA it may be in
        flight until ``wait_written``."""
        self._count(t, "d2h", what)
        with torch.no_grad():
            home.copy_(t.detach())

    def wait_written(self) -> None:
        """Wait for the ``write_back`` copies issued by this thread (CPU: they are done)."""
        self._waited()

    def wait_copies_out(self) -> None:
        """Block until every ``to_host(wait=False)`` this thread issued has landed (CPU: they have)."""
        self._waited()

    # -- activation offload (device/offload.py): a storage's bytes out to host memory and back --------------
    offload_min_bytes = 0  # storages smaller than this stay on the device (CPU stand-ins: move all, as measured)

    def stash(self, src: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """A host copy of device bytes ``src`` (uint8) and the event that says it has landed (None: it has)."""
        self._count(src, "d2h")
        if src.device.type == "meta":  # a footprint's meta model: sizes only
            return torch.empty_like(src), None
        return torch.empty(src.shape, dtype=torch.uint8).copy_(src), None

    def unstash(self, host: torch.Tensor, event: Any, device: torch.device) -> torch.Tensor:
        """Host bytes back on ``device``, ordered after ``event`` (the copy out that filled ``host``)."""
        self._count(host, "h2d")
        return torch.empty(host.shape, dtype=torch.uint8, device=device).copy_(host)

    def landed(self, event: Any) -> bool:
        """Whether a ``stash`` copy's event has completed."""
        return True

    def wait_event(self, event: Any) -> None:
        """Block the host until a ``stash`` copy's event has completed."""

    def release(self, t: torch.Tensor) -> None:
        """Free ``t``'s device bytes but keep the tensor (and autograd's references to it) for ``refill``."""
        st = t.untyped_storage()
        if self.account is not None:
            self.account.forget(st)
        st.resize_(0)

    def refill(self, t: torch.Tensor, src: torch.Tensor) -> None:
        """Give a released ``t`` its bytes back, holding ``src``'s values (host tensor of the same layout)."""
        self._count(src, "h2d", "state")
        with torch.no_grad():
            self._fill(t, src.detach())
        if self.account is not None:
            self.account.track(t.untyped_storage())

    def _fill(self, t: torch.Tensor, src: torch.Tensor) -> None:
        t.untyped_storage().resize_(t.numel() * t.element_size())  # device copies are dense, at offset 0
        alias(t).copy_(src)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Copies issued here (by the copy thread, ahead of use) are joined by ``wait_prefetched`` in the compute
        thread when their unit starts, not at once: the running unit's queued kernels must not wait for them."""
        self._local.deferred = True
        try:
            yield
        finally:
            self._local.deferred = False

    def wait_prefetched(self) -> None:
        """Make the compute stream wait for the deferred copies (CPU: they are done when the call returns)."""

    def finish_copies(self) -> None:
        """Block the calling (copy) thread until its copies are done, so the trace times real transfers."""

    def synchronize(self) -> None:
        """Wait for every copy issued so far (nothing to wait for on CPU)."""
        self._waited()

    def prepare_host(self, tensors: list[torch.Tensor]) -> None:
        """Make host tensors that are copied in often cheap to copy (CPU: nothing to do)."""


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span without gaps or overlaps, in some order of its dimensions."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class CudaStreams:
    """The ``torch.cuda`` calls the CUDA copier makes, in one place: a test substitutes a stand-in that records
    which stream each copy ran on, what each stream waited for and where a tensor crossed streams."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> Any:
        return torch.cuda.Stream(device=self.device)

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def on_device(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.device(self.device)

    def event(self) -> Any:
        return torch.cuda.Event()

    def pinned(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def pinned_like(self, t: torch.Tensor) -> torch.Tensor:
        """Page-locked host memory with ``t``'s strides where they are dense (a transposed activation), else
        contiguous: a copy out and back in leaves the layout the next kernel sees as it was (as on CPU)."""
        if _dense(t):
            return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, pin_memory=True)
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.is_pinned() else t.pin_memory()

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.is_pinned()

    def record(self, t: torch.Tensor, stream: Any) -> None:
        """``t``'s block is not reused before the work queued on ``stream`` so far has run (caching allocator)."""
        t.record_stream(stream)


class CudaCopier(HostCopier):
    """Copies on side streams; the compute stream waits for them through events.

    Stream rules (each checked on CPU with a recording stand-in, tests/test_keep_path.py): a tensor made on a
    side stream and used on the compute stream is recorded on the compute stream; a tensor read by a side stream
    is recorded on that stream (and, for an activation going out, held until its event); every copy that fills
    device memory the compute stream reads is joined by an event the compute stream waits on."""

    offload_min_bytes = 1024  # as torchtune's: tiny saved tensors (seeds, scalars) are not worth a copy

    def __init__(self, device: torch.device, streams: CudaStreams | None = None) -> None:
        super().__init__(device)
        self.cuda = streams or CudaStreams(device)
        self.stream = self.cuda.new_stream()  # copies in (prefetch, refill)
        self.out_stream = self.cuda.new_stream()  # activations out: must not delay the copies in
        self._lock = threading.Lock()
        self._pending: list[Any] = []

    def _join(self, compute: Any) -> None:
        done = self.cuda.event()
        done.record(self.stream)
        if getattr(self._local, "deferred", False):
            with self._lock:
                self._pending.append(done)
        else:
            compute.wait_event(done)

    def finish_copies(self) -> None:
        self.stream.synchronize()

    def wait_prefetched(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        compute = self.cuda.current()
        for done in pending:
            compute.wait_event(done)

    def to_device(self, t: torch.Tensor, what: str = "activations") -> torch.Tensor:
        if _spread(t):
            return _over_span(t, lambda flat: self.to_device(flat, what))
        self._count(t, "h2d", what)
        src = self.cuda.pin(t.detach())
        compute = self.cuda.current()
        with self.cuda.use(self.stream):
            out = torch.empty_like(src, device=self.device)  # from the copy stream's pool, strides kept
            out.copy_(src, non_blocking=True)
        self._join(compute)
        self.cuda.record(out, compute)
        return out

    def release(self, t: torch.Tensor) -> None:
        # The block goes back to the caching allocator now; the compute stream's queued kernels may still read it,
        # so it is recorded there first (a no-op when it was made on the compute stream: same-stream reuse is
        # ordered), and another stream's allocation waits for them.
        if t.untyped_storage().nbytes():
            self.cuda.record(t, self.cuda.current())
        super().release(t)

    def _fill(self, t: torch.Tensor, src: torch.Tensor) -> None:
        src = self.cuda.pin(src)
        compute = self.cuda.current()
        with self.cuda.use(self.stream):
            # Allocated from the copy stream's pool: a block the compute stream freed may still be read by its
            # queued kernels, so it must not be written here before they ran.
            t.untyped_storage().resize_(t.numel() * t.element_size())
            dst = alias(t)
            dst.copy_(src, non_blocking=True)
        self._join(compute)
        self.cuda.record(dst, compute)  # freed later by the compute stream: the allocator waits for its use

    def stash(self, src: torch.Tensor) -> tuple[torch.Tensor, Any]:
        self._count(src, "d2h")
        compute = self.cuda.current()
        host = self.cuda.pinned(src.shape, torch.uint8)
        self.out_stream.wait_stream(compute)  # after the kernels that wrote ``src``
        with self.cuda.use(self.out_stream):
            host.copy_(src, non_blocking=True)
        self.cuda.record(src, self.out_stream)  # freed on the compute stream: not reused before this copy read it
        done = self.cuda.event()
        done.record(self.out_stream)
        return host, done

    def unstash(self, host: torch.Tensor, event: Any, device: torch.device) -> torch.Tensor:
        # On the compute stream (autograd's device thread runs the node there): the buffer is made, filled and
        # read on one stream, so the allocator needs no cross-stream record; the copy waits for the copy out.
        self._count(host, "h2d")
        compute = self.cuda.current()
        if event is not None:
            compute.wait_event(event)
        out = torch.empty(host.shape, dtype=torch.uint8, device=device)
        out.copy_(host, non_blocking=True)
        return out

    def landed(self, event: Any) -> bool:
        return event is None or bool(event.query())

    def wait_event(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def to_host(self, t: torch.Tensor, wait: bool = True, what: str = "activations") -> torch.Tensor:
        if _spread(t):
            return _over_span(t, lambda flat: self.to_host(flat, wait, what))
        self._count(t, "d2h", what)
        out = self.cuda.pinned_like(t)
        out.copy_(t.detach(), non_blocking=True)
        if wait:  # else the unit's last waiting copy out (its output carry) covers this one: same stream
            self._waited()
            self.cuda.current().synchronize()
        return out

    def host_like(self, t: torch.Tensor) -> torch.Tensor:
        return self.cuda.pinned(t.shape, t.dtype)

    def write_back(self, home: torch.Tensor, t: torch.Tensor, what: str = "state") -> None:
        # On this thread's current stream (the default stream, which the units and the task's optimizer step also
        # run on): the copy is ordered after every kernel that wrote ``t``. ``wait_written`` waits for it.
        self._count(t, "d2h", what)
        with torch.no_grad(), self.cuda.on_device():
            home.copy_(t.detach(), non_blocking=self.cuda.is_pinned(home))

    def wait_written(self) -> None:
        self._waited()
        self.cuda.current().synchronize()

    def wait_copies_out(self) -> None:
        # One event behind the copies on the compute stream: the host waits for them, not for other streams
        self._waited()
        done = self.cuda.event()
        done.record(self.cuda.current())
        done.synchronize()

    def synchronize(self) -> None:
        self._waited()
        self.stream.synchronize()
        self.out_stream.synchronize()
        self.cuda.current().synchronize()

    def prepare_host(self, tensors: list[torch.Tensor]) -> None:
        # Page-locked once, so every unit's copy-in is a direct DMA instead of a staging copy plus DMA.
        for t in tensors:
            if not self.cuda.is_pinned(t):
                t.data = self.cuda.pin(t.data)


def make_copier(device: torch.device, account: Any = None) -> HostCopier:
    """The copier for ``device``: CUDA streams for a GPU, plain copies for a CPU device."""
    return CudaCopier(device) if device.type == "cuda" else HostCopier(device, account)
