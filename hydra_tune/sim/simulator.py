"""Discrete-event simulator of hydra_tune schedules: makespans for clusters we do not have, in pure Python.

    tasks = synthetic_tasks(1000, seed=0)                       # or tasks_from_trace(runtime.trace())
    res = simulate(tasks, devices=512, policy="lrtf")           # replays hydra_tune.policy.schedule.lrtf itself
    print(res.makespan / lower_bound(tasks, 512), res.utilisation())

The model, as the runtime behaves: a task is a chain of units (F, L, B, E) grouped into segments (one minibatch's
F..L..B, or one eval batch). A device runs a task's whole segment back to back, then the segment the policy gave
it next. It asks when its segment's last unit starts (``prefetch``; at the segment's end without), and the task
it is running competes (the newest seq, last run here, one more turn, its remaining after this segment). Picked:
the device continues with it once the segment ends (its host work waits for that end, so its first copy cannot
overlap the last unit). Not picked: the picked segment is placed now, and the running task becomes ready when
its segment ends. A device whose task ended waits for a ready task; at one instant waiting devices take first
(ascending index; ``idle`` is those taking after this one), then the askers (ascending index; ``idle`` is the
waiting devices still there).

Copies (``bandwidth`` bytes/s; None: free): each unit first copies ``SimUnit.bytes`` in on its device's copy engine,
unless the device's previous unit was the same task's same shard (still resident: B0, then the next F0 there).
With ``prefetch`` (double buffering) a unit's copy starts as soon as the device's previous unit starts (so
another task's first shard copies during the last unit); without, when the previous unit ends. Host work (data,
host-side optimizer steps) is not modelled apart: ``tasks_from_trace`` folds the waits it caused into the unit
seconds.
"""
from __future__ import annotations

import bisect
import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from ..errors import rule_error
from ..policy.schedule import POLICIES
from ..runtime.trace import COMPUTE, COPY, Event, Trace
from .pool import ListPool, Waiting, make_pool

KINDS = ("F", "L", "B", "E")
BASELINES = ("task_parallel", "model_parallel", "lower_bound")


@dataclass(frozen=True, slots=True)
class SimUnit:
    kind: str          # "F", "L", "B", "E"
    shard: int
    seconds: float     # compute time
    bytes: int = 0     # shard state copied in before it runs
    segment: int = 0   # units with the same segment number (consecutive) form one segment


@dataclass(frozen=True)
class SimTask:
    name: str
    units: tuple[SimUnit, ...]


@dataclass(frozen=True)
class SimResult:
    policy: str
    makespan: float
    busy: tuple[float, ...]   # compute seconds per device
    trace: Trace | None       # the simulated run (units; copies on the COPY lane) when record=True

    def utilisation(self) -> float:
        """Share of device time spent computing: sum(busy) / (devices * makespan)."""
        return sum(self.busy) / (len(self.busy) * self.makespan) if self.busy and self.makespan > 0 else 0.0


def simulate(tasks: Sequence[SimTask], devices: int, policy: str = "lrtf", *, bandwidth: float | None = None,
             prefetch: bool = True, record: bool = False) -> SimResult:
    """Simulate ``tasks`` on ``devices`` identical devices under ``policy`` (see the module docstring)."""
    return _run(tasks, devices, policy, bandwidth, prefetch, record, fast=True)


def lower_bound(tasks: Sequence[SimTask], devices: int) -> float:
    """No schedule beats max(total compute / devices, the longest task's chain); copies are not counted."""
    return _bound(_plans(tasks, devices), devices)


def _bound(plans: list["_Plan"], devices: int) -> float:
    return max(sum(p.total for p in plans) / devices, max(p.total for p in plans))


def tasks_from_trace(trace: Trace, *, gaps: bool = True) -> list[SimTask]:
    """Tasks as a recorded run ran them, in order of first start: segments as recorded (-1: one unit each), an H2D
    copy's bytes on the next unit of its task on the same device and shard, unit seconds = end - start. With
    ``gaps``, each unit also holds the device while it waited for the segment's next unit, and a segment's first
    unit the wait before it once both its device and its task were free (host work, copies not done): so that
    ``simulate(..., bandwidth=None)`` replays the run. ``gaps=False``: compute alone (to model copies instead)."""
    units = sorted(trace.units(), key=lambda e: e.start)
    held = [e.end - e.start for e in units]
    if gaps and units:
        after: dict[tuple[str, int], float] = {}   # (task, segment) -> start of the unit after this one
        for i in range(len(units) - 1, -1, -1):
            e = units[i]
            if e.segment >= 0:
                held[i] = max(e.end, after.get((e.task, e.segment), e.end)) - e.start
                after[(e.task, e.segment)] = e.start
        t0, dev_end, task_end = units[0].start, dict[int, float](), dict[str, float]()
        seg: dict[str, int] = {}
        for i, e in enumerate(units):
            if e.segment < 0 or seg.get(e.task) != e.segment:
                held[i] += max(0.0, e.start - max(dev_end.get(e.device, t0), task_end.get(e.task, t0)))
            dev_end[e.device] = max(dev_end.get(e.device, t0), e.end)
            task_end[e.task], seg[e.task] = e.end, e.segment
    index: dict[tuple[str, int, int], list[int]] = {}
    for i, e in enumerate(units):
        index.setdefault((e.task, e.device, e.shard), []).append(i)
    extra = [0] * len(units)
    for c in trace.copies():
        if c.kind != "H2D" or c.bytes <= 0:
            continue
        cands = index.get((c.task, c.device, c.shard), [])   # its first unit starting after the copy started
        lo = bisect.bisect_left(cands, c.start, key=lambda i: units[i].start)
        if lo < len(cands):
            extra[cands[lo]] += c.bytes
    per_task: dict[str, list[SimUnit]] = {}
    last: dict[str, tuple[int, int]] = {}   # task -> (recorded segment, our segment number)
    for i, e in enumerate(units):
        rec, ours = last.get(e.task, (-2, -1))
        if e.segment < 0 or e.segment != rec:
            ours += 1
        last[e.task] = (e.segment, ours)
        per_task.setdefault(e.task, []).append(SimUnit(e.kind, e.shard, max(held[i], 0.0), extra[i], ours))
    return [SimTask(name, tuple(us)) for name, us in per_task.items()]


def synthetic_tasks(n: int, *, seed: int = 0, shards: tuple[int, int] = (1, 8),
                    minibatches: tuple[int, int] = (20, 200), forward_seconds: tuple[float, float] = (0.05, 0.5),
                    epochs: tuple[int, int] = (1, 3), eval_batches: tuple[int, int] = (0, 4),
                    copy_fraction: float = 0.5, bandwidth: float = 16e9) -> list[SimTask]:
    """A heterogeneous search, deterministic by ``seed``: per task 1-8 shards, 20-200 minibatches over 1-3
    epochs with 0-4 eval batches after each, a forward time per shard drawn log-uniformly over a 10x range (model
    sizes differ) with +-25% between its shards; L = 3x and B = 2x the shard's F, E = F. A unit's bytes take
    ``copy_fraction`` of its compute time to copy at ``bandwidth`` bytes/s."""
    if n < 1:
        raise rule_error("`n >= 1`", "ask for at least one task", n=n)
    rng = random.Random(seed)
    lo, hi = math.log(forward_seconds[0]), math.log(forward_seconds[1])
    out: list[SimTask] = []
    for t in range(n):
        k, mb, ep = rng.randint(*shards), rng.randint(*minibatches), rng.randint(*epochs)
        base = math.exp(rng.uniform(lo, hi))
        fwd = [base * rng.uniform(0.75, 1.25) for _ in range(k)]
        evals = [rng.randint(*eval_batches) for _ in range(ep)]

        def cost(kind: str, s: int, seconds: float) -> tuple[str, int, float, int]:
            return kind, s, seconds, int(copy_fraction * seconds * bandwidth)

        step = ([cost("F", s, fwd[s]) for s in range(k - 1)] + [cost("L", k - 1, 3 * fwd[k - 1])]
                + [cost("B", s, 2 * fwd[s]) for s in range(k - 2, -1, -1)])
        look = [cost("E", s, fwd[s]) for s in range(k)]
        units: list[SimUnit] = []
        seg = 0
        for e in range(ep):
            for batch in [step] * (mb // ep + (mb % ep if e == ep - 1 else 0)) + [look] * evals[e]:
                units += [SimUnit(kind, s, sec, nb, seg) for kind, s, sec, nb in batch]
                seg += 1
        out.append(SimTask(f"t{t:04d}-k{k}", tuple(units)))
    return out


# -- internals -------------------------------------------------------------------------------------------------
class _Plan:
    """One task as flat lists, with per-segment sums precomputed once (the loop below touches only these)."""

    __slots__ = ("tid", "name", "kinds", "shards", "secs", "nbytes", "bounds", "work", "pre_last", "rem", "total")

    def __init__(self, tid: int, task: SimTask) -> None:
        us = task.units
        self.tid, self.name = tid, task.name
        self.kinds, self.shards = [u.kind for u in us], [u.shard for u in us]
        self.secs, self.nbytes = [u.seconds for u in us], [u.bytes for u in us]
        if (not set(self.kinds) <= set(KINDS) or not 0.0 <= min(self.secs) <= max(self.secs) < math.inf
                or min(self.nbytes) < 0 or min(self.shards) < 0):
            bad = next(i for i, u in enumerate(us) if u.kind not in KINDS or not 0.0 <= u.seconds < math.inf
                       or u.bytes < 0 or u.shard < 0)
            raise rule_error(f"every unit has kind in {KINDS}, finite seconds >= 0, bytes >= 0, shard >= 0",
                             "fix that unit", task=task.name, unit=bad, value=us[bad])
        segs = [u.segment for u in us]
        cuts = [i for i in range(1, len(us)) if segs[i] != segs[i - 1]]
        self.bounds = list(zip([0] + cuts, cuts + [len(us)]))
        self.work: list[float] = []       # compute seconds of each segment, summed in unit order
        self.pre_last: list[float] = []   # the same sum without the segment's last unit
        for i0, i1 in self.bounds:
            sums = list(accumulate(self.secs[i0:i1]))
            self.pre_last.append(sums[-2] if len(sums) > 1 else 0.0)
            self.work.append(sums[-1])
        self.rem = [0.0] * (len(self.work) + 1)   # rem[s]: compute seconds of segments s.. (exact remaining)
        for s in range(len(self.work) - 1, -1, -1):
            self.rem[s] = self.rem[s + 1] + self.work[s]
        self.total = self.rem[0]


def _plans(tasks: Sequence[SimTask], devices: int) -> list[_Plan]:
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise rule_error("`devices` is an int >= 1", "pass how many devices to simulate", devices=devices)
    if not tasks:
        raise rule_error("`tasks` is not empty", "pass at least one SimTask", tasks=tasks)
    names = [getattr(t, "name", None) for t in tasks]
    if len(set(names)) != len(names) or not all(isinstance(t, SimTask) and t.units for t in tasks):
        raise rule_error("`tasks` are SimTasks with unique names and at least one unit each",
                         "rename duplicates and drop empty tasks", names=names)
    return [_Plan(i, t) for i, t in enumerate(tasks)]


class _Dev:
    __slots__ = ("free", "copy_free", "unit_start", "held", "busy")

    def __init__(self) -> None:
        self.free = self.copy_free = self.unit_start = self.busy = 0.0   # compute end, copy engine end, ...
        self.held: tuple[int, int] = (-1, -1)                            # (task, shard) of its last unit


def _place(p: _Plan, s: int, dev: _Dev, d: int, t: float, task_free: float, bw: float | None, prefetch: bool,
           events: list[Event] | None) -> tuple[float, float]:
    """Run segment ``s`` of ``p`` on ``dev``, decided at ``t``; returns (start of its last unit, its end)."""
    i0, i1 = p.bounds[s]
    start = max(dev.free, task_free, t)
    dev.busy += p.work[s]
    if bw is None:  # no copies: unit times are prefix sums, the same floats with or without recording
        if events is not None:
            acc = 0.0
            for i in range(i0, i1):
                a, acc = acc, acc + p.secs[i]
                events.append(Event(d, p.name, p.shards[i], p.kinds[i], start + a, start + acc, 0, COMPUTE, s))
        dev.free, dev.unit_start, dev.held = start + p.work[s], start + p.pre_last[s], (p.tid, p.shards[i1 - 1])
        return dev.unit_start, dev.free
    prev_end, floor = start, max(t, task_free)
    for i in range(i0, i1):
        shard, nbytes = p.shards[i], p.nbytes[i]
        ustart = prev_end
        if nbytes and dev.held != (p.tid, shard):
            cs = max(dev.copy_free, dev.unit_start if prefetch else prev_end, floor)
            dev.copy_free = ce = cs + nbytes / bw
            ustart = max(prev_end, ce)
            if events is not None:
                events.append(Event(d, p.name, shard, "H2D", cs, ce, nbytes, COPY, s))
        prev_end = ustart + p.secs[i]
        dev.unit_start, dev.held = ustart, (p.tid, shard)
        if events is not None:
            events.append(Event(d, p.name, shard, p.kinds[i], ustart, prev_end, 0, COMPUTE, s))
    dev.free = prev_end
    return dev.unit_start, prev_end


def _run(tasks: Sequence[SimTask], devices: int, policy: str, bandwidth: float | None, prefetch: bool,
         record: bool, fast: bool) -> SimResult:
    if policy not in POLICIES and policy not in BASELINES:
        raise rule_error(f"`policy` in {list(POLICIES) + list(BASELINES)}", "pick one of those names", policy=policy)
    if bandwidth is not None and not 0 < bandwidth < math.inf:
        raise rule_error("`bandwidth` is None or a finite number > 0", "pass bytes per second, or None for free "
                         "copies", bandwidth=bandwidth)
    plans = _plans(tasks, devices)
    if policy == "lower_bound":
        return SimResult(policy, _bound(plans, devices), (sum(p.total for p in plans) / devices,) * devices, None)
    events: list[Event] | None = [] if record else None
    if policy == "model_parallel":
        makespan, busy = _model_parallel(plans, devices, events)
    elif policy == "task_parallel":
        makespan, busy = _task_parallel(plans, devices, bandwidth, prefetch, events)
    else:
        pool = make_pool(policy, [p.name for p in plans], fast)
        makespan, busy = _shard_parallel(plans, devices, pool, bandwidth, prefetch, events)
    trace = Trace([f"sim:{d}" for d in range(devices)], events) if events is not None else None
    return SimResult(policy, makespan, tuple(busy), trace)


READY, BLOCK, ASK = 0, 1, 2   # events: a task becomes ready, a device waits for one, a device asks for its next


def _shard_parallel(plans: list[_Plan], devices: int, pool: ListPool, bw: float | None, prefetch: bool,
                    events: list[Event] | None) -> tuple[float, list[float]]:
    devs = [_Dev() for _ in range(devices)]
    nxt, free_at, turns = [0] * len(plans), [0.0] * len(plans), [0] * len(plans)
    for p in plans:
        pool.push(p.tid, p.tid, None, p.rem[0], 0)
    seq, waiting, makespan = len(plans), Waiting(devices), 0.0
    heap: list[tuple[float, int, int, int]] = []   # (time, device, READY/BLOCK/ASK, task)

    def run(d: int, tid: int, at: float) -> None:   # task tid's next segment on device d, decided at ``at``
        nonlocal makespan
        s_last, end = _place(plans[tid], nxt[tid], devs[d], d, at, free_at[tid], bw, prefetch, events)
        nxt[tid], turns[tid], free_at[tid], makespan = nxt[tid] + 1, turns[tid] + 1, end, max(makespan, end)
        heapq.heappush(heap, (s_last if prefetch else end, d, ASK, tid))

    t = 0.0
    while True:
        asks = []
        while heap and heap[0][0] == t:   # everything that happens at t, in device order, before anyone chooses
            _, d, what, tid = heapq.heappop(heap)
            if what == READY:
                pool.push(tid, seq, d, plans[tid].rem[nxt[tid]], turns[tid])
                seq += 1
            elif what == BLOCK:
                waiting.add(d)
            else:
                asks.append((d, tid))
        while pool and waiting:   # blocked devices first; ``waiting`` then holds those that take after d
            d = waiting.pop_first()
            run(d, pool.take(d, waiting), t)
        for d, c in asks:         # then the running task competes for its device's next segment
            more = nxt[c] < len(plans[c].work)
            pick = pool.take(d, waiting, (c, seq, d, plans[c].rem[nxt[c]], turns[c]))
            if pick != c:
                run(d, pick, t)
                if more:
                    heapq.heappush(heap, (free_at[c], d, READY, c))
            elif more:
                run(d, c, free_at[c])   # its host work waits for the segment's end: no prefetch of its first unit
            else:
                heapq.heappush(heap, (free_at[c], d, BLOCK, c))
        if not heap:
            break
        t = heap[0][0]
    return makespan, [dv.busy for dv in devs]


def _task_parallel(plans: list[_Plan], devices: int, bw: float | None, prefetch: bool,
                   events: list[Event] | None) -> tuple[float, list[float]]:
    """Each task wholly on one device, in order, on the device that frees first (lowest index on ties)."""
    devs = [_Dev() for _ in range(devices)]
    heap = [(0.0, d) for d in range(devices)]
    for p in plans:
        _, d = heapq.heappop(heap)
        done = 0.0
        for s in range(len(p.work)):
            _, done = _place(p, s, devs[d], d, 0.0, done, bw, prefetch, events)
        heapq.heappush(heap, (done, d))
    return max(dv.free for dv in devs), [dv.busy for dv in devs]


def _model_parallel(plans: list[_Plan], devices: int, events: list[Event] | None) -> tuple[float, list[float]]:
    """One model at a time, shard s of K on device min(s*D//K, D-1); its shards stay resident there (no copies),
    so every unit runs right after the previous one: the makespan is the serial sum."""
    busy, t = [0.0] * devices, 0.0
    for p in plans:
        k = max(p.shards) + 1
        for s, (i0, i1) in enumerate(p.bounds):
            for i in range(i0, i1):
                d = min(p.shards[i] * devices // k, devices - 1)
                busy[d] += p.secs[i]
                if events is not None:
                    events.append(Event(d, p.name, p.shards[i], p.kinds[i], t, t + p.secs[i], 0, COMPUTE, s))
                t += p.secs[i]
    return t, busy
