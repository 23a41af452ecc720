"""A kept light task's minibatches trained and stepped in its device's thread, one after another, no segment made.

    run = LightRun(device, keeps, hooks)                # runtime/worker.py, opening a kept task's next segment
    with state.inline(run): board.open_here(task, i)    # itself: the task's loop, advanced there, trains each next
    run.finish()                                        # minibatch with ``run.train`` while the rules below hold

Why: a small model's minibatch costs the runtime far more around its unit than in it (benchmarks/light_floor.py:
~450 us a unit against ~20 us for what a runtime must do: the task's stream, the guard, the batch copy, the loss
read). While the policy keeps a device on a task whose host work that device runs itself anyway (light host work,
worker.py ``_inline``), each minibatch made a segment and its unit, went back to the worker, the board and the
policy, took the general step (locks, lazy-step checks, the state home's accounting pass) and stood at a step
boundary. Here the loop runs the same unit and the same optimizer update directly, and what does not change from
one minibatch to the next is done once per run (``finish``): the state cache's begin and end, the accounting pass
over the task's tensors, the step counts, the trace's and the estimates' records.

Rules (otherwise the minibatch goes the general way, as a segment, from its start, as it always did):
- the unit is the light path's (direct.py: the task's only shard, resident on this device, no gradient yet), its
  whole step runs on this device with nothing pending (no lazy update), the optimizer draws no random numbers,
  no loss scaler, ``grad_accumulation`` 1, the task is not resuming and no checkpoint or snapshot waits;
- the policy keeps the device on the task now (not cancelled; its turn holds, or the policy asked at its end
  picks it again: ``keeps``), and the device would not measure this segment op by op (``Device.would_measure``);
- a unit that ran out of memory or drew from torch's global generator (device/quiet.py), or whose loss is not
  finite, leaves the minibatch as it found it (the task's stream, host buffers and Python state, no gradient) and
  the general path trains it (the worker's re-plan or rerun, the task's non-finite policy); any other error is the
  task's, as from a segment;
- the values are the general light path's: the same unit (``DirectPath.forward_loss_backward``) and the same
  update (``OptimizerStep.update_here``: clipping, step, per-step scheduler, ``zero_grad``);
- what a run defers: gradients are not counted as device memory between a backward and its step (the device's
  peak was measured on the segment's first run, whose allocations these repeat), the state's accounting pass and
  the step counts come at ``finish``;
- a minibatch trained here reaches its step boundary only when a checkpoint or snapshot waits there (a request
  that comes later waits for the next boundary, as one a few microseconds later would);
- when the policy gives the device to another task, the run declines with ``released`` set and the loop hands the
  task over (``Segment.handover``, loop.py ``_light``): the device the policy gives it next opens it itself and
  tries its minibatch in a run there, so the turn starts with no segment;
- a run lasts as long as the policy keeps picking the task (a lone trial: to its end), so what it deferred is done
  every ``REFRESH`` seconds too: the stats, the trace, the step counts and the estimates lag a run by no more.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..device.devices import Device
from ..device.quiet import UnroutedDraw
from . import host_rng
from .boundary import task_work
from .measure_class import measure_key
from .replan import is_oom
from .segments import segment_key

if TYPE_CHECKING:
    from .loop import TrainingLoop

# (unit kind, segment number, start, end, bytes copied, CPU seconds of the unit's thread in it)
Span = tuple[str, int, float, float, int, float]

# Seconds between a long run's catch-ups on what it deferred: as often as a policy turn (runtime/picker.py TURN)
# ended every run before a turn's end could give the run a new one.
REFRESH = 0.02


@dataclass(frozen=True)
class RunHooks:
    """What a run asks of its device's worker: ``begin()`` before its first unit (the state cache's begin, copies
    counted for the task from then on), ``end(spans)`` once it is over (the state cache's end; each unit into the
    trace, the unit times and the device's counts)."""

    begin: Callable[[], None]
    end: Callable[[list[Span]], None]


class LightRun:
    """One device opening's run of a kept light task's minibatches (see the module docstring)."""

    __slots__ = ("device", "_keeps", "_hooks", "_spans", "_steps", "_loop", "_began", "_last", "seconds", "released",
                 "_granted")

    def __init__(self, device: Device, keeps: Callable[[bool], bool], hooks: RunHooks, picked: bool = False) -> None:
        # ``keeps(granted)``: whether the policy keeps the device on the task (``granted``: it was picked just now;
        # ``picked``: so is the run's first ask, for a handed-over task)
        self.device, self._keeps, self._hooks, self._granted = device, keeps, hooks, picked
        self._spans: list[Span] = []
        self._steps = 0  # optimizer steps taken here, not yet counted in the task's state home
        self._loop: TrainingLoop | None = None  # set at the first minibatch trained here
        self._began = 0.0  # when the deferred records began (the first unit, or the last catch-up)
        # from the first unit's start to the last one's end: the minibatches trained here and the loop's work
        # between them are not the opening's host work (what it did before the first and after the last is: the
        # worker's INLINE_OPEN and the keep wait read it, and a run may now last many turns)
        self.seconds = 0.0
        self._last: float | None = None  # when the last unit here ended
        # the last ``train``/``evaluate`` declined only because the policy gave the device to another task: the
        # loop hands the task over (``Segment.handover``) rather than making the minibatch a segment
        self.released = False

    def train(self, loop: TrainingLoop, batch: Any, losses: list[float]) -> bool:
        """Train and step ``batch`` here (its loss to ``losses``); False: nothing was done, the general path trains
        it."""
        state, device = loop.state, self.device
        self.released = False
        if (state.task.grad_accumulation != 1 or state.scaler is not None or len(state.execs) != 1
                or state.resume is not None or state.requests_waiting()):
            return False
        ex, home = state.execs[0], state.home
        if (not ex.direct.applies(device) or home.step_device() is not device or home.has_pending()
                or not loop.steps_quietly() or not self._kept()):
            return False
        key = measure_key(state, segment_key(True, batch), device)
        return self._timed(key, lambda: self._train(loop, ex, key, batch, losses))

    def _kept(self) -> bool:
        """Whether the policy keeps the device on the task (else ``released``)."""
        granted, self._granted = self._granted, False
        self.released = not self._keeps(granted)
        return not self.released

    def _timed(self, key: Any, run: Callable[[], bool]) -> bool:
        """``run()`` unless the device would measure segment ``key`` op by op (the general path does), its time
        counted in ``seconds``."""
        if self.device.would_measure(key):
            return False
        t0 = time.perf_counter()
        try:
            return run()
        finally:
            t1 = time.perf_counter()
            self.seconds += t1 - (t0 if self._last is None else self._last)
            self._last = t1

    def _train(self, loop: TrainingLoop, ex: Any, key: Any, batch: Any, losses: list[float]) -> bool:
        state, device = loop.state, self.device
        loop.start_minibatch(batch)
        snap = host_rng.retry_point(state.rng)
        value = self._unit(loop, ex, key, "L", snap, lambda: ex.direct.forward_loss_backward(
            device, state.store, state.rng, state.task.loss, 1))
        if value is None:
            return False
        if not math.isfinite(value):  # the task's policy, on the general path: the same minibatch again
            self._undo(loop, ex, snap)
            return False
        losses.append(value)
        state.store.clear()  # (its gradients are in .grad already: nothing to land)
        loop.update_here(device)
        self._steps += 1
        return True

    def evaluate(self, loop: TrainingLoop, batch: Any, losses: list[float], measured: list[Any]) -> bool:
        """Run eval ``batch``'s unit here (its loss to ``losses``, its metrics to ``measured``) when the rules
        hold; False: nothing was done, the general path runs it."""
        state, device = loop.state, self.device
        self.released = False
        if len(state.execs) != 1 or state.requests_waiting():
            return False
        ex = state.execs[0]
        if not ex.direct.applies(device, train=False) or not self._kept():
            return False
        key = measure_key(state, segment_key(False, batch), device)

        def run() -> bool:
            loop.hold(batch)
            snap = host_rng.retry_point(state.rng)
            value = self._unit(loop, ex, key, "E", snap, lambda: ex.direct.evaluate(
                device, state.store, state.rng, state.task.loss, loop.measuring(measured)))
            if value is not None:
                losses.append(value)
            return value is not None
        return self._timed(key, run)

    def _unit(self, loop: TrainingLoop, ex: Any, key: Any, kind: str, snap: Any,
              run: Callable[[], float]) -> float | None:
        """The unit ``run`` as its segment would run it; None: it drew or ran out of memory, undone."""
        device = self.device
        if self._loop is not None and time.perf_counter() - self._began >= REFRESH:
            self.finish()  # a long run catches up on what it deferred, then goes on (module docstring)
        if self._loop is None:
            self._loop, self._began = loop, time.perf_counter()
            self._hooks.begin()
        device.measuring = device.measure(key, loop.state.task.name)  # False (would_measure said so): its quiet key
        moved, t0, cpu = device.copier.moved(), time.perf_counter(), time.thread_time()
        try:
            with task_work(loop.state.task.name):
                value = run()
        except Exception as exc:
            if not (isinstance(exc, UnroutedDraw) or is_oom(exc)):
                raise
            exc.__traceback__ = None  # its frames hold the unit's device tensors
            self._undo(loop, ex, snap, kind)  # (an L unit of the light path set its gradients back to None)
            return None
        self._spans.append((kind, loop.next_segment(), t0, time.perf_counter(), device.copier.moved() - moved,
                            time.thread_time() - cpu))
        return value

    @staticmethod
    def _undo(loop: TrainingLoop, ex: Any, snap: Any, kind: str = "L") -> None:
        if kind == "L":
            ex.direct.undo()
        host_rng.back_to(loop.state.rng, snap)
        loop.state.store.reset_attempt()

    def finish(self) -> None:
        """The run is over (its opening handed out a segment or ended): what it deferred, done once."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        spans, self._spans, steps, self._steps = self._spans, [], self._steps, 0
        try:
            loop.state.home.resident_steps(self.device, steps)
        finally:
            self._hooks.end(spans)
