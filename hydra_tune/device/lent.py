"""The torch state a device's units run in, for a thread that is not the device's worker.

    scope = plain_thread()          # None: this thread's state is not one units may run in
    if scope is not None:
        with scope: unit.run(device)

Why: a prepared model's own thread may run its segment on the device the scheduler kept on its task
(runtime/lend.py); a worker thread has grad mode on, no inference mode, no autocast and no torch modes of its own,
and the units are written for that. The prepared loop's thread may be inside ``torch.no_grad()`` (an evaluation
forward), inside autograd's backward (grad mode off there), or inside its trial stream (streams.py: a dispatch mode
whose draws would otherwise take the units' dropout from the trial's stream instead of the task's).

Rules: grad and inference mode are set as a worker's and the thread's dispatch modes are set aside for the scope
(put back after); a thread with autocast on or a torch-function mode of its own is refused (None): its units run
in the worker thread as before.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _disable_current_modes


_NULL = contextlib.nullcontext()


def plain_thread() -> contextlib.AbstractContextManager[None] | None:
    """A scope with a worker thread's torch state, or None when this thread's state cannot be set aside here."""
    if torch.is_autocast_enabled("cpu") or _get_current_function_mode_stack():
        return None
    inference, modes = torch.is_inference_mode_enabled(), torch._C._len_torch_dispatch_stack()
    if inference or modes:
        return _plain()
    # the common calls: a training forward (the thread is in a worker's state already: nothing to enter) and a
    # backward (autograd runs it with grad mode off: only that to set)
    return _NULL if torch.is_grad_enabled() else torch.enable_grad()


@contextlib.contextmanager
def _plain() -> Iterator[None]:
    with torch.inference_mode(False), torch.enable_grad(), _disable_current_modes():
        yield
