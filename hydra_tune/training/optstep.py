"""The plain loop's optimizer step for one task, over the tensors wherever its state is.

    step = OptimizerStep(state)      # TrainingLoop makes one per task
    step()                           # every ``grad_accumulation`` minibatches: clip, step, schedule, zero_grad

Rules: the step runs in the task's host thread, over the device tensors when its whole state is resident (exactly
the user's GPU loop; on CUDA launched on the device's default stream, behind the units that made the gradients),
else in host memory; its state does not move meanwhile (``home.stepping()``). The lazy per-shard step (lazy.py)
instead, when the optimizer is on check_lazy's allowlist and its shards are per-shard entries not all on the
device (state_cache.py): here only ``PendingStep.begin()`` (hyper-parameters snapshotted, norms, found-inf,
``scaler.update()``) and the per-step LR scheduler, no ``zero_grad``; each shard's update runs just before its next
use, where its entry is (``StateHome.use``). An optimizer step that draws random
numbers (gradient noise) draws from the task's stream: the first step runs in the task's RNG mode and tells
whether later ones must; one that only starts drawing later draws from torch's global generator.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..device.dispatch import UnitMode
from ..device.seeding import seeding_to
from .lazy import LazySteps
from .step import check_lazy

if TYPE_CHECKING:
    from ..device.devices import Device
    from .state import TaskState


class OptimizerStep:
    """One task's step: ``__call__`` clips, steps the optimizer (through the GradScaler under fp16), steps a
    per-step LR scheduler, zeroes the gradients and counts the step."""

    def __init__(self, state: TaskState) -> None:
        self.state = state
        self._draws: bool | None = None  # whether the step draws random numbers (None: not known yet)
        verdict = check_lazy(state.optimizer, state.scaler, state.model)
        state.home.set_lazy(LazySteps(state.optimizer, state.scaler, state.task.grad_clip_norm,
                                      list(state.model.parameters()), verdict))

    def __call__(self) -> None:
        state = self.state
        home = state.home
        with home.lock:  # (re-entrant: ``stepping`` holds it again, so nothing moves between the two)
            if home.steps_lazily():
                state.measure_held_bytes()
                home.begin_lazy()  # before the scheduler: the snapshot keeps step t's hyper-parameters
                self._schedule()
                state.steps += 1
                return
            with home.stepping():
                self._whole(state)
        state.steps += 1

    @property
    def draws(self) -> bool | None:
        """Whether the step draws random numbers (None: no step ran yet)."""
        return self._draws

    def update_here(self, device: Device) -> None:
        """A light run's step (light_run.py): the whole update over the task's state on ``device``, where it is
        resident with nothing pending, by an optimizer that draws nothing; counted, with the state's accounting,
        when the run ends (``HomeSteps.resident_steps``)."""
        state = self.state
        with state.home.lock, device.step_scope():
            self._update()
        state.steps += 1
        state.home.settle()

    def _whole(self, state: TaskState) -> None:
        state.measure_held_bytes()  # in this thread, before the step changes the tensors it reads
        if self._draws is False:  # the first step drew no random numbers: no routing (full speed)
            self._update()
        else:  # a noisy optimizer's draws come from the task's stream, as the plain loop's from the global one
            with UnitMode(state.rng.cpu) as mode, seeding_to(state.rng):
                self._update()
            if self._draws is None:
                self._draws = bool(mode.seeded)

    def _update(self) -> None:
        state = self.state
        scaler, optimizer = state.scaler, state.optimizer
        if state.task.grad_clip_norm is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(state.model.parameters(), state.task.grad_clip_norm)
        if scaler is not None:
            scaler.step(optimizer)  # skipped when a gradient is inf/nan; then update() lowers the scale
            scaler.update()
        else:
            optimizer.step()
        self._schedule()
        optimizer.zero_grad()

    def _schedule(self) -> None:
        state = self.state
        if state.scheduler is not None and state.task.lr_scheduler_metric is None:
            state.scheduler.step()  # a metric-driven one (ReduceLROnPlateau) steps per epoch, after evaluation
