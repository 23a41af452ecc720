"""Each concurrent trial thread its own stream of torch's CPU random numbers.

    with trial_stream(concurrent=True):   # the Optuna study's / Tune actor's trial thread, around the trial
        torch.manual_seed(7)              # seeds this thread's stream only
        model = Net()                     # its init, DataLoader(shuffle=True), dropout: all from that stream
        model, opt = hydra_tune.prepare(model, opt)   # the units' dropout too (runner.py reads current_generator)

Why: trials in threads of one process (Optuna ``n_jobs=2``, the Tune runtime actor) share torch's global
generator. A trial that calls ``torch.manual_seed(s)`` and draws without ``generator=`` (a ``DataLoader(
shuffle=True)``, ``nn.Linear``'s init, dropout) then reads a stream other trials' draws interleave with, so its
data order and dropout depend on timing. Inside ``trial_stream`` the thread's seeding calls seed a generator of its
own (device/seeding.py routes them) and its CPU random ops draw from it (a ``UnitMode``, as a task's units draw from
the task's stream): each trial equals its run alone in one thread, from the same seed.

Rules: ``concurrent=False`` (trials one at a time, ``n_jobs=1``) changes nothing: the trials draw from torch's
global generator, as the plain script's do. The stream starts from a seed drawn from torch's global generator
when the trial starts, so trials that never seed still differ from each other (as trials continuing one stream in
one thread do; which trial gets which seed follows the order they start in). CUDA random numbers drawn in the trial's
own thread (not in
hydra_tune's units, which draw from the task's stream) are not routed: they come from the device's generator. A
DataLoader worker (a child process: it starts with no dispatch mode) draws as PyTorch seeds it, from the loader's
base seed, which the trial's stream gave.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..device import seeding
from ..device.dispatch import UnitMode, draw_global_seed


@contextlib.contextmanager
def trial_stream(concurrent: bool = True) -> Iterator[torch.Generator | None]:
    """Inside, this thread draws from and seeds a generator of its own (when ``concurrent``); yields it."""
    if not concurrent:
        yield None
        return
    seed = draw_global_seed()  # under the lock: another trial's unit may be lending the global generator its state
    generator = torch.Generator().manual_seed(seed)  # a trial that never seeds: its own start, not a shared one
    with UnitMode(generator):      # also routes torch.manual_seed & co. to it (device/seeding.py)
        yield generator


def current_generator() -> torch.Generator:
    """The generator this thread's global draws come from: its trial stream's, else torch's global one."""
    target = seeding.current()
    return target.cpu if target is not None else torch.default_generator
