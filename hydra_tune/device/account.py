"""A CPU stand-in's device memory: the bytes of the live storages its units create, current and peak.

    account = MemoryAccount()
    with UnitMode(generator, account): x = torch.ones(1024)     # device/dispatch.py counts each new storage
    account.current, account.peak                               # 4096, 4096 while x lives; 0, 4096 after
    account.track_many(storages)                                # storages made elsewhere (a step's), counted too
    account.window(); ...; account.high                         # the most bytes since the window began

Rules: a storage counts from its creation (or ``track``) until it is freed (a weak reference's callback) or
``forget``; ``limit`` (test-only, CpuDevice.limit_memory) makes an allocation past it raise
``torch.OutOfMemoryError`` as CUDA would. Thread-safe: a device's compute and copy threads both count.
"""
from __future__ import annotations

import threading
import weakref

import torch


class _Tracked(weakref.ref):
    """A weak reference to a counted storage that carries its key and bytes: one object per live storage (before:
    a (bytes, reference) tuple and a closure per storage, ~0.3 KiB each; a task resident on a CPU stand-in keeps
    ~150 counted storages)."""

    # Made by weakref's own constructor, then its slots set (``_Tracked(storage, callback)``): a Python
    # ``__init__`` would cost a call per counted storage, and a training step makes a gradient per parameter.
    __slots__ = ("key", "nbytes")
    key: int
    nbytes: int


class MemoryAccount:
    """Bytes of live storages created under a UnitMode with this account: current and peak (thread-safe)."""

    def __init__(self, types: tuple[str, ...] = ("cpu", "meta"), granule: int = 1) -> None:
        self._lock = threading.Lock()
        self.types = types  # the device types whose storages count (a profile on a GPU: ("cuda",))
        self.granule = granule  # allocation size rounding (CUDA's caching allocator: 512 bytes)
        self._live: dict[int, _Tracked] = {}  # storage identity -> a weak reference to it, with its bytes
        self.current = 0
        self.peak = 0
        self.high = 0  # the most bytes since the latest ``window()``
        self.limit: int | None = None  # test-only: exceeding it raises torch.OutOfMemoryError (CpuDevice)

    # Storages are keyed by their StorageImpl (``_cdata``), not their data pointer: that identity survives
    # resize_ (release/refill) and also tells apart meta-device storages, which all have data pointer 0.
    def track(self, storage: torch.UntypedStorage, enforce: bool = True) -> None:
        """Count ``storage`` until it is freed; with ``enforce``, one that would pass ``limit`` raises instead
        (``enforce=False``: it exists already, e.g. made by a task's optimizer step, and is only counted)."""
        key, nbytes = storage._cdata, storage.nbytes()
        if nbytes == 0:
            return
        nbytes = -(-nbytes // self.granule) * self.granule
        with self._lock:
            if key in self._live:
                return
            if enforce and self.limit is not None and self.current + nbytes > self.limit:
                raise torch.OutOfMemoryError(f"CPU device out of memory (test limit): allocating {nbytes} bytes "
                                             f"with {self.current} in use would pass the limit of {self.limit}")
            # A weak reference whose callback runs when the storage is freed (cheaper than weakref.finalize,
            # which this path pays once per new storage of every counted op)
            ref = self._live[key] = _Tracked(storage, self._release)
            ref.key, ref.nbytes = key, nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            self.high = max(self.high, self.current)

    def track_many(self, storages: list[torch.UntypedStorage]) -> None:
        """``track(s, enforce=False)`` for each of ``storages`` under one lock (those known already cost a lookup)."""
        with self._lock:
            live = self._live
            for storage in storages:
                key = storage._cdata
                if key in live:
                    continue
                nbytes = storage.nbytes()
                if nbytes == 0:
                    continue
                ref = live[key] = _Tracked(storage, self._release)
                ref.key, ref.nbytes = key, nbytes
                self.current += nbytes
            self.peak = max(self.peak, self.current)
            self.high = max(self.high, self.current)

    def forget(self, storage: torch.UntypedStorage) -> None:
        """Stop counting ``storage`` (its bytes are about to be freed by ``resize_(0)``)."""
        with self._lock:
            entry = self._live.pop(storage._cdata, None)
            if entry is not None:
                self.current -= entry.nbytes

    def _release(self, ref: _Tracked) -> None:
        with self._lock:
            if self._live.get(ref.key) is ref:  # the key may have been reused since: only this storage's
                del self._live[ref.key]
                self.current -= ref.nbytes

    def window(self) -> None:
        """Start ``high`` again from the current bytes (a counted segment's peak: device/measured.py)."""
        with self._lock:
            self.high = self.current

    def note(self, nbytes: int) -> None:
        """A peak of ``nbytes`` reached while nothing counted it (a segment counted on another device)."""
        if nbytes <= self.peak:  # (the peak only grows: most calls, one per uncounted segment, stop here unlocked)
            return
        with self._lock:
            self.peak = max(self.peak, nbytes)

    def reset_peak(self) -> int:
        """Restart peak tracking from the current bytes; return the old peak."""
        with self._lock:
            old, self.peak = self.peak, self.current
            return old
