"""The device side of the pool of shared frozen weights (shared_frozen.py): one copy per device and entry.

    copy = pool.device_copy(host_tensor, device)   # ShardExec.copy_in: the device's copy (made once); None: unpooled
    pool.forget_device_copies()                    # the runtime closes, or a device ran out of memory

Mixed into SharedFrozen, whose lock, entries and counters it uses; the rules are that module's ("Device copies",
"Read-only in effect").
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

from ..errors import rule_error

if TYPE_CHECKING:
    from .shared_frozen import _Entry

WRITE_RULE = ("a task changes no frozen parameter it shares with other tasks (requires_grad=False weights equal "
               "across tasks are held once)")
WRITE_FIX = ("do not write into frozen weights during training; make them trainable (requires_grad_(True)) before "
              "the task is submitted or prepared, or buffers (register_buffer), if they must change")
#: Device copies are kept for reuse while their device's kept shared bytes stay within this share of its budget
#: (a device without a budget keeps them all); beyond it a copy lives only as long as a unit or cache holds it.
DEVICE_SHARE = 0.25


def _host_device(device: Any) -> bool:
    torch_device = getattr(device, "torch_device", None)
    return torch_device is not None and torch.device(torch_device).type == "cpu"


def on_host(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"



class SharedDeviceCopies:
    """Mixed into SharedFrozen (see the module docstring)."""

    _lock: threading.Lock
    _entries: dict[Any, _Entry]
    _by_ptr: dict[int, Any]
    copied: dict[str, int]
    recopied: dict[str, int]
    aliased: dict[str, int]
    reused: dict[str, int]

    def device_copy(self, host: torch.Tensor, device: Any) -> torch.Tensor | None:
        """The device's copy of the pooled tensor ``host`` (made now if there is none: its bytes counted by the
        device's copier like any state copy); None when ``host`` is not pooled. One copy per device, also when
        its compute and copy threads ask at once (the second waits for the first's copy)."""
        with self._lock:
            key = self._by_ptr.get(host.data_ptr())
            entry = self._entries.get(key) if key is not None else None
            lock = entry.copying.setdefault(device.name, threading.Lock()) if entry is not None else None
        if entry is None or lock is None:
            return None
        written = entry.poisoned or ", ".join(entry.written())
        if written:
            raise rule_error(WRITE_RULE, WRITE_FIX, device=device.name, written=written)
        with lock:
            with self._lock:
                held = entry.devices.get(device.name)
            if held is not None:
                copy, version = held
                if copy._version != version:
                    raise rule_error("a unit changes no frozen parameter it shares with other tasks", "do not "
                                     "write into frozen weights in forward; make them buffers or trainable",
                                     device=device.name, shape=tuple(copy.shape), dtype=str(copy.dtype))
                return copy
            return self._new_copy(key, entry, host, device)

    def _new_copy(self, key: Any, entry: _Entry, host: torch.Tensor, device: Any) -> torch.Tensor:
        """A copy of ``entry`` for ``device`` (which has none kept): another CPU device's, the pooled tensor
        itself (a CPU device with no room to keep one) or a new one, kept when the device's share allows."""
        if _host_device(device):
            copy = self._cpu_copy(key, entry, device)
            if copy is not None:
                return copy
        keep = self._keep_on(device, entry.nbytes)
        if _host_device(device) and not keep:
            # a CPU stand-in's "device copy" would be host memory again, made anew for every unit: the pooled
            # tensor itself serves, read-only (a write in place moves its counter: refused at the next hand-out).
            # A copy that can be kept is still made: it is the clean source a write into the host is undone from
            copy = entry.tensor.detach()
            with self._lock:
                self.aliased[device.name] = self.aliased.get(device.name, 0) + entry.nbytes
                if key in self._entries:
                    entry.devices[device.name] = (copy, copy._version)
            return copy
        copy = device.copier.to_device(host, "state")
        with self._lock:
            self.copied[device.name] = self.copied.get(device.name, 0) + entry.nbytes
            if device.name in entry.copied_to:
                self.recopied[device.name] = self.recopied.get(device.name, 0) + entry.nbytes
            entry.copied_to.add(device.name)
            if keep and key in self._entries:
                entry.devices[device.name] = (copy, copy._version)
        return copy

    def _cpu_copy(self, key: Any, entry: _Entry, device: Any) -> torch.Tensor | None:
        """Another CPU device's clean copy of ``entry``, now also ``device``'s: CPU devices share one address
        space, so one copy serves them all (read-only: a write moves its counter, refused at the next hand-out)."""
        with self._lock:
            for copy, version in entry.devices.values():
                if copy._version == version and copy.untyped_storage().nbytes() and on_host(copy) \
                        and copy.data_ptr() != entry.tensor.data_ptr():
                    self.reused[device.name] = self.reused.get(device.name, 0) + entry.nbytes
                    if key in self._entries:
                        entry.devices[device.name] = (copy, version)
                    return copy
        return None

    def _keep_on(self, device: Any, nbytes: int) -> bool:
        budget = getattr(device, "budget", None)
        if budget is None:
            return True
        with self._lock:
            kept = sum(e.nbytes for e in self._entries.values() if device.name in e.devices
                   and e.devices[device.name][0].data_ptr() != e.tensor.data_ptr())
        return kept + nbytes <= DEVICE_SHARE * budget

    def forget_device_copies(self) -> None:
        """Drop every device copy (the runtime closes, or a device ran out of memory)."""
        with self._lock:
            for entry in self._entries.values():
                entry.devices.clear()
