"""Frozen weights several tasks of one runtime hold once: one host copy, one copy per device that ran them.

    shared = SharedFrozen()                       # one per Runtime
    shares = shared.share("trial-1", model)       # equal frozen parameters now point at one host tensor
    shared.thaw(shares, shares.thawed(opt))       # before each optimizer step: ones made trainable become the task's
    shares.check()                                # after each optimizer step: raises if the task wrote into one
    shared.device_copy(host_tensor, device)       # ShardExec.copy_in: one device copy for every task
    shared.release("trial-1", model)              # the task ended (done, failed, cancelled); the last frees it
    later = shared.release("trial-2", model, lazy=True); later()   # its private copies made when asked for
    shared.stats()                                # {"tensors", "shared_bytes", "saved_bytes", "copied_bytes", ...}

Rules:
* What may be shared and when two tensors are equal (byte for byte, found by a sampled probe): see
  shared_frozen_match.py. A frozen parameter that the optimizer lists (``AdamW(model.parameters())``) is shared
  too: it gets no gradient, so torch's optimizers skip it; an optimizer that writes into it anyway is caught like
  any other write. A tensor whose storage is already the pool's (the same pretrained source handed to several
  tasks) is recognised by identity and version without reading it.
* Device copies: one per device and entry, made once even when a device's compute and copy threads ask for it at
  the same moment; ``stats()["recopied_bytes"]`` counts copies of an entry onto a device that had one before
  (a copy its budget share could not keep): 0 means the base crossed to each device once.
* Read-only in effect: a task that writes into a shared tensor in place through its parameter (torch's version
  counter of that parameter moves) fails at its next optimizer step with an error naming the tensor; the pool
  puts the values back from a clean device copy (made before the write, its own counter unmoved), so the other
  tasks go on with the values they were built with. With no clean copy left the entry is poisoned: every holder
  fails at its next step naming the writer, and no device copy is made from it (a unit needing one raises).
  Units never see a host write: they run on the pool's device copies, and a device copy written in place by a
  forward is refused when next handed out. The pool's tensor has an in-place counter of its own (not the counter
  of the parameter it was taken from, which its task may make trainable and step): a write through it (a CPU
  device's unit reading it in place) is caught at the holders' next check like a write through a parameter.
  A CPU device (a stand-in whose "device copy" is host memory too) that cannot keep its copy (``DEVICE_SHARE``
  of its budget) gets the pooled host tensor itself instead of a new copy per unit: a forward writing into it
  moves the pool's counter, and with no clean copy to restore from the entry is poisoned (every holder fails,
  naming the writer; a copy that was not kept could not restore it either).
  CPU devices share one address space: a CPU device takes another CPU device's kept copy (one clean copy serves
  them all). Writes through ``.data`` are not seen by version counters: hydra_tune cannot detect them (tasks
  must not write into frozen weights).
* Lifetime: each task holding an entry is counted; when a task ends (done, failed, cancelled) its model gets
  private copies of the entries others still hold (the user's model is then independent of the runtime: e.g.
  ``merge_and_unload()`` on it changes no other trial), and the last holder keeps the tensor itself; equal
  weights within one model (LayerNorm ones, zero biases) share an entry while training and get separate tensors
  back at the end; an entry nobody holds is forgotten, with its device copies. The copies are made at the end
  for a model the user can reach (passed in, or a factory's model held elsewhere: TaskState.model_reachable), and
  for one only a factory built and held when the user first asks for it
  (``release(..., lazy=True)`` returns the ``Privatize`` that ``handle.model()`` calls): a trial whose model
  nobody asks for (a search that keeps only metrics, a failed or cancelled trial) copies nothing, and its model
  is freed by reference counting once its handle goes.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ..device.streams import alias
from ..errors import rule_error
from .names import shared_name
from .shared_frozen_copies import DEVICE_SHARE, WRITE_FIX, WRITE_RULE, SharedDeviceCopies, on_host
from .shared_frozen_match import content_key, probe_key, qualifies, same_bytes

__all__ = ["DEVICE_SHARE", "Privatize", "SharedFrozen", "TaskShares", "content_key", "probe_key", "same_bytes"]

@dataclass
class _Entry:
    tensor: torch.Tensor                      # the one host copy
    nbytes: int
    version: int                              # its version counter when pooled: moved means written
    holders: dict[str, int] = field(default_factory=dict)   # task name -> parameters of it pointing here
    devices: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)  # device -> (copy, its version)
    # every holder's parameter and its version when pooled: each has its own in-place counter (``p.data = t``
    # does not share counters), so a write shows only on the parameter it went through
    params: list[tuple[str, str, nn.Parameter, int]] = field(default_factory=list)
    poisoned: str = ""                        # "task: name" that wrote into it when no clean copy was left
    copied_to: set[str] = field(default_factory=set)     # devices that ever got a copy made of it
    copying: dict[str, threading.Lock] = field(default_factory=dict)  # device -> held while its copy is made

    def written(self) -> list[str]:
        return [f"{task}: {name}" for task, name, p, v in self.params if p._version != v]



@dataclass
class TaskShares:
    """One task's shared parameters: (name in the model, parameter, entry key, version when shared)."""

    task: str
    params: list[tuple[str, nn.Parameter, Any, int]]
    pool: SharedFrozen | None = None
    match_seconds: float = 0.0

    def check(self) -> None:
        """Raise when the task wrote into a shared tensor in place (its version counter moved: the pool puts the
        values back from a clean device copy), or another task wrote into one it holds and none was left."""
        if self.pool is None or not self.params:  # (a task holding no shared tensor: nothing to check)
            return
        written, poisoned = self.pool.check(self.task, {key for _, _, key, _ in self.params})
        if written:
            raise rule_error(WRITE_RULE, WRITE_FIX, task=self.task, written=written[:5], count=len(written))
        if poisoned:
            raise rule_error(WRITE_RULE, WRITE_FIX + "; this task holds weights another task wrote into, "
                             "with no clean copy left to restore", task=self.task, written_by=poisoned[:5])

    def thawed(self, optimizer: torch.optim.Optimizer) -> list[tuple[str, nn.Parameter, Any, int]]:
        """Before each optimizer step: the task's shared parameters made trainable since they were shared
        (``requires_grad_(True)`` and ``add_param_group``: gradual unfreezing), which ``optimizer`` would write
        now (they have a gradient and it lists them). ``SharedFrozen.thaw`` makes them the task's own."""
        graded = [x for x in self.params if x[1].requires_grad and x[1].grad is not None]
        if not graded:  # (the common case: no optimizer groups to read)
            return []
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return [x for x in graded if id(x[1]) in stepped]

    def storages(self) -> set[int]:
        return {p.untyped_storage().data_ptr() for _, p, _, _ in self.params}

    def keys(self) -> set[int]:
        """ids of the parameters whose device copies come from the shared pool."""
        return {id(p) for _, p, _, _ in self.params}

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for _, p, _, _ in self.params)


class Privatize:
    """An ended task's parameters that still point at pooled tensors; calling it gives each a copy of its own,
    once (``privatize()``; later calls do nothing). Counted in the pool's ``stats()["private_copy_bytes"]``."""

    def __init__(self, pool: SharedFrozen, params: list[nn.Parameter]) -> None:
        self._pool, self._params, self._lock = pool, params, threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            params, self._params = self._params, []
            copied = 0
            with torch.no_grad():
                for p in params:
                    if p.data_ptr() != 0 and p.device.type == "cpu":
                        p.data = p.data.clone()
                        copied += p.numel() * p.element_size()
        self._pool.count_private(copied)


class SharedFrozen(SharedDeviceCopies):
    """The runtime's pool of frozen tensors (see the module docstring). Thread-safe."""

    def __init__(self, retain: int = 0) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Any, _Entry] = {}
        self.retain = retain                     # bytes of entries kept after their last holder (RETAIN rules)
        self._retained: OrderedDict[Any, None] = OrderedDict()   # those entries, least recently used first
        self.retained_hits = 0                   # bytes later tasks found among them
        self.evicted = 0                         # bytes of them dropped (over ``retain``, or room for a task)
        self._by_ptr: dict[int, Any] = {}      # host storage pointer of an entry -> its key
        self._index: dict[Any, list[Any]] = {}  # probe key -> keys of the entries with that probe
        self._ids = itertools.count()
        self._tasks: dict[str, TaskShares] = {}
        self._wrote: dict[str, list[str]] = {}   # task -> parameters it wrote into, until its next check
        self.copied: dict[str, int] = {}         # device -> pooled bytes copied onto it
        self.recopied: dict[str, int] = {}       # device -> of those, bytes of entries it had a copy of before
        self.aliased: dict[str, int] = {}        # CPU device -> pooled bytes it read in place (no copy)
        self.private_copy_bytes = 0              # bytes copied for ended tasks' models (Privatize)
        self.thawed_copy_bytes = 0               # bytes copied for parameters a task made trainable (thaw)
        self.reused: dict[str, int] = {}         # CPU device -> pooled bytes it took from another CPU device's copy
        self.match_seconds = 0.0
        self.compared_bytes = 0

    def share(self, task: str, model: nn.Module, prepare: Any = None) -> TaskShares:
        """Point ``model``'s qualifying frozen parameters at the pool's tensors (equal ones found, new ones
        added); what the task held before for them is freed unless the caller keeps it. ``prepare([p])`` readies
        a parameter that becomes a new entry (the CUDA copier pins it) before the pool takes its tensor."""
        shares = TaskShares(task, [], self)
        seen: set[int] = set()
        found: list[tuple[str, nn.Parameter]] = []
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) not in seen and qualifies(p):
                seen.add(id(p))
                found.append((shared_name(name), p))
        start = time.perf_counter()
        for name, p in found:
            key, probe = self._match(p)
            with self._lock:
                entry = self._entries.get(key) if key is not None else None
                if entry is None:  # nothing equal pooled (or it went meanwhile): a new entry
                    if prepare is not None:
                        prepare([p])
                    key = (probe, next(self._ids))
                    # a counter of its own (``p.detach()`` shares p's: once its task made p trainable and stepped
                    # it, the others' device copies read as written: tests/test_prepare_proxy.py)
                    tensor = alias(p)
                    entry = self._entries[key] = _Entry(tensor, p.numel() * p.element_size(), tensor._version)
                    self._by_ptr[p.data_ptr()] = key
                    self._index.setdefault(probe, []).append(key)
                if key in self._retained:  # kept after its last holder: found by this later task
                    del self._retained[key]
                    self.retained_hits += entry.nbytes
                entry.holders[task] = entry.holders.get(task, 0) + 1
                if p.data_ptr() != entry.tensor.data_ptr():
                    with torch.no_grad():
                        p.data = entry.tensor  # the task's own copy goes when nothing else holds it
                entry.params.append((task, name, p, p._version))
            shares.params.append((name, p, key, p._version))
        shares.match_seconds = time.perf_counter() - start
        with self._lock:
            self._tasks[task] = shares
            self.match_seconds += shares.match_seconds
        return shares

    def _match(self, p: torch.Tensor) -> tuple[Any, Any]:
        """(key of a pooled tensor with ``p``'s bytes or None, ``p``'s probe key)."""
        with self._lock:
            key = self._by_ptr.get(p.data_ptr())
            entry = self._entries.get(key) if key is not None else None
        if entry is not None and entry.tensor.stride() == p.stride() and entry.tensor.shape == p.shape \
                and entry.tensor.dtype == p.dtype and entry.tensor._version == entry.version:
            return key, key[0]  # the pool's own tensor, unchanged (a write in place would move its version)
        probe = probe_key(p)
        with self._lock:
            candidates = [(k, self._entries[k].tensor) for k in self._index.get(probe, ())]
        for k, t in candidates:  # compared outside the lock: units copying pooled tensors are not held up
            with self._lock:
                self.compared_bytes += p.numel() * p.element_size()
            if same_bytes(t, p):
                return k, probe
        return None, probe

    def release(self, task: str, model: nn.Module | None = None, lazy: bool = False) -> Privatize | None:
        """``task`` ended: it holds its entries no more; the rest are forgotten. ``model`` gets private copies of
        the entries others still hold (its values, independent of the pool): now, or with ``lazy`` when the
        returned ``Privatize`` is called (``handle.model()``: a model nobody asks for is never copied)."""
        with self._lock:
            shares = self._tasks.pop(task, None)
            self._wrote.pop(task, None)
            if shares is None:
                return None
            for key in {key for _, _, key, _ in shares.params}:
                entry = self._entries.get(key)
                if entry is None:
                    continue
                entry.holders.pop(task, None)
                entry.params = [x for x in entry.params if x[0] != task]
                if not entry.holders:
                    self._retain_or_forget(key, entry)
            private: list[nn.Parameter] = []
            first: set[Any] = set()
            for _, p, key, _ in shares.params:
                # the model gets back separate tensors: its own for entries others hold, and one per parameter
                # for equal weights within it (LayerNorm ones, zero biases: pooled as one entry)
                if key in self._entries or key in first:
                    private.append(p)
                first.add(key)
        if model is None:
            return None
        privatize = Privatize(self, list({id(p): p for p in private}.values()))
        if lazy:
            return privatize
        privatize()
        return None

    def thaw(self, shares: TaskShares, thawed: list[tuple[str, nn.Parameter, Any, int]]) -> list[nn.Parameter]:
        """``shares``' task made these parameters trainable (``TaskShares.thawed``): each becomes the task's own
        before its step writes it, a copy where the pooled tensor has other holders (other tasks, or an equal
        parameter of the same model), else the pooled tensor itself (its entry is forgotten, not kept for later
        tasks: the task writes it from now on). Returns them."""
        gone = {id(p) for _, p, _, _ in thawed}
        with self._lock:
            for _, p, key, _ in thawed:
                entry = self._entries.get(key)
                if entry is None:
                    continue
                entry.params = [x for x in entry.params if x[2] is not p]
                left = entry.holders.pop(shares.task, 0) - 1
                if left > 0:
                    entry.holders[shares.task] = left
                with torch.no_grad():
                    if entry.holders:
                        p.data = entry.tensor.clone()
                        self.thawed_copy_bytes += entry.nbytes
                    else:
                        self._forget(key, entry)
            shares.params = [x for x in shares.params if id(x[1]) not in gone]
        return [p for _, p, _, _ in thawed]

    def _retain_or_forget(self, key: Any, entry: _Entry) -> None:
        """``entry`` lost its last holder: kept in host memory for a later task while ``retain`` allows (its
        device copies go: device memory belongs to the running tasks), else forgotten; under the lock."""
        entry.devices.clear()
        if entry.nbytes > self.retain or entry.poisoned:
            self._forget(key, entry)
            return
        self._retained[key] = None
        self._drop_retained(self._retained_nbytes() - self.retain)

    def _drop_retained(self, nbytes: int) -> int:
        """Forget retained entries, least recently used first, until ``nbytes`` went; the bytes dropped."""
        dropped = 0
        while dropped < nbytes and self._retained:
            key, _ = self._retained.popitem(last=False)
            entry = self._entries[key]
            self._forget(key, entry)
            dropped += entry.nbytes
        self.evicted += dropped
        return dropped

    def evict(self, nbytes: int) -> int:
        """Make room: forget retained entries (least recently used first) worth ``nbytes``; the bytes dropped."""
        with self._lock:
            return self._drop_retained(nbytes)

    def _retained_nbytes(self) -> int:
        """Bytes of the entries kept after their last holder; under the lock."""
        return sum(self._entries[k].nbytes for k in self._retained)

    def count_private(self, nbytes: int) -> None:
        """An ended task's model copied ``nbytes`` of pooled weights into its own tensors (Privatize)."""
        with self._lock:
            self.private_copy_bytes += nbytes

    def _forget(self, key: Any, entry: _Entry) -> None:
        """Drop ``entry`` (nobody holds it), with its device copies; under the lock."""
        self._entries.pop(key)
        self._by_ptr.pop(entry.tensor.data_ptr(), None)
        same = self._index.get(key[0], [])
        if key in same:
            same.remove(key)
        if not same:
            self._index.pop(key[0], None)
        entry.devices.clear()

    def check(self, task: str, keys: set[Any]) -> tuple[list[str], list[str]]:
        """(names of ``task``'s parameters it wrote into, who wrote into others it holds with no clean copy
        left). A written entry gets its values back from a clean device copy (made before the write, its own
        version unmoved), and every holder's counter is marked anew; one with none left is poisoned: each
        holder's next check fails, and no device copy is made from it."""
        own: list[str] = []
        poisoned: list[str] = []
        with self._lock:
            for entry in [self._entries[k] for k in keys if k in self._entries]:
                written = [(t, n) for t, n, p, v in entry.params if p._version != v]
                for t, n in written:  # the writer fails at its own next check, whoever restores it
                    self._wrote.setdefault(t, []).append(n)
                # a write through the pooled tensor itself: a CPU device's unit that read it in place wrote it
                by_unit = entry.tensor._version != entry.version
                if (written or by_unit) and not entry.poisoned:
                    clean = [c for c, v in entry.devices.values()  # not the host tensor itself (CPU devices)
                             if c._version == v and c.untyped_storage().nbytes()
                             and c.data_ptr() != entry.tensor.data_ptr()]
                    if clean:
                        with torch.no_grad():
                            entry.tensor.copy_(clean[0].to(entry.tensor.device))
                        entry.params = [(t, n, p, p._version) for t, n, p, _ in entry.params]
                        entry.version = entry.tensor._version
                        entry.devices = {d: (c, c._version) if c.data_ptr() == entry.tensor.data_ptr() else (c, v)
                                         for d, (c, v) in entry.devices.items()}
                    else:
                        entry.poisoned = ", ".join([f"{t}: {n}" for t, n in written]
                                                   or ["a unit writing into the pooled tensor in place"])
                if entry.poisoned:
                    poisoned.append(entry.poisoned)
            own = self._wrote.pop(task, [])
        return own, [p for p in poisoned if not own]

    def nbytes(self) -> int:
        """Host bytes of the pooled tensors (each once)."""
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def stats(self) -> dict[str, Any]:
        """``tensors`` and ``shared_bytes`` held once; ``holders`` per task; ``saved_bytes``: what separate
        copies would hold more; ``host_copy_bytes``: the kept device copies that are host memory too (CPU
        stand-ins; each storage once); ``match_seconds``/``compared_bytes`` spent finding equal tensors."""
        with self._lock:
            holders: dict[str, int] = {}
            saved = 0
            host_copies: dict[int, int] = {}
            for e in self._entries.values():
                for name in e.holders:
                    holders[name] = holders.get(name, 0) + e.nbytes
                saved += e.nbytes * max(len(e.holders) - 1, 0)
                host_copies.update({c.data_ptr(): e.nbytes for c, _ in e.devices.values()
                                    if on_host(c) and c.data_ptr() != e.tensor.data_ptr()})
            return {"tensors": len(self._entries), "shared_bytes": sum(e.nbytes for e in self._entries.values()),
                    "per_task_shared_bytes": holders, "saved_bytes": saved,
                    "device_copies": sum(len(e.devices) for e in self._entries.values()),
                    "copied_bytes": dict(self.copied), "recopied_bytes": dict(self.recopied),
                    "aliased_bytes": dict(self.aliased),
                    "reused_bytes": dict(self.reused), "host_copy_bytes": sum(host_copies.values()),
                    "match_seconds": round(self.match_seconds, 4), "compared_bytes": self.compared_bytes,
                    "private_copy_bytes": self.private_copy_bytes,
                    "thawed_copy_bytes": self.thawed_copy_bytes,
                    "retained_bytes": self._retained_nbytes(),
                    "retained_tensors": len(self._retained), "retained_hit_bytes": self.retained_hits,
                    "evicted_bytes": self.evicted}
