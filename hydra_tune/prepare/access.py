"""The user's thread's access to a prepared model's state, wherever the runtime keeps it (training/resident.py).

    access = StateAccess(driver)          # runner.py makes one per prepared model
    access.step(inner)                    # optimizer.step(): resident step, lazy boundary, or host step
    access.zero_grad(inner, True)         # optimizer.zero_grad()
    access.flush()                        # model.parameters(): pending per-shard updates applied first
    access.to_host()                      # state_dict(), torch.save, deepcopy, .module: weights in host memory

Why: a prepared task keeps its state as a ModelTask does: a task whose state fits stays on its device (the model's
own Parameters point at device storage, their ``.grad`` and the optimizer state are there); a spilled task whose
optimizer is on the lazy allowlist keeps per-shard entries and steps each shard just before its next use. The user's
loop then runs its clipping and ``optimizer.step()`` over those tensors, exactly as its own GPU loop would.

Rules: the step and ``zero_grad`` hold the state's lock (no eviction overlaps them). When the step due is the lazy
one, ``optimizer.step()`` only begins it (hyper-parameters snapshotted before the user's ``scheduler.step()``);
``optimizer.zero_grad()`` (set_to_none) then holds the pending gradients in the pending step's keeping (``.grad``
reads None at once, lazy.py) and ``zero_grad(set_to_none=False)`` applies every update first, then zeroes in place.
Whatever reads the weights from the user side applies the pending updates first (``flush``: ``model.parameters()``
here, any other reference through guard.py); what hands them out of the
loop (``state_dict``, ``load_state_dict``, ``torch.save``, ``copy.deepcopy``, ``.module``) also writes the state
back to host memory (it moves in again at the next call: counted in the stats). Before the first call (no task yet)
everything is the user's model's own, in host memory.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .optimizer import direct


class StateAccess:
    """See the module docstring."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver

    def _home(self) -> Any:
        state = self.driver.state
        return None if state is None or self.driver.finished else state.home

    def step(self, inner: Callable[[], Any]) -> Any:
        state = self.driver.state
        home = self._home()
        if home is None:
            result = inner()
        else:
            with direct():
                result = self._step(state, home, inner)
        if state is not None:
            state.steps += 1
        return result

    @staticmethod
    def _step(state: Any, home: Any, inner: Callable[[], Any]) -> Any:
        # a weight shared frozen with other tasks, made trainable in the loop since: refused before it is written;
        # any other write into one is caught after the step (the pool restores it, the writer's step raises)
        state.check_still_frozen()
        with home.lock:
            if home.steps_lazily():
                state.measure_held_bytes()
                home.begin_lazy()  # before the user's scheduler.step(): step t's hyper-parameters
                home.settle()
                return None
        with home.stepping():  # over the device tensors when its whole state is resident, else in host memory
            state.measure_held_bytes()
            result = inner()
        home.settle()  # its step went first: evictions may go on (state_cache.py)
        state.check_frozen()
        return result

    def zero_grad(self, inner: Callable[[bool], Any], set_to_none: bool) -> None:
        home = self._home()
        if home is None:
            inner(set_to_none)
            return
        with direct(), home.lock:
            lazy = home.lazy
            if lazy is not None and lazy.pending_any():
                if set_to_none:  # the gradients the pending updates need wait in their keeping; .grad reads None
                    lazy.hold_grads()
                else:  # zeroed in place as in the plain loop: the updates read them first
                    home.flush()
            inner(set_to_none)

    def flush(self) -> None:
        home = self._home()
        if home is not None:
            with direct():
                home.flush()

    def watch(self, optimizer: Any) -> None:
        """Reads of ``optimizer.state`` apply pending updates first (guard.py; again after load_state_dict)."""
        self.driver.guard.watch(optimizer)

    def to_host(self) -> None:
        home = self._home()
        if home is not None:
            with direct(), home.lock:
                home.flush()
                home.release("the user's loop read its weights (state_dict, save, copy): back in host memory")
