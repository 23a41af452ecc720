"""A task's own random streams, carried from unit to unit whatever device runs it.

    rng = TaskRNG(seed=0)
    with UnitMode(rng.cpu), seeding_to(rng): model = make_model()   # init draws from the task's CPU generator, and
                                                                    # torch.manual_seed in it seeds the task's streams
    snap = rng.snapshot(); ...; rng.restore(snap)      # the state a recomputed forward replays
    with device.unit_scope(rng): ...                   # the device swaps its generator to the task's stream

Rules: the CPU generator starts as ``torch.manual_seed(seed)`` leaves the global one, so a task draws the numbers
the plain loop would. The accelerator state is None until a GPU first runs a unit of the task (it then seeds its
generator with ``seed``) and is saved back after every GPU unit, so the stream continues on whichever GPU runs next.
``torch.manual_seed(s)`` (or ``torch.cuda.manual_seed_all(s)``) called by the task's code outside a GPU unit
(device/seeding.py) leaves a pending seed there instead: the next GPU unit seeds its generator with ``s``, as the
plain loop's call seeds the GPU's. Snapshots and checkpoints carry it as they carry a state.
"""
from __future__ import annotations

from typing import Any

import torch

_WRAP = 1 << 64


class TaskRNG:
    """A task's own random streams: a CPU generator (init, data order, CPU dropout) and the accelerator state."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.cpu = torch.Generator().manual_seed(seed)
        # None: no GPU ran the task yet (seed with ``seed``); a 0-d int64 tensor: a pending seed; else a GPU state
        self.accel_state: torch.Tensor | None = None
        self.router: Any = None  # the RandomRouter its units reuse (dispatch.router_for)
        # its code draws from Python's or numpy's global generator (its profile saw it): a retried segment rewinds
        # them too (training/host_rng.py ``mark``)
        self.host_draws = False

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

    def seed_accel(self, seed: int) -> None:
        """The task's GPU stream starts over from ``seed`` (an unsigned 64-bit value) at its next GPU unit."""
        self.accel_state = torch.tensor(seed - _WRAP if seed >= _WRAP // 2 else seed, dtype=torch.int64)

    def start_accel(self, generator: torch.Generator) -> None:
        """Put the task's GPU stream into ``generator`` (a GPU's, before a unit of the task runs on it)."""
        state = self.accel_state
        if state is None:
            generator.manual_seed(self.seed)
        elif state.dtype == torch.int64 and state.dim() == 0:  # a pending seed (seed_accel)
            value = int(state)
            generator.manual_seed(value + _WRAP if value < 0 else value)
        else:
            generator.set_state(state)
