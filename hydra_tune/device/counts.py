"""Counters of what crosses between host and device memory, and of the waits for the device: one device's or one
task's.

    counts = CopyCounts()
    counts.add("h2d", "state", 4096)          # 4 KiB of parameters (or gradients, optimizer state) copied in
    counts.waited()                           # the host waited for the device once (a loss read, a waiting copy)
    counts.snapshot() == {"h2d": {"state": 4096, "buffers": 0, "activations": 0, "batches": 0},
                          "d2h": {"state": 0, ...}, "syncs": 1}

Categories: ``state`` is a task's parameters, their gradients and its optimizer state; ``buffers`` its modules'
buffers and the tensors its modules keep in attributes; ``batches`` its data (a minibatch's first input and
labels); ``activations`` what crosses between a task's shards (carries, their gradients, offloaded activations).
A sync is a call that makes the host wait for the device: reading a loss, a copy out that waits, a
``synchronize``; the optimizer step's own waits (GradScaler's inf check) are torch's and not counted.
"""
from __future__ import annotations

import threading
from typing import Any

DIRECTIONS = ("h2d", "d2h")
CATEGORIES = ("state", "buffers", "activations", "batches")


class CopyCounts:
    """Bytes per direction and category, and syncs; thread-safe (a device's compute and copy threads, a task's host
    thread add to it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = {(d, c): 0 for d in DIRECTIONS for c in CATEGORIES}
        self._syncs = 0

    def add(self, direction: str, what: str, nbytes: int) -> None:
        with self._lock:
            self._bytes[(direction, what)] += nbytes

    def waited(self) -> None:
        with self._lock:
            self._syncs += 1

    def state_bytes(self) -> int:
        """Bytes of state moved either way so far."""
        with self._lock:
            return self._bytes[("h2d", "state")] + self._bytes[("d2h", "state")]

    def syncs(self) -> int:
        with self._lock:
            return self._syncs

    def reset(self) -> None:
        with self._lock:
            self._bytes = dict.fromkeys(self._bytes, 0)
            self._syncs = 0

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {d: {c: self._bytes[(d, c)] for c in CATEGORIES} for d in DIRECTIONS}
            out["syncs"] = self._syncs
        return out
