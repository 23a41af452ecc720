"""The training loop's data (loop.py): each epoch's pass over its batches in the task's RNG stream, and where a
resumed epoch starts.

    for batch in loop._batches(state.train_iterable, "train_data"): ...   # TrainingLoop's epochs
    losses, skip, skipped = loop._resume_epoch()

Mixed into TrainingLoop, whose attributes it uses (``state``, ``_samplers``, ``_data_due``, ``_data_rng``,
``_data_py``); only the loop's thread calls it.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..device.dispatch import UnitMode
from ..device.seeding import seeding_to
from . import host_rng
from .boundary import task_work
from .checkpoint import put_entries
from .data import data_generators, epoch_data, restore_generators, set_epoch

if TYPE_CHECKING:
    from .state import TaskState

_END = object()
_PLAIN_ITERATORS = (type(iter([])), type(iter(())))


class LoopData:
    """Mixed into TrainingLoop (see the module docstring)."""

    state: TaskState
    _samplers: Any
    _data_due: tuple[Any, Any] | None
    _data_rng: list[Any]
    _data_py: list[Any] | None

    def _resume_epoch(self) -> tuple[list[float], int, int]:
        """The epoch's losses so far, the batches to step over and the minibatches skipped so far: a resumed task's
        first epoch repeats its data order from the epoch-start RNG state; at an epoch-start position it
        continues from the checkpoint now."""
        resume = self.state.resume
        if resume is None:
            return [], 0, 0
        self.state.rng.cpu.set_state(resume.epoch_rng)
        self._data_due = (resume.data_rng, resume.data_python)  # put into the data when the epoch makes it
        if resume.batch_in_epoch == 0:  # nothing to step over
            self._resume_rng()
        return list(resume.losses), resume.batch_in_epoch, resume.skipped

    def _resume_rng(self) -> None:
        """Continue from the checkpoint's RNG state: the resume is done."""
        resume, self.state.resume = self.state.resume, None
        if resume is not None:
            self.state.rng.restore((resume.rng, resume.accel_rng))
            host_rng.rewind(resume.host_rng)

    def _batches(self, data: Any, what: str) -> Iterator[Any]:
        # Data loading draws random numbers on the host (a data factory, shuffling, workers' base seed): it runs in
        # the task's RNG mode; so does the optimizer step if its first one drew any (_step); the rest of the host
        # work runs at full speed outside it. DataLoader workers forked here leave that mode (device/dispatch.py):
        # PyTorch seeds them.
        rng, name = self.state.rng, self.state.task.name
        with UnitMode(rng.cpu), seeding_to(rng), task_work(name):  # a factory's torch.manual_seed: the task's
            made = epoch_data(data, what, name)  # a factory is called here: once per pass
            if what == "train_data":
                self._start_epoch_data(made)
            it = iter(made)
        plain = type(it) in _PLAIN_ITERATORS  # a list's or tuple's next() runs no code: nothing to route
        while True:
            if plain:
                batch = next(it, _END)
            else:
                with UnitMode(rng.cpu), seeding_to(rng), task_work(name):
                    batch = next(it, _END)
            if batch is _END:
                return
            yield batch

    def _start_epoch_data(self, made: Any) -> None:
        """At an epoch's start: a resumed epoch's data gets its checkpointed generator states and sampler Python
        state back; both are kept for this epoch's checkpoints; then samplers with ``set_epoch`` are given it (0
        for the first: the plain loop's idiom)."""
        due, self._data_due = self._data_due, None
        if due is not None:
            restore_generators(made, due[0], self.state.task.name)
            if self._samplers is not None:
                put_entries(self._samplers, due[1] or [], self.state.task.name, "train_data")
        self._data_rng = [g.get_state() for g in data_generators(made)]
        self._data_py = None if self._samplers is None else self._samplers.changes(frozen=True)
        set_epoch(made, self.state.epoch - 1)
