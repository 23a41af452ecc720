"""The Python state around a shard's units (ShardExec's, shard.py): snapshots for a retry's undo and a recompute's
replay.

    with ex.python_state(device, store): ...          # a unit: what its forward changed is noted for a retry
    with ex._replaying(store.states.pop(i, None)): ...  # a recomputing B unit replays its F unit's state

The rules are shard.py's (its module docstring): a recompute replays its forward from the state the F unit saw and
must change the same attributes; a retry undoes what the failed attempt changed; tensors a unit binds to
attributes move to host memory. Modules of torch's own inert classes (pystate_inert.still_inert) take no snapshot.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from ..device.devices import Device
from ..errors import rule_error
from . import host_rng
from .pystate import ModuleState
from .pystate_inert import still_inert
from .pystate_layout import Snapshots
from .store import HostStore

_NOTHING = contextlib.nullcontext()
HOST_CHECKS = 2  # a shard's recomputed forwards watched for draws from Python's or numpy's global generator


class ShardPythonState:
    """Mixed into ShardExec, whose ``index``, ``modules``, ``names``, ``_inert`` and ``_snapshots`` (a
    pystate_layout.Snapshots of its modules) it reads."""

    index: int
    modules: list[Any]
    names: tuple[str, ...]
    _inert: Any
    _snapshots: Snapshots
    # Python's random and numpy's generator (host_rng.py): reading them costs tens of microseconds, so a shard's
    # first HOST_CHECKS recomputed forwards are watched, and only one seen drawing is snapshotted from then on
    _host_checks: int = 0
    _draws_host: bool = False

    def snapshot_against(self, known: ModuleState) -> None:
        """Snapshots before units share ``known``'s values where they are the same (the task's as-built snapshot of
        its model, kept for checkpoints: most of a model's places never change)."""
        self._snapshots = Snapshots(self.modules, known)

    def python_state(self, device: Device, store: HostStore,
                     replay: bool = False) -> contextlib.AbstractContextManager[None]:
        """Around a unit: Python state its forward (or backward hooks) changed is noted for a retry's undo, and
        tensors it bound to attributes move to host memory; with ``replay`` (an F unit whose B recomputes) the
        state it started from is kept for that recompute. Modules of torch's own inert classes take no snapshot
        (pystate_inert.still_inert: it would find nothing changed)."""
        return _NOTHING if still_inert(self._inert) else self._snapshot(device, store, replay)

    @contextlib.contextmanager
    def _snapshot(self, device: Device, store: HostStore, replay: bool) -> Iterator[None]:
        before = self._snapshots.take()
        watch = replay and (self._draws_host or self._host_checks < HOST_CHECKS)
        host = host_rng.states() if watch else None
        try:
            yield
        finally:  # also when the unit failed half way (out of memory): the retry undoes what it did change
            changed = before.changed()
            if changed:
                before.settle(functools.partial(device.copier.to_host, what="buffers"))
                store.note_state(before)
        if host is not None:
            self._host_checks += 1
            self._draws_host = self._draws_host or host_rng.states() != host
            if self._draws_host:
                store.host_rng[self.index] = host  # its recompute draws what it drew (host_rng.replay)
        if replay and changed:
            lost = before.inplace()
            if lost:
                raise rule_error(
                    "a forward that its shard's backward recomputes changes no tensor attribute in place (the "
                    "recompute needs the value it had, which is gone)", "register such a tensor as a "
                    "buffer (self.register_buffer(name, t): buffers are kept and written back exactly), or assign "
                    "a new tensor (self.t = self.t + x) instead of changing it in place", attributes=lost,
                    shard=list(self.names))
            store.states[self.index] = (before, before.changed_names())

    @contextlib.contextmanager
    def _replaying(self, kept: tuple[ModuleState, list[str]] | None) -> Iterator[None]:
        """A recompute runs from the Python state its F unit started from (``kept``: that state and what F changed)
        and must change the same attributes; the state after F is put back."""
        now = self._snapshots.take()
        before, by_forward = kept if kept is not None else (now, [])
        if kept is not None:
            before.restore()
        try:
            yield
            by_recompute = before.changed_names()
        finally:
            now.restore()
        if by_recompute != by_forward:  # e.g. state updated on every other call of a counter kept elsewhere
            raise rule_error(
                "a forward that its shard's backward recomputes changes the same Python state when recomputed (the "
                "recompute runs from the state the F unit started from)", "make the forward's state updates depend "
                "only on the module's own state and its inputs (not on a counter or flag kept outside the model)",
                forward_changed=by_forward, recompute_changed=by_recompute, shard=list(self.names))

