"""A task's host-memory footprint, estimated before its weights exist: the model is built on the meta device.

    fp = estimate_footprint(task, budget=600 << 10)       # the planner's device budget, as the runtime plans it
    fp.total, fp.parts()                                  # {"params": ..., "grads": ..., "optimizer": ..., ...}
    fp = footprint_of_state(state)                        # from a built TaskState: its own plan's activations

What a training task holds in host memory at its peak (hydra_tune keeps every task's state there):

* params: its parameters and buffers (fp32 also under bf16/fp16 autocast).
* grads: one gradient per trainable parameter; twice with ``grad_accumulation > 1`` (a minibatch's pending
  contributions sit next to the accumulated ``.grad`` until they are added).
* optimizer: the optimizer's state, measured: the task's own optimizer factory builds it over the meta model and
  it steps once with meta gradients, which creates its lazily made state exactly (SGD with momentum, Adam, AdamW,
  Adagrad, RMSprop, Adamax, NAdam, RAdam, Adadelta, Rprop, ...). When that cannot run (fused kernels, a
  ``closure``, ``.item()`` on state: ASGD, Adafactor, LBFGS) the rule is two fp32 copies of the trainable
  parameters (Adam's state), which bounds the common optimizers; ``optimizer_measured`` says which.
* activations: one minibatch's host copies: the first shard's input, the input of every later shard and one
  incoming gradient, and the activations offloading forwards send to host memory. A built task's plan says
  which shards there are and which offload (``footprint_of_state``: exact for that plan). Before the build
  (``estimate_footprint``) it is an upper bound over the plans the runtime may pick, since those choices
  depend on unit times the meta device cannot measure: up to twice the fewest shards the budget needs, and,
  where the devices may offload (``keep``: devices whose ``releases_graphs`` is set), every stage but the last
  offloading.
* overhead: an allowance for what the task holds beyond its tensors (``allowance``), plus the largest trainable
  parameter once more (an optimizer step's per-parameter temporaries). The allowance has a structural part: a
  fixed part for the task's own records plus a part per module and per tensor of its model (the modules'
  objects, the runtime's per-module records; tests/test_peft_shared_memory.py checks it against what running
  tasks measurably allocate). A task whose model has frozen parameters (LoRA: its own tensors are few and
  small, the base's are pooled) is charged that; any other task at least ``TASK_OVERHEAD``, which also
  covers the allocator's slack around its many tensors of its own.

A task whose state stays on a device (training/resident.py) keeps its host tensors to write it back into: its
footprint is the same either way.

Not counted: the task's data (the datasets and loaders it reads); device memory (for CPU stand-in devices also
host memory, bounded by their budgets); the build's profile, which runs one stage at a time in host memory
(transient, at most the largest unit's peak, within the reservation of its gradients and optimizer state that
are not allocated yet); pinned staging buffers kept by the CUDA host allocator; and memory the C allocator keeps
after frees. The last can be large (glibc's per-thread arenas and its dynamic mmap threshold keep freed blocks);
with ``MALLOC_MMAP_THRESHOLD_=1048576`` freed blocks of a MiB or more go back to the system, and a process stays
within its tasks' footprints plus the device budgets (tests/test_admission.py checks that). Measured admission
(``host_memory=None``) sees such memory, since it samples the available memory.
"""
from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.nn.parameter import is_lazy

from ..device.dispatch import UnitMode
from ..policy.partition import Plan, StageCost, partition
from ..stages import extract_stages
from ..task import ModelTask
from . import host_rng
from .build import AUTOCAST_DTYPES, BUILD_LOCK
from .data import NO_BATCH, sample_batch
from .fingerprint import Keyer, Memo, Unkeyable
from .profile import measure_costs

if TYPE_CHECKING:
    from .state import TaskState

#: The least allowance of a task without frozen parameters (Python objects, allocator slack).
TASK_OVERHEAD = 4 << 20
#: Every task, whatever its model: its TaskState, loop, optimizer and handle objects, queues, frames.
TASK_BASE = 256 << 10
#: Per module of its model: the module's own objects (its dicts, attributes, hooks) and the runtime's records
#: for it (bound calls, captured Python state, dispatch entries, the shard's snapshot layout: ~50 bytes a module,
#: its holders and values being the as-built snapshot's, training/pystate_layout.py). Measured with tracemalloc in
#: a runtime (the README's "LoRA and frozen weights" has the figures): what a MiniLM LoRA trial (248 modules, 133
#: tensors) holds and a tiny LoRA BERT's peak (tests/test_peft_shared_memory.py), each under its allowance.
MODULE_BYTES = (3 << 10) + 160
#: Per parameter and buffer: the tensor objects and the records kept per tensor (versions, pool entries).
TENSOR_BYTES = 1 << 10


def allowance(model: nn.Module) -> int:
    """Host bytes ``model``'s task may hold beyond its tensors (see the module docstring), e.g.
    ``allowance(nn.Linear(4, 4).requires_grad_(False)) == TASK_BASE + MODULE_BYTES + 2 * TENSOR_BYTES``."""
    modules = sum(1 for _ in model.modules())
    params = list(model.parameters())
    structural = TASK_BASE + MODULE_BYTES * modules + TENSOR_BYTES * (len(params) + sum(1 for _ in model.buffers()))
    return structural if any(not p.requires_grad for p in params) else max(structural, TASK_OVERHEAD)


@dataclass(frozen=True)
class Footprint:
    """Host bytes one task may hold at its peak, by part (see the module docstring)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    overhead: int
    optimizer_measured: bool = True
    shared: int = 0   # frozen parameter bytes held in the runtime's pool (charged there once, not in ``total``)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.overhead

    def parts(self) -> dict[str, int]:
        """The parts in bytes, and their total."""
        out = {k: v for k, v in asdict(self).items() if k not in ("optimizer_measured", "shared")}
        if self.shared:
            out["shared"] = self.shared
        return dict(out, total=self.total)


class Unmeasurable(Exception):
    """The meta-device estimate could not run for this task (the runtime then builds the task to measure it)."""


def estimate_footprint(task: ModelTask, budget: int | None, bandwidth: float | None = None,
                       keep: bool = True) -> Footprint:
    """``task``'s footprint for a runtime whose planner budget is ``budget`` and whose devices may keep/offload
    activations (``keep``), from its model built on the meta device; raises Unmeasurable when that fails (the
    factory or the loss needs real tensors, the model does not fit the budget, the data is empty, ...)."""
    model = _meta_model(task)
    try:
        sample = sample_batch(task.train_data, task.seed, task.name)  # the user's data untouched (data.py)
        if sample is NO_BATCH:
            raise Unmeasurable("no batch")
        cut = extract_stages(model, task.stages)
        costs = measure_costs(cut, cut.meta_batch(sample), task.loss, task.seed, AUTOCAST_DTYPES[task.precision])
        fewest = len(partition(costs, budget, keep=False).shards)
        optimizer, measured = optimizer_state_bytes(task, model)
    except Unmeasurable:
        raise
    except Exception as exc:
        raise Unmeasurable(f"{type(exc).__name__}: {exc}") from exc
    params, grads, largest = _param_bytes(model, task.grad_accumulation)
    return Footprint(params, grads, optimizer, _activation_bound(costs, fewest, keep),
                     allowance(model) + largest, measured)


def state_footprint(task: ModelTask) -> Footprint:
    """``task``'s footprint without its activations (no forward runs: cheap), from its meta-device model;
    raises Unmeasurable when the model cannot be built there."""
    model = _meta_model(task)
    optimizer, measured = optimizer_state_bytes(task, model)
    params, grads, largest = _param_bytes(model, task.grad_accumulation)
    return Footprint(params, grads, optimizer, 0, allowance(model) + largest, measured)


def footprint_of_state(state: "TaskState", optimizer: tuple[int, bool] | None = None) -> Footprint:
    """The footprint of a task built for real (``TaskState.build``), with its plan's own shards and offloading;
    ``optimizer``: its state bytes and whether measured, when known already (else measured on a meta copy)."""
    task = state.task
    if optimizer is None:
        try:
            optimizer = optimizer_state_bytes(task, _meta_clone(state.model))
        except Exception:  # the model cannot be copied
            optimizer = _optimizer_rule(state.model), False
    params, grads, largest = _param_bytes(state.model, task.grad_accumulation)
    return Footprint(params, grads, optimizer[0], _activations_of_plan(state.plan),
                     allowance(state.model) + largest, optimizer[1])


def optimizer_state_bytes(task: ModelTask, meta_model: nn.Module) -> tuple[int, bool]:
    """Bytes of the state ``task.optimizer`` makes for ``meta_model`` at its first step, and True; or the
    two-copies rule and False when the optimizer cannot be built or stepped on the meta device. An optimizer equal
    to one measured before (class, hooks, every group's options, over a model of equal layout) is not stepped
    again: ``OPTIMIZER_BYTES`` remembers it."""
    try:
        with BUILD_LOCK:
            opt = task.optimizer(meta_model)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(type(opt).__name__)
        key = _optimizer_key(meta_model, opt)
        known = OPTIMIZER_BYTES.get(key) if key is not None else None
        if known is not None:
            return known, True
        for group in opt.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        opt.step()
        seen: dict[int, int] = {}
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    seen[id(v)] = v.numel() * v.element_size()
        if key is not None:
            OPTIMIZER_BYTES.put(key, sum(seen.values()))
        return sum(seen.values()), True
    except Exception:  # fused kernels, closures, .item() on meta state: the documented rule instead
        return _optimizer_rule(meta_model), False


OPTIMIZER_BYTES = Memo(64)  # optimizer key -> state bytes at the first step, for this process


def _optimizer_key(meta_model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    """The model's layout and the optimizer (class, every attribute: groups with their parameters' places, hooks),
    or None when something in them cannot be keyed exactly (fingerprint.py). For torch's own optimizers a number
    in a group counts only as zero or not (momentum 0 makes no buffer; no learning rate or beta changes what
    state is made), so trials that differ in such hyper-parameters share the measurement."""
    try:
        if type(opt) not in _SIZE_BY_ZERO:
            return Keyer().key(meta_model, opt)
        attrs = {k: v for k, v in vars(opt).items() if k not in ("param_groups", "defaults", "state")}
        groups = [{k: v if k == "params" else _zero_or_not(v) for k, v in g.items()} for g in opt.param_groups]
        return Keyer().key(meta_model, type(opt), attrs, groups, _zero_or_not(opt.defaults))
    except Unkeyable:
        return None


def _zero_or_not(v: Any) -> Any:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return "number", v == 0
    if isinstance(v, (tuple, list)):
        return type(v).__name__, [_zero_or_not(x) for x in v]
    if isinstance(v, dict):
        return {k: _zero_or_not(x) for k, x in v.items()}
    return v


# torch's optimizers whose state at the first step depends on the options only through which numbers are zero
_SIZE_BY_ZERO = frozenset((torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                           torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
                           torch.optim.Rprop, torch.optim.ASGD, torch.optim.Adadelta))


def _optimizer_rule(model: nn.Module) -> int:
    return 2 * sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)


def _param_bytes(model: nn.Module, grad_accumulation: int) -> tuple[int, int, int]:
    """(parameters + buffers, gradients, largest trainable parameter) in bytes; a shared parameter counts once.
    Only trainable parameters get an optimizer step's temporaries: a frozen embedding (LoRA) adds none."""
    params = list(model.parameters())
    sizes = [p.numel() * p.element_size() for p in params]
    state = sum(sizes) + sum(b.numel() * b.element_size() for b in model.buffers())
    trained = [n for p, n in zip(params, sizes) if p.requires_grad]
    return state, sum(trained) * (2 if grad_accumulation > 1 else 1), max(trained, default=0)


def _activation_bound(costs: Sequence[StageCost], fewest: int, keep: bool) -> int:
    """Upper bound of one minibatch's host activations over the plans the runtime may pick (module docstring)."""
    if fewest == 1:
        return costs[0].input_bytes  # one shard: only the batch's carry, nothing crosses a shard boundary
    shards = min(len(costs), 2 * fewest if keep else fewest)
    inputs = sorted((c.input_bytes for c in costs[1:]), reverse=True)
    out = costs[0].input_bytes + sum(inputs[:shards - 1]) + inputs[0]
    if keep:
        out += sum(c.saved_bytes for c in costs[:-1])
    return out


def _activations_of_plan(plan: Plan) -> int:
    shards = plan.shards
    later = [sh.input_bytes for sh in shards[1:]]
    offloaded = sum(sh.offload_bytes for sh in shards if plan.offloads(sh.index))
    return shards[0].input_bytes + sum(later) + max(later, default=0) + offloaded


def _meta_model(task: ModelTask) -> nn.Module:
    """The task's model on the meta device: its factory run under ``torch.device("meta")``, or a meta copy of a
    given module (or of what a factory built that ignores the default device; that model is dropped here)."""
    try:
        if isinstance(task.model, nn.Module):
            return _meta_clone(task.model)
        with BUILD_LOCK, torch.device("meta"), UnitMode(torch.Generator().manual_seed(task.seed)), \
                host_rng.replayed(task):
            model = task.model()
        if not isinstance(model, nn.Module) or not any(True for _ in model.parameters()):
            raise Unmeasurable(f"the factory returned {type(model).__name__} (no parameters)")
        if any(is_lazy(t) for t in itertools.chain(model.parameters(), model.buffers())):
            raise Unmeasurable("uninitialized lazy parameters")  # the real build refuses them with the rule
        if any(t.device.type != "meta" for t in itertools.chain(model.parameters(), model.buffers())):
            return _meta_clone(model)
        return model
    except Unmeasurable:
        raise
    except Exception as exc:
        raise Unmeasurable(f"{type(exc).__name__}: {exc}") from exc


def _meta_clone(model: nn.Module) -> nn.Module:
    """A structural copy of ``model`` whose parameters and buffers are meta tensors (nothing allocated for them;
    shared ones stay shared)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)
