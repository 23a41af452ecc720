"""A task's own random streams, carried from unit to unit whatever device runs it.

    rng = TaskRNG(seed=0)
    with UnitMode(rng.cpu): model = make_model()      # init draws from the task's CPU generator (device/dispatch.py)
    snap = rng.snapshot(); ...; rng.restore(snap)      # the state a recomputed forward replays
    with device.unit_scope(rng): ...                   # the device swaps its generator to the task's stream

Rules: the CPU generator starts as ``torch.manual_seed(seed)`` leaves the global one, so a task draws the numbers
the plain loop would. The accelerator state is None until a GPU first runs a unit of the task (it then seeds its
generator with ``seed``) and is saved back after every GPU unit, so the stream continues on whichever GPU runs next.
"""
from __future__ import annotations

import torch


class TaskRNG:
    """A task's own random streams: a CPU generator (init, data order, CPU dropout) and the accelerator state."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.cpu = torch.Generator().manual_seed(seed)
        self.accel_state: torch.Tensor | None = None

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.cpu.get_state(), self.accel_state

    def restore(self, snap: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        self.cpu.set_state(snap[0])
        self.accel_state = snap[1]

    def fork(self) -> "TaskRNG":
        """A copy of the current state that advances independently (for replaying a forward pass)."""
        other = TaskRNG(self.seed)
        other.restore(self.snapshot())
        return other
