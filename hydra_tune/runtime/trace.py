"""A timeline of every unit and copy the runtime ran: Chrome trace-event JSON and a Gantt chart.

    trace = runtime.trace()                          # Trace(events=[Event(device=0, task="a", kind="F", ...), ...])
    trace.save("trace.json")                         # open in https://ui.perfetto.dev or chrome://tracing
    hydra_tune.plot_timeline(trace, "timeline.png")  # one row per device, one colour per task (extra `plot`)

Times are seconds since the runtime started (``time.perf_counter`` based). Each device is one process track in
the viewer with two threads: its compute (units) and its copy engine (prefetches and copies in/out).
"""
from __future__ import annotations

import json
import os
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

COMPUTE, COPY = "compute", "copy"


@dataclass(frozen=True)
class Event:
    """One unit (kind F, L, B, E) or one copy (kind H2D: into the device, D2H: out of it) on one device."""

    device: int
    task: str
    shard: int
    kind: str
    start: float
    end: float
    bytes: int = 0
    lane: str = COMPUTE      # COMPUTE or COPY
    segment: int = -1        # the task's segment: units with one number ran back to back on one device (a
                             # minibatch's F..L..B, or one eval batch); -1 for copies not tied to one

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Trace:
    """Recorded events plus the device names; ``save`` writes Chrome trace-event JSON."""

    devices: list[str]
    events: list[Event] = field(default_factory=list)

    def units(self) -> list[Event]:
        return [e for e in self.events if e.lane == COMPUTE]

    def copies(self) -> list[Event]:
        return [e for e in self.events if e.lane == COPY]

    def tasks(self) -> list[str]:
        """Task names in order of first appearance."""
        return list(dict.fromkeys(e.task for e in self.events))

    def makespan(self) -> float:
        """Seconds from the first unit's start to the last unit's end (0.0 for an empty trace)."""
        units = self.units()
        return max(e.end for e in units) - min(e.start for e in units) if units else 0.0

    def busy(self) -> list[float]:
        """Compute-busy seconds per device."""
        out = [0.0] * len(self.devices)
        for e in self.units():
            out[e.device] += e.seconds
        return out

    def overlap(self) -> list[float]:
        """Per device: the share of its copy seconds during which it was also computing (1.0: copies hidden
        entirely behind units; 0.0 for a device without copies)."""
        out = []
        for d in range(len(self.devices)):
            units = sorted((e.start, e.end) for e in self.units() if e.device == d)
            copies = [e for e in self.copies() if e.device == d]
            total = sum(e.seconds for e in copies)
            hidden = sum(max(0.0, min(e.end, b) - max(e.start, a)) for e in copies for a, b in units
                         if a < e.end and b > e.start)  # units of one device never overlap each other
            out.append(hidden / total if total > 0 else 0.0)
        return out

    def to_chrome(self) -> dict[str, Any]:
        """The trace-event format's JSON object form: complete ("X") events plus track names."""
        meta: list[dict[str, Any]] = []
        for d, name in enumerate(self.devices):
            meta.append({"name": "process_name", "ph": "M", "pid": d, "tid": 0, "args": {"name": name}})
            meta.append({"name": "process_sort_index", "ph": "M", "pid": d, "tid": 0, "args": {"sort_index": d}})
            for tid, lane in enumerate((COMPUTE, COPY)):
                meta.append({"name": "thread_name", "ph": "M", "pid": d, "tid": tid, "args": {"name": lane}})
        events = [{
            "name": f"{e.task} {e.kind}{e.shard}", "cat": e.lane, "ph": "X", "pid": e.device,
            "tid": 0 if e.lane == COMPUTE else 1, "ts": round(e.start * 1e6, 3),
            "dur": round(max(e.seconds, 0.0) * 1e6, 3),
            "args": {"task": e.task, "shard": e.shard, "kind": e.kind, "bytes": e.bytes, "segment": e.segment,
                     "index": i, "start": e.start, "end": e.end},  # exact floats and order, for load()
        } for i, e in enumerate(self.events)]
        return {"traceEvents": meta + events, "displayTimeUnit": "ms",
                "otherData": {"producer": "hydra_tune", "devices": list(self.devices)}}

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as f:
            json.dump(self.to_chrome(), f)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Trace":
        """Read back a file written by ``save``."""
        with open(path) as f:
            data = json.load(f)
        xs = sorted((e for e in data["traceEvents"] if e.get("ph") == "X"), key=lambda e: e["args"].get("index", 0))
        events = [Event(device=e["pid"], task=e["args"]["task"], shard=e["args"]["shard"], kind=e["args"]["kind"],
                        start=e["args"].get("start", e["ts"] / 1e6),
                        end=e["args"].get("end", (e["ts"] + e["dur"]) / 1e6), bytes=e["args"]["bytes"],
                        lane=e["cat"], segment=e["args"]["segment"]) for e in xs]
        return cls(list(data["otherData"]["devices"]), events)

    def as_dicts(self) -> list[dict[str, Any]]:
        return [asdict(e) for e in self.events]


class Recorder:
    """Thread-safe event sink the runtime writes to; ``snapshot`` gives a Trace.

        rec = Recorder(["cpu:0"], time.perf_counter(), limit=200_000)
        rec.add(0, "a", 0, "F", t0, t1); rec.snapshot(); rec.counts()   # {"kept": 1, "dropped": 0, "limit": ...}

    Rule: it keeps the newest ``limit`` events (a runtime that runs for weeks must not grow without bound); older
    ones are dropped, and ``counts()["dropped"]`` says how many.
    """

    def __init__(self, devices: Sequence[str], origin: float, limit: int | None = None) -> None:
        self.devices = list(devices)
        self.origin = origin
        self._lock = threading.Lock()
        self._events: deque[Event] = deque(maxlen=limit)
        self._added = 0

    def add(self, device: int, task: str, shard: int, kind: str, start: float, end: float, nbytes: int = 0,
            lane: str = COMPUTE, segment: int = -1) -> None:
        e = Event(device, task, shard, kind, start - self.origin, end - self.origin, nbytes, lane, segment)
        with self._lock:
            self._events.append(e)
            self._added += 1

    def extend(self, events: Iterable[Event]) -> None:
        events = list(events)
        with self._lock:
            self._events.extend(events)
            self._added += len(events)

    def snapshot(self) -> Trace:
        with self._lock:
            return Trace(list(self.devices), list(self._events))

    def counts(self) -> dict[str, int | None]:
        """Events kept now, dropped so far (the oldest, past ``limit``), and the limit (None: unbounded)."""
        with self._lock:
            return {"kept": len(self._events), "dropped": self._added - len(self._events),
                    "limit": self._events.maxlen}
