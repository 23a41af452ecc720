"""What of a shard stays on a device between units, and what a forward sends to host memory instead.

    device.resident = ShardCache()                       # one per device: shard copies left or made ahead
    device.resident.prefetch(ex, device)                 # the copy thread copies ``ex``'s shard in early
    store.kept[i] = Kept(out, leaves, copies)            # a kept forward's graph, waiting for its B unit
    with offloading(device, copies, mode): ...           # an offloading forward's saved activations go to host

Rules: a resident copy is used only while the host tensors it was made from are unchanged (identity and version
of each); it holds what a unit copies in (``ShardExec.moving``: only the buffers while the shard's parameters,
gradients and optimizer state stay on the device, resident.py); a kept forward's parameter bytes are released
after the forward and refilled for its backward (not a resident shard's: they are its state); an
offloading forward keeps parameters and buffers referenced (released and refilled like a kept one's) and copies
every other saved tensor to host memory, back to the device when the backward unpacks it.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..device.devices import Device
from ..device.dispatch import paused_accounting
from ..device.offload import Offloader

if TYPE_CHECKING:
    from .shard import ShardExec


@dataclass
class Kept:
    """A forward kept on its device for the backward: outputs (with their graph), input leaves, state copies.
    ``droppable``: its F unit also saved what a recompute needs (RNG, buffers, Python state), so it may be dropped
    (another task needs the room, or its backward runs on another device) and its B unit recomputes instead."""

    out: Any
    leaves: list[Any]
    copies: dict[int, torch.Tensor]
    filled: bool = False
    device: Any = None
    droppable: bool = False
    # a droppable one's parameter copies, whose bytes stay past its forward while the device runs no other task
    # (its backward, the loop's next call, then needs no refill: a second copy in); released when another task's
    # segment begins there (HeldGraphs.unload), after which ``refill`` gives them back
    loaded: list[torch.Tensor] = field(default_factory=list)
    # a graph over the model's own parameters (the light path's, direct.py): its backward adds into their ``.grad``
    direct: bool = False


class ShardCache:
    """One device's resident shard copies: left by the last unit or made ahead by the copy thread (the second
    buffer of double buffering). A copy is used only while the host tensors it was made from are unchanged."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, tuple[ShardExec, tuple[tuple[int, int], ...], dict[int, torch.Tensor]]] = {}

    def put(self, ex: ShardExec, device: Device, copies: dict[int, torch.Tensor]) -> None:
        with self._lock:
            self._entries[id(ex)] = (ex, ex.versions(device), copies)

    def take(self, ex: ShardExec, device: Device) -> dict[int, torch.Tensor] | None:
        """The resident copies of ``ex``'s shard on ``device`` while still exact, else None."""
        with self._lock:
            entry = self._entries.get(id(ex))
        if entry is None or entry[0] is not ex or entry[1] != ex.versions(device):
            return None
        return dict(entry[2])

    def prefetch(self, ex: ShardExec, device: Device) -> int:
        """Copy ``ex``'s shard onto ``device`` unless it is resident already; returns the bytes copied."""
        if self.take(ex, device) is not None:
            return 0
        with device.copy_scope(), device.copier.deferred():
            copies = ex.copy_in(device)
            device.copier.finish_copies()
        self.put(ex, device, copies)
        return sum(t.numel() * t.element_size() for t in copies.values())

    def drop(self, ex: ShardExec) -> None:
        with self._lock:
            self._entries.pop(id(ex), None)

    def retain(self, keep: Sequence[ShardExec]) -> None:
        """Free every resident copy except those of ``keep`` (the running unit's and the next one's)."""
        ids = {id(ex) for ex in keep}
        with self._lock:
            for key in [k for k in self._entries if k not in ids]:
                del self._entries[key]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def offloading(device: Device, copies: dict[int, torch.Tensor], mode: Any) -> Offloader:
    """The saved-tensor hooks of an offloading forward, to enter around it (device/offload.py has the rules):
    parameters and buffers (``copies``) stay referenced, their bytes released and refilled like a kept forward's;
    every other saved tensor on the device goes to host memory now and comes back when the backward needs it."""
    return Offloader(device.copier, list(copies.values()), pause=lambda: paused_accounting(mode))
