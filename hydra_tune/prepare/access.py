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
back to host memory (it moves in again at the next call: counted in the stats). The tensors ``state_dict()`` returns
alias those host weights (the optimizer's are its state tensors), as torch's are the live ones: while the loop holds
one (``best = model.state_dict()``) the state stays in host memory (``held``; the next forward warns once), so that
it keeps reading the weights as they train, as in the plain loop. Before the first call (no task yet) everything is
the user's model's own, in host memory.
"""
from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

from .optimizer import direct


HELD = ("the loop holds tensors of model.state_dict() or optimizer.state_dict(), which are the state in host memory "
        "(as torch's are the live state): it stays there while they exist")
UNREACHED = ("optimizer.step() follows a forward with autograd on whose output had no backward through the model: "
             "loss.backward(inputs=...) and torch.autograd.grad(...) do not reach a prepared model's parameters (their "
             "gradients stay as they were; use loss.backward()). Run a forward you do not backpropagate (evaluation, "
             "logging) under torch.no_grad()")


class StateAccess:
    """See the module docstring."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver
        self._exported: list[weakref.ref] = []  # state_dict() values handed out: aliases of the host tensors
        self._told = False  # the loop was warned that it holds them (once per model)
        self._told_unreached = False  # ... that it stepped after a training forward with no backward (once)
        driver.host_hold = self.held

    def exported(self, tensors: Iterable[Any]) -> None:
        """A ``state_dict()`` handed these out (aliases of the host weights, the optimizer's state tensors): while
        one of them lives, the state stays in host memory, so that it reads the live state as in the plain loop."""
        refs = [weakref.ref(t) for t in tensors if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter)]
        if refs:
            self._exported = [r for r in self._exported if r() is not None] + refs

    def held(self) -> str | None:
        """Why the state must stay in host memory now (``HELD``), or None (asked at every segment: state_cache)."""
        if not self._exported:
            return None
        if any(r() is not None for r in self._exported):
            return HELD
        self._exported = []
        return None

    def newly_held(self) -> bool:
        """Whether the loop holds such tensors and has not been told yet (then it is, from now on)."""
        if self._told or self.held() is None:
            return False
        self._told = True
        return True

    def _home(self) -> Any:
        state = self.driver.state
        return None if state is None or self.driver.finished else state.home

    def step(self, inner: Callable[[], Any]) -> Any:
        if self.driver.pending and not self._told_unreached:
            # the bridge's backward never ran for the latest training forward: either none was meant, or one the
            # bridge cannot see (``inputs=`` restricts autograd to the paths reaching those tensors, and the
            # model's parameters are not on the user's graph): the plain loop's step would use those gradients
            self._told_unreached = True
            warnings.warn(f"hydra_tune: prepared model {self.driver.name!r}: {UNREACHED}", RuntimeWarning,
                          stacklevel=3)
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
        # a weight shared frozen with other tasks, made trainable in the loop since: the task's own before it is
        # written; any other write into one is caught after the step (the pool restores it, the writer's step raises)
        state.own_thawed()
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
