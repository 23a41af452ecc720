"""The simulator's ready pools and waiting devices (hydra_tune.sim.simulator's internals).

A pool holds the ready tasks and answers ``take(device, idle, cur)``: the task the policy gives ``device``, where
``cur`` (optional) is the task the device is running, competing as the runtime makes it compete (newest seq, last
run on this device). Picking ``cur`` returns its id without popping anything (it is not in the pool). The
reference ``ListPool`` calls the policy function itself; the heap pools give the same answers in O(log n)
(tests/test_simulate.py proves them equal on random sequences).
"""
from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import rule_error
from ..policy.schedule import POLICIES, Policy, Ready, fifo, lrtf, round_robin

Rec = tuple[int, int, "int | None", float, int]
"""(task id, seq, last device, remaining seconds, turns): one pool entry's fields; the task id is its admission."""


class ListPool:
    """Reference pool: calls the policy function on the full ready list, as the runtime does."""

    def __init__(self, policy: Policy, names: Sequence[str]) -> None:
        self.policy, self.names = policy, names
        self.items: list[Any] = []  # here (Ready, task id); each heap pool keeps its own key tuples

    def __len__(self) -> int:
        return len(self.items)

    def _ready(self, r: Rec) -> Ready:
        tid, seq, last, rem, turns = r
        return Ready(self.names[tid], seq, last, rem, turns, tid)

    def push(self, tid: int, seq: int, last: int | None, rem: float, turns: int) -> None:
        self.items.append((self._ready((tid, seq, last, rem, turns)), tid))

    def take(self, device: int, idle: Sequence[int], cur: Rec | None = None) -> int:
        cands = [r for r, _ in self.items] + ([self._ready(cur)] if cur is not None else [])
        i = self.policy(cands, device, tuple(idle))
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(cands):
            raise rule_error("a policy returns an index into `ready`", "return an int in range",
                             index=i, ready=len(cands))
        return cur[0] if i == len(self.items) else self.items.pop(i)[1]  # type: ignore[index]


class LrtfPool(ListPool):
    """Heap on (-remaining, seq): the same total order lrtf sorts by (seqs are unique), so the window is the heap's
    first entries, with ``cur`` merged in."""

    def push(self, tid: int, seq: int, last: int | None, rem: float, turns: int) -> None:
        heapq.heappush(self.items, (-rem, seq, -1 if last is None else last, tid))

    def take(self, device: int, idle: Sequence[int], cur: Rec | None = None) -> int:
        w = 1 + len(idle)
        window = [heapq.heappop(self.items) for _ in range(min(w, len(self.items)))]
        mine = None
        if cur is not None:
            mine = (-cur[3], cur[1], -1 if cur[2] is None else cur[2], cur[0])
            bisect.insort(window, mine)
            if len(window) > w and window[-1] is not mine:
                heapq.heappush(self.items, window.pop())
            del window[w:]
        pick = next((e for e in window if e[2] == device), None)
        if pick is None:   # the rest of lrtf: not one that last ran on another idle device, else the longest
            pick = next((e for e in window if e[2] not in idle), window[0])
        for e in window:
            if e is not pick and e is not mine:
                heapq.heappush(self.items, e)
        return pick[3]


class KeyPool(ListPool):
    """Heap on a device-independent key: fifo's (seq) (seqs are unique), round_robin's (turns, admitted, seq)."""

    def _key(self, tid: int, seq: int, last: int | None, rem: float, turns: int) -> tuple[int, ...]:
        return (seq, tid) if self.policy is fifo else (turns, tid, seq, tid)

    def push(self, tid: int, seq: int, last: int | None, rem: float, turns: int) -> None:
        heapq.heappush(self.items, self._key(tid, seq, last, rem, turns))

    def take(self, device: int, idle: Sequence[int], cur: Rec | None = None) -> int:
        if cur is not None and (not self.items or self._key(*cur) < self.items[0]):
            return cur[0]
        return heapq.heappop(self.items)[-1]


def make_pool(name: str, names: Sequence[str], fast: bool) -> ListPool:
    """The pool for policy ``name`` over tasks ``names`` (by task id): a heap pool when ``fast`` and one exists."""
    fn = POLICIES[name]
    if fast and fn is lrtf:
        return LrtfPool(fn, names)
    if fast and fn in (fifo, round_robin):
        return KeyPool(fn, names)
    return ListPool(fn, names)


class Waiting:
    """The devices blocked until a task is ready, in ascending index: the order they take in, and the ``idle`` a
    policy sees; length and membership in O(1) when hundreds of devices wait."""

    def __init__(self, devices: int) -> None:
        self.order, self.where = list(range(devices)), [True] * devices

    def add(self, d: int) -> None:
        self.where[d] = True
        bisect.insort(self.order, d)

    def pop_first(self) -> int:
        d = self.order.pop(0)
        self.where[d] = False
        return d

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, d: object) -> bool:
        return isinstance(d, int) and 0 <= d < len(self.where) and self.where[d]

    def __iter__(self) -> Iterator[int]:
        return iter(self.order)

    def __getitem__(self, i: int) -> int:
        return self.order[i]
