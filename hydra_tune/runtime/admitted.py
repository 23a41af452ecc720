"""One admitted task as the board (scheduler.py) holds it between its segments.

    task = Admitted(handle, state, order, footprint, open_next=board._open)   # made by Scheduler.admit
    task.segment        # its open segment (taken from its chain by its host thread), None while it runs
    task.stats()        # what Runtime.stats()["tasks"][name] reports

Rules: the fields under "Written under the board's lock" change only with ``Scheduler.cond`` held; ``let_go``
runs once, after the task ended and no thread advances its chain.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..training.footprint import Footprint
from ..training.segments import Segment
from ..training.state import TaskState
from .handle import TaskHandle
from .host import HostThread


class Admitted:
    """One admitted task between its segments: its handle, state, chain of segments, host thread and scheduling
    record. ``open_next(task)`` is what its host thread runs: open the task's next segment."""

    def __init__(self, handle: TaskHandle, state: TaskState, order: int, footprint: Footprint | None,
                 open_next: Callable[["Admitted"], None]) -> None:
        self.handle, self.state, self.order, self.footprint = handle, state, order, footprint
        self.name = handle.name  # (a handle's name never changes; read at every pick and segment)
        self.chain = state.segments(handle.emit)
        self.segment: Segment | None = None  # taken from the chain, not yet run
        self.last_device: int | None = None
        self.units = 0
        self.turns = 0
        # Written under the board's lock:
        self.opening = False        # its host thread is advancing the chain now
        self.kept_by: int | None = None  # the device waiting for the segment being opened (the policy kept it)
        self.left: float | None = None  # its estimated seconds left while it waits in the ready queue (Picker.estimate)
        self.set_aside: int | None = None  # the device that ran another instead of waiting for it (take_kept)
        self.turn: tuple[int, float] | None = None  # (device, until when) the policy's last pick of it holds
        self.since = 0              # the board's counter when it left a device (or was admitted): its queue place
        self.open_seconds = 0.0     # how long its last opening took
        self.record: tuple[Any, Any] | None = None  # (fields, its policy Ready record): reused while equal
        self.released = False       # ended, and on_end has run: what the chain holds goes next
        self.lent: int | None = None  # the device its caller's thread runs a segment on now (lend.py)
        self.lent_by: int | None = None  # that thread's ident
        self.lent_waiters = 0       # threads waiting for that segment's end (the device's worker, end())
        self.lent_segments = 0      # segments its caller's thread ran on a lent device
        self.inline_units = 0       # units a device ran in its own thread, no segment (light_run.py)
        self.follows = 0.0          # until when its next segment completes its last one (Segment.follows; 0: not)
        self.follow_waits = 0       # times a device stayed for that segment past its turn or other work (stats)
        self.lent_picks = 0         # lent segments out of its turn that the policy, asked then, gave it (stats)
        self.owes = False           # the policy gave its device to another while it stayed for such a segment
        self.host = HostThread(handle.name, lambda: open_next(self))

    def let_go(self) -> None:
        """Close the chain and clear the host buffers: only once the task ended and no thread advances it."""
        self.chain.close()
        self.state.store.clear()

    def stats(self) -> dict[str, Any]:
        """What ``Runtime.stats()`` reports for this task (read under the board's lock)."""
        st = self.state
        return {"state": self.handle.status, "shards": [list(ex.names) for ex in st.execs],
                "kept": [i for i in range(len(st.execs)) if st.plan.keeps(i)],
                "offloaded": [i for i in range(len(st.execs)) if st.plan.offloads(i)], "steps": st.steps,
                "samples_trained": st.samples_trained,
                "epoch": st.epoch, "units": self.units, "lent_segments": self.lent_segments,
                "follow_waits": self.follow_waits, "lent_picks": self.lent_picks,
                "light_units": sum(ex.direct.units for ex in st.execs),
                "inline_units": self.inline_units,
                "kept_backwards": sum(ex.kept_backwards for ex in st.execs),
                "loaded_backwards": sum(ex.loaded_backwards for ex in st.execs),
                "host_bytes": st.held_bytes, "replans": st.replans,
                "predicted_peak": st.plan.peak,
                "host_footprint": self.footprint.parts() if self.footprint is not None else None,
                "residency": st.home.stats()}
