"""``hydra_tune.prepare(model, optimizer)``: keep your own training loop, train on the shared runtime.

    model, optimizer = hydra_tune.prepare(model, optimizer)          # the only new line in the loop's script
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)     # the forward runs as units on the runtime's devices
        optimizer.zero_grad(); loss.backward(); optimizer.step()      # backward units; the user's own step

Modules, one idea each: model.py (the nn.Module proxy), optimizer.py (the user's optimizer, its step routed),
runner.py (a call: batch, submit, RNG hand-off, output, backward), driver.py (the user-driven chain the runtime
runs), access.py (the user's thread's step, zero_grad and reads where the state is: resident or lazy per shard),
lazy.py (the lazy per-shard step with the user's loop zeroing and reading between steps), guard.py (reads of weights
whose update is pending: applied first, or refused from another thread), streams.py (a stream of random numbers
per concurrent trial thread), bridge.py (the autograd Function joining the output to the user's graph),
refusals.py (what is refused).

Rules: fp32 on CPU the trained weights are bit-identical to the same loop without ``prepare`` (same seed: model
init, dropout and data order as there). One model object per prepare. The model's task is released when the model
is garbage collected, ``model.release()`` is called, or the Optuna trial / Tune trial it was prepared in ends
(pruned, stopped, failed or done).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn

from ..errors import rule_error
from ..training.build import check_dense_gradients, check_not_scripted
from .model import PreparedModel
from .optimizer import is_prepared, wrap_step
from .runner import Runner

__all__ = ["prepare", "PreparedModel"]


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any = None, *,
            seed: int | None = None, precision: str = "fp32", stages: Any = None, name: str | None = None,
            runtime: Any = None) -> tuple[Any, ...]:
    """``(model, optimizer)`` (and ``lr_scheduler`` when given) for the user's own loop on the shared runtime.

        model, optimizer = hydra_tune.prepare(model, optimizer)
        model, optimizer, sched = hydra_tune.prepare(model, optimizer, sched, seed=trial.number)

    ``seed``: the model's random draws (dropout) come from a stream of its own, seeded with it, instead of the
    user's thread's generator (for trials in threads of one process). ``precision``, ``stages``, ``name``: as in
    ``ModelTask``. ``runtime``: where it trains (else the Optuna study's / Tune trial's, else the default one).
    The task is submitted, measured and planned at the first call of the model.
    """
    if not isinstance(model, nn.Module) or isinstance(model, PreparedModel):
        raise rule_error("hydra_tune.prepare takes a torch.nn.Module not prepared yet", "pass your model itself "
                         "(prepare it once)", kind=TypeError, model=type(model).__name__)
    if not isinstance(optimizer, torch.optim.Optimizer) or is_prepared(optimizer):
        raise rule_error("hydra_tune.prepare takes a torch.optim.Optimizer not prepared yet", "pass the optimizer "
                         "built over the model's parameters", kind=TypeError, optimizer=type(optimizer).__name__)
    check_not_scripted(model)
    check_dense_gradients(model)
    mine = {id(p) for p in model.parameters()}
    foreign = sum(id(p) not in mine for g in optimizer.param_groups for p in g["params"])
    if foreign:
        raise rule_error("the optimizer steps only the model's parameters", "build it over model.parameters() "
                         "(or its parameter groups)", kind=ValueError, foreign_parameters=foreign)
    if any(t.device.type != "cpu" for t in list(model.parameters()) + list(model.buffers())):
        model.to("cpu")  # its master copy lives in host memory; the runtime moves its state to devices
    runner = Runner(model, optimizer, seed=seed, precision=precision, stages=stages, name=name, runtime=runtime)
    prepared = PreparedModel(model, runner)
    wrap_step(optimizer, runner.access)
    weakref.finalize(prepared, runner.driver.release, False).atexit = False
    return (prepared, optimizer) if lr_scheduler is None else (prepared, optimizer, lr_scheduler)
