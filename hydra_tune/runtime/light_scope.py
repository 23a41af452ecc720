"""A light run's scope on its worker's device: what a segment's opening and end would do around its units.

    scope = LightScope(worker, task)     # worker.py's _open_here, one per opening of a kept light task
    LightRun(device, keeps, RunHooks(scope.begin, scope.end))   # training/light_run.py calls them
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..training.light_run import Span
from .admitted import Admitted

if TYPE_CHECKING:
    from .worker import DeviceWorker


class LightScope:
    """A light run's scope on its worker's device (training/light_run.py ``RunHooks``): from its first unit on, the
    device's state cache runs the task (as ``_run_open`` for a segment) and this thread's copies count for it."""

    def __init__(self, worker: DeviceWorker, task: Admitted) -> None:
        self.worker, self.task = worker, task
        self.home: Any = None
        self.charged: Any = None

    def begin(self) -> None:
        device, state = self.worker.device, self.task.state
        self.home = state.home
        self.charged = device.copier.charged_to(self.home.counts)
        self.charged.__enter__()
        if device.states is not None:
            device.states.begin(self.home, state.plan.peak)

    def end(self, spans: list[Span]) -> None:
        try:
            states = self.worker.device.states
            if states is not None:
                states.end(self.home)
        finally:
            self.charged.__exit__(None, None, None)
        self.worker.ran_light(self.task, spans)
