"""Host-memory admission: which submitted tasks may hold their state in host memory now, which wait, which never fit.

    host = HostAdmission(budget=2 << 30)                         # None: measured (MemAvailable less a reserve)
    host.offer("t0", footprint=600 << 20, capacity=host.budget)  # "admit" | "queue" | "reject"
    host.release("t0"); host.next(capacity=host.budget)          # ("admit", "t1") once the head of the queue fits

Pure logic over plain numbers; ``available_host_memory`` is the one probe of the machine. The runtime keeps one
``HostAdmission`` and asks it at every submit and whenever a task ends. The rules:

* capacity: an explicit ``host_memory`` is a hard budget. Measured (``host_memory=None``): the memory available
  now (``MemAvailable`` of /proc/meminfo; elsewhere ``os.sysconf`` free pages) less a reserve
  (``host_reserve``: 10% of the machine's memory, at least 1 GiB, at most 8 GiB), plus the host bytes the
  admitted tasks hold now (that memory is theirs, counted by their footprints below).
* an admitted task is charged its footprint, or the bytes it was measured to hold when that is more; free is
  capacity less the charges (measured: the available memory less the reserve and the part of the admitted
  footprints not yet allocated, which is what keeps many trials submitted at once from overcommitting).
* a task whose footprint exceeds the capacity cannot fit even with nothing else admitted: it is rejected.
* otherwise it is admitted when it fits what is free and no task is waiting, else it waits. Waiting tasks are
  admitted first come, first served, and only from the head: a big task is never overtaken by small ones that
  arrive after it, so it cannot starve (the price: small ones wait behind it while memory frees up).
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from ..errors import rule_error

GIB = 1 << 30
RESERVE_FRACTION = 0.10
RESERVE_MIN = 1 * GIB
RESERVE_MAX = 8 * GIB


def host_reserve(total: int) -> int:
    """Host memory a measured budget leaves to everything else on the machine (OS, other processes, the Python
    process itself, allocator slack): 10% of ``total``, at least 1 GiB, at most 8 GiB."""
    return int(min(max(total * RESERVE_FRACTION, RESERVE_MIN), RESERVE_MAX))


def available_host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory now: /proc/meminfo's MemAvailable and MemTotal on Linux (they count
    reclaimable page cache as available), else free and total physical pages from ``os.sysconf``."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def measured_capacity(held: int) -> int:
    """Measured capacity for the admitted tasks: available memory less the reserve, plus ``held`` (what the
    admitted tasks hold now: it would come back if they ended)."""
    available, total = available_host_memory()
    return available - host_reserve(total) + held


class HostAdmission:
    """Admitted footprints and the first-come, first-served queue of tasks waiting for host memory.

    Every method takes the current ``capacity`` (``budget`` when it is fixed, ``measured_capacity`` otherwise)
    and, for measured capacity, ``held``: each admitted task's host bytes now (a task is charged the larger of
    its footprint and that). Not thread-safe: the runtime calls it under its own lock.
    """

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self.admitted: dict[str, int] = {}   # name -> footprint, in admission order
        self.waiting: dict[str, int] = {}    # name -> footprint, in arrival order

    @property
    def measured(self) -> bool:
        return self.budget is None

    def charged(self, held: Mapping[str, int] | None = None) -> int:
        held = held or {}
        return sum(max(fp, held.get(name, 0)) for name, fp in self.admitted.items())

    def free(self, capacity: int, held: Mapping[str, int] | None = None) -> int:
        return capacity - self.charged(held)

    def offer(self, name: str, footprint: int, capacity: int, held: Mapping[str, int] | None = None) -> str:
        """Decide a new task: "admit" (recorded as admitted), "queue" (recorded as waiting) or "reject"."""
        if footprint > capacity:
            self._check_name(name)
            return "reject"
        if self.reserve(name, footprint, capacity, held):
            return "admit"
        self.waiting[name] = footprint
        return "queue"

    def reserve(self, name: str, footprint: int, capacity: int, held: Mapping[str, int] | None = None) -> bool:
        """Admit a new task now if nothing waits and ``footprint`` fits (recorded as admitted); else record
        nothing and return False."""
        self._check_name(name)
        if self.waiting or footprint > self.free(capacity, held):
            return False
        self.admitted[name] = footprint
        return True

    def resize(self, name: str, footprint: int, capacity: int, held: Mapping[str, int] | None = None) -> bool:
        """Change an admitted task's footprint (a reservation made before its activations were known) if the
        new one fits what is free with its old charge counted as free; False (unchanged) if not."""
        held = held or {}
        if footprint > self.free(capacity, held) + max(self.admitted[name], held.get(name, 0)):
            return False
        self.admitted[name] = footprint
        return True

    def next(self, capacity: int, held: Mapping[str, int] | None = None) -> tuple[str, str] | None:
        """The head of the queue, now ("admit", name) if it fits (recorded as admitted) or ("reject", name) if
        it can no longer fit at all (capacity shrank: only when nothing is admitted, so nothing will free up);
        None while it must wait."""
        if not self.waiting:
            return None
        name, footprint = next(iter(self.waiting.items()))
        if footprint <= self.free(capacity, held):
            del self.waiting[name]
            self.admitted[name] = footprint
            return "admit", name
        if not self.admitted and footprint > capacity:
            del self.waiting[name]
            return "reject", name
        return None

    def release(self, name: str) -> None:
        """An admitted task ended (or was never built): its footprint is free again."""
        self.admitted.pop(name, None)

    def set_charge(self, name: str, footprint: int) -> None:
        """Charge ``name`` (an admitted task, or the runtime's pool of shared frozen weights) ``footprint`` from
        now on: a built task whose frozen weights went to the pool is charged the rest, the pool its bytes once;
        0 drops the charge."""
        if footprint > 0:
            self.admitted[name] = footprint
        else:
            self.admitted.pop(name, None)

    def _check_name(self, name: str) -> None:
        if name in self.admitted or name in self.waiting:
            raise rule_error("task names are unique among running and waiting tasks", "give each ModelTask its "
                             "own `name`", name=name)

    def withdraw(self, name: str) -> bool:
        """Remove a waiting task (cancelled, or the runtime closed); False if it is not waiting."""
        return self.waiting.pop(name, None) is not None
