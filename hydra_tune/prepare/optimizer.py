"""The prepared optimizer: the user's own optimizer object, its ``step`` and ``zero_grad`` routed to where the
task's state is.

    model, optimizer = hydra_tune.prepare(model, optimizer)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)   # built on it: the real param_groups
    optimizer.step(); sched.step(); optimizer.zero_grad()

Why the same object and not a wrapper: LR schedulers, GradScaler and checkpoint code read and write its
``param_groups`` and ``state`` and check ``isinstance(opt, torch.optim.Optimizer)``. Only ``step``, ``zero_grad``,
``state_dict`` and ``load_state_dict`` are replaced (instance attributes, so a scheduler's own step wrapper still
wraps ours): a closure is
refused (refusals.py); the step runs where the task's state is (runner.py ``step``: over the device tensors when its
whole state is resident, else the lazy per-shard step's boundary, else in host memory), under the state's lock.

Rules: ``direct()`` marks the runtime's own calls of ``optimizer.step()`` (the lazy per-shard update applies each
shard's update through it): inside, the original step runs. ``unwrapped(optimizer)`` shows the optimizer as the user
built it (the lazy-step allowlist checks that its step is torch's own).
"""
from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch

from .refusals import refuse_closure

_MARK = "__hydra_tune_prepared__"
_OWN = "__hydra_tune_own_step__"  # the instance's step before prepare (None: torch's class step)
_local = threading.local()


class _Direct:
    """``direct()``'s block: one object for all (its state is the thread's depth), a class and not a generator as
    every prepared call enters several (a generator's block cost four Python calls each)."""

    __slots__ = ()

    def __enter__(self) -> None:
        _local.depth = getattr(_local, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _local.depth -= 1


_DIRECT = _Direct()


def direct() -> _Direct:
    """Inside (this thread), ``optimizer.step()`` / ``zero_grad()`` of a prepared optimizer are the original ones."""
    return _DIRECT


def is_direct() -> bool:
    """Whether this thread is inside ``direct()`` (the runtime's own calls, not the user's loop)."""
    return getattr(_local, "depth", 0) > 0


def wrap_step(optimizer: torch.optim.Optimizer, runner: Any) -> torch.optim.Optimizer:
    """``optimizer`` with its ``step`` refusing a closure and run by ``runner.step(inner)``, its ``zero_grad``
    by ``runner.zero_grad(inner, set_to_none)``, and its ``state_dict`` / ``load_state_dict`` after
    ``runner.to_host()`` (the state as of the last step, in host memory; the tensors ``state_dict`` hands out are
    ``runner.exported``)."""
    setattr(optimizer, _OWN, vars(optimizer).get("step"))
    inner = optimizer.step
    inner_zero = optimizer.zero_grad

    def step(self: Any, closure: Any = None) -> Any:
        if is_direct():
            return inner(closure)
        if closure is not None:
            raise refuse_closure()
        return runner.step(inner)

    def zero_grad(self: Any, set_to_none: bool = True) -> None:
        if is_direct():
            return inner_zero(set_to_none)
        return runner.zero_grad(inner_zero, set_to_none)

    inner_save, inner_load = optimizer.state_dict, optimizer.load_state_dict

    def state_dict(self: Any) -> dict[str, Any]:
        runner.to_host()  # its state as of the last step, in host memory (pending per-shard updates applied)
        out = inner_save()
        # torch's hands out the state's own tensors (its own per-parameter dicts): ours, new dicts of aliases of
        # them, so that the runtime sees whether the loop still holds them (held, the state stays in host memory
        # and they read it live, as torch's do: access.py); the step counters stay in host memory anyway
        out["state"] = {i: {k: v.detach() if isinstance(v, torch.Tensor) and k != "step" else v for k, v in st.items()}
                        for i, st in out["state"].items()}
        runner.exported(v for st in out["state"].values() for k, v in st.items() if k != "step")
        return out

    def load_state_dict(self: Any, state: dict[str, Any]) -> None:
        runner.to_host()  # loaded into host tensors; they move in again at the next call
        inner_load(state)
        runner.watch(optimizer)  # its state mapping was replaced: reads of it are checked again (guard.py)

    step.__doc__ = inner.__doc__
    zero_grad.__doc__ = inner_zero.__doc__
    if hasattr(inner, "_wrapped_by_lr_sched"):
        # a scheduler built before prepare wrapped the step (its marker and call flag): ours calls that wrapper,
        # so the scheduler's order check stays true; torch reads this marker by name
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    # bound methods, as LR schedulers expect of optimizer.step (they wrap its __func__)
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)  # type: ignore[method-assign]
    optimizer.state_dict = types.MethodType(state_dict, optimizer)  # type: ignore[method-assign]
    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)  # type: ignore[method-assign]
    setattr(optimizer, _MARK, True)
    return optimizer


@contextlib.contextmanager
def unwrapped(optimizer: torch.optim.Optimizer) -> Iterator[torch.optim.Optimizer]:
    """The optimizer with its step as before prepare, inside (the user's thread must not step meanwhile)."""
    now = vars(optimizer).get("step")
    own = getattr(optimizer, _OWN, None)
    if own is None:
        vars(optimizer).pop("step", None)
    else:
        optimizer.step = own  # type: ignore[method-assign]
    try:
        yield optimizer
    finally:
        if now is not None:
            optimizer.step = now  # type: ignore[method-assign]


def is_prepared(optimizer: Any) -> bool:
    return bool(getattr(optimizer, _MARK, False))
