"""One prepared model's calls: the batch from ``model(...)``'s arguments, the first call's submit, the RNG hand-off,
the output (joined to the user's graph) and its backward.

    run = Runner(model, optimizer, options)      # prepare() makes one
    out = run.forward((x,), {})                  # model(x): F or E units; the output on x's device
    run.access.step(inner)                       # optimizer.step(): where the task's state is (access.py)

Rules (why in driver.py and bridge.py): ``model(x)`` (one positional argument: a tensor, a tuple or a dict, as a
ModelTask batch would be) or ``model(**batch)`` (keywords: the model is called with them); a forward with autograd
on runs F units and its output requires grad; under ``torch.no_grad()`` (or ``inference_mode``) E units, no
graph. The task is submitted at the first call (it is measured and planned on that batch: errors of that raise
there) to the runtime ``train`` would use: ``runtime=``, else the Optuna study's or Tune trial's (``bind``), else
the default one.
"""
from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..api import submit
from ..errors import rule_error
from ..task import ModelTask
from ..training.build import AUTOCAST_DTYPES
from .access import HELD, StateAccess
from .bridge import Bridge, token
from .driver import Driver, float_leaf
from .guard import PendingGuard
from .optimizer import direct
from .refusals import (HookCheck, MergeCheck, SlotCheck, check_autocast, check_backward, check_inputs, check_output,
                       check_unchanged, output_error)
from .streams import current_generator

_names = itertools.count(1)


def _profile_loss(out: Any, batch: Any) -> torch.Tensor:
    """The loss the plan is measured with (the user's own is computed in their loop): the output's float sum."""
    leaves = tree_flatten(out)[0]
    check_output(leaves)
    floats = [t for t in leaves if float_leaf(t)]
    if not floats:
        raise output_error(f"no floating-point tensor among {[type(t).__name__ for t in leaves][:4]}")
    return sum(t.float().sum() for t in floats)  # type: ignore[return-value]


class PreparedTask(ModelTask):
    """A ModelTask whose chain the user's calls drive (``drive_segments``: TaskState.segments makes no loop)."""

    def __init__(self, driver: Driver, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.drive_segments = driver.drive_segments
        self.retry_segment = driver.retry_segment
        self._driver = driver

    def attach_lender(self, lender: Any) -> None:
        """The board's lender of this task (runtime/lend.py): the user's calls may run their segments in place."""
        self._driver.lender = lender

    def __reduce__(self) -> Any:
        # a node's runtime server (another process) would get a copy of the model the user's loop never sees
        raise rule_error("a prepared model trains on a runtime in its own process", "use an in-process runtime: "
                         "hydra_tune.optuna_study(..., share='process'), hydra_tune.Runtime or the default one; "
                         "for a node-shared runtime use hydra_tune.ModelTask with hydra_tune.train",
                         kind=RuntimeError, task=self.name)


class Runner:
    """The calls of one prepared model (see the module docstring)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, seed: int | None, precision: str,
                 stages: Any, name: str | None, runtime: Any) -> None:
        self.model, self.optimizer = model, optimizer
        self.seed, self.precision, self.stages, self.runtime = seed, precision, stages, runtime
        self.name = name if name is not None else f"prepared-{next(_names)}"
        self.guard = PendingGuard(lambda: self.access.flush())
        self.driver = Driver(self.name, seed, self.guard)
        self.access = StateAccess(self.driver)
        self.guard.watch(optimizer)
        self.hooks = HookCheck(model)
        self.slots = SlotCheck(model)
        self.merges = MergeCheck(model)
        self._at_forward: tuple[list[bool], list[int]] = ([], [])
        # the model's modules and parameters, listed once (the planned ones): each training forward notes their
        # modes and in-place counters for its backward
        self._modules = list(model.modules())
        self._named = list(model.named_parameters())

    @property
    def handle(self) -> Any:
        return self.driver.handle

    def shared_frozen(self) -> dict[str, torch.Tensor]:
        """The model's parameters (by name) held once with other tasks' (training/shared_frozen.py); {} before
        the first call or with none."""
        state = self.driver.state
        if state is None or state.shares is None:
            return {}
        return {name: p for name, p, _, _ in state.shares.params}

    def _submit(self, batch: Any) -> None:
        model = self.model
        stepped = [p for g in self.optimizer.param_groups for p in g["params"]]
        if stepped and not any(p.requires_grad for p in stepped):  # what is trainable is planned at this call
            raise rule_error("a prepared model's first call sees the parameters its optimizer steps as trainable "
                             "(requires_grad=True): the task is planned then", "make the first call outside what "
                             "freezes them for a while (peft's `with model.disable_adapter():`), e.g. a training "
                             "forward first", kind=RuntimeError, optimizer_parameters=len(stepped), trainable=0)
        modes = [(m, m.training) for m in model.modules()]  # the build puts the model in train mode
        task = PreparedTask(self.driver, model, self._optimizer_for, [batch], loss=_profile_loss, epochs=None,
                            seed=self.seed or 0, name=self.name, stages=self.stages, precision=self.precision)
        try:
            self.driver.handle = submit(task, self.runtime, scoped=True)
        finally:
            for m, mode in modes:
                m.training = mode

    def _optimizer_for(self, model: nn.Module) -> torch.optim.Optimizer:
        """The task's optimizer factory: the user's optimizer for the user's model; for another model (the
        footprint's meta copy, which it steps to measure the state) a new one of its class and groups, so that
        nothing but the user's loop ever steps the user's optimizer."""
        opt = self.optimizer
        if model is self.model:
            return opt
        index = {id(p): i for i, p in enumerate(self.model.parameters())}
        theirs = list(model.parameters())
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [theirs[index[id(p)]] for p in g["params"]]} for g in opt.param_groups]
        return type(opt)(groups, **opt.defaults)

    # -- forward ---------------------------------------------------------------------------------------------
    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with direct():  # reads the parameters' hooks: not a read of their (maybe pending) values
            self.hooks.check()
        self.slots.check()
        self.merges.check()
        if self.access.newly_held():
            warnings.warn(f"hydra_tune: prepared model {self.name!r}: {HELD}; its steps run on the host CPU "
                          "meanwhile (slower). To keep a snapshot, copy it: {k: v.clone() for k, v in "
                          "model.state_dict().items()}; else drop the dict.", RuntimeWarning, stacklevel=3)
        check_autocast(self.precision, AUTOCAST_DTYPES.get(self.precision))
        batch = self._batch(args, kwargs)
        # most calls pass one tensor (model(x)): torch's general tree walk costs more than the rest of this
        lone = type(batch) is tuple and len(batch) == 1 and type(batch[0]) is torch.Tensor
        leaves = list(batch) if lone else tree_flatten(batch)[0]
        check_inputs(leaves)
        device = next((t.device for t in leaves if isinstance(t, torch.Tensor)), torch.device("cpu"))
        host = (batch[0].detach().cpu(),) if lone else \
            tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, batch)
        train = torch.is_grad_enabled()
        if self.driver.handle is None:
            self._submit(host)
        driver, got = self.driver, {}
        # the stream this thread's own draws come from: torch's global generator, or its trial stream (streams.py)
        stream = current_generator()
        given = None if self.seed is not None else stream.get_state()

        def make() -> Any:
            state = driver.state
            state.store.clear()  # an earlier training forward whose backward never came is dropped
            state.store.batch = host
            state.store.carries[0] = state.cut.prepare(host)
            if given is not None:  # the units draw what the user's thread would draw next
                state.rng.cpu.set_state(given)
            return driver.open_forward(train)

        def after() -> None:
            state = driver.state
            got["out"] = state.store.carries[len(state.execs)]
            if given is not None:
                got["rng"] = state.rng.cpu.get_state()
            if not train:
                state.store.clear()

        driver.pending = 0
        self._settle()
        try:
            driver.run(make, after)
        finally:
            self.slots.note_buffers()  # a forward may reassign its own buffers, as it does in the plain loop
        if "rng" in got:
            stream.set_state(got["rng"])
        out = got["out"]
        if train:
            driver.forwards += 1
            driver.pending = driver.forwards
            # what a recomputing B unit reads besides the saved input: the modules' modes and the weights
            self._at_forward = ([m.training for m in self._modules],
                                [p._version for _, p in self._named])  # torch's in-place counter
            out = self._join(out, driver.forwards)
        if type(out) is torch.Tensor:
            return out if out.device == device else out.to(device)
        return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) and t.device != device else t, out)

    def _batch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if kwargs and not args:
            return dict(kwargs)
        if len(args) == 1 and not kwargs:
            # as a one-item tuple: every stage family takes a tuple batch's first item as the model's input, so a
            # tuple or list input reaches the model whole, as model(x) passes it
            return (args[0],)
        raise rule_error("a prepared model is called as model(x) or model(**batch)", "pass one input (a tensor, "
                         "or a tuple whose first item the model takes) or keywords only, as a ModelTask batch",
                         kind=TypeError, positional=len(args), keywords=sorted(kwargs))

    def _join(self, out: Any, number: int) -> Any:
        """The output's float tensors through the bridge: they require grad, and their backward runs B units."""
        lone = type(out) is torch.Tensor
        leaves, spec = ([out], None) if lone else tree_flatten(out)
        if not lone:
            check_output(leaves)  # (tensors in an object it cannot see into would get no gradients)
        where = [i for i, t in enumerate(leaves) if float_leaf(t)]
        if not where:
            return out
        n = len(leaves)

        def backward_fn(grads: list[torch.Tensor | None]) -> None:
            self._backward(number, n, dict(zip(where, grads)))

        joined = Bridge.apply(backward_fn, token(), [leaves[i] for i in where])
        if lone:
            return joined[0]
        for i, t in zip(where, joined):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    # -- backward --------------------------------------------------------------------------------------------
    def _backward(self, number: int, n: int, grads: dict[int, torch.Tensor | None]) -> None:
        driver = self.driver
        check_backward(number, driver.pending, driver.forwards)
        driver.pending = 0
        modes, versions = self._at_forward
        with direct():  # the counters are read, not the values: no pending update to apply (guard.py)
            check_unchanged([name for (name, p), v in zip(self._named, versions) if p._version != v])
        now = [m.training for m in self._modules]
        changed = now != modes  # model.eval() between forward and backward: the backward is still the forward's
        if changed:  # (rare: nn.Module's __setattr__ per module cost about as much as the rest of this call)
            for m, mode in zip(self._modules, modes):
                m.training = mode
        out_grads = [None if grads.get(i) is None else grads[i].detach().cpu() for i in range(n)]

        def make() -> Any:
            return driver.open_backward(out_grads)

        def after() -> None:
            state = driver.state
            home = state.home
            # the gradients land in .grad, added as AccumulateGrad adds them; a backward made only them on the device:
            # they are counted now, the rest of the state at the next step as after a ModelTask's minibatch
            home.land_grads(state.store, step_follows=True)
            if home.cache is None:
                home.settle()
            else:  # the user's loop reads and clips them now, then steps: evictions wait for that (state_cache.py)
                home.settled.clear()

        self._settle()
        try:
            driver.run(make, after)
        finally:
            if changed:
                for m, mode in zip(self._modules, now):
                    m.training = mode

    def _settle(self) -> None:
        """The user's thread is inside a call (not reading its state): evictions need not wait for it."""
        state = self.driver.state
        if state is not None:
            state.home.settle()
