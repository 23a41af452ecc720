"""One admitted task: its built state and its training loop as a chain of units (the schedule as data).

    state = TaskState.build(task, budget=devices[0].budget)     # model, optimizer, stages, plan
    for segment in state.units(emit=print):                      # Segment: F0 F1 L2 B1 B0
        for unit in segment.units: unit.run(device)              # one device per segment, units in order

The generator does the host-side work between segments in the same order as the plain loop it replaces: fetch a
batch, run F0..F(K-2), L(K-1), B(K-2)..B0 (one segment), add the minibatch's gradients, and every
``grad_accumulation`` batches clip, step the optimizer and the LR scheduler, and zero the gradients. Epoch
metrics go to ``emit``.
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from ..device.devices import Device
from ..device.dispatch import UnitMode
from ..device.rng import TaskRNG
from ..errors import HydraError, NonFiniteLoss, PlanError, rule_error
from ..policy.partition import Plan, partition
from ..stages import ModelStages, extract_stages
from ..task import ModelTask, check_batch, check_model, check_optimizer
from .checkpoint import CheckpointRequest, Position, capture, load, restore, save
from .profile import measure_costs
from .shard import ShardExec
from .store import HostStore


@dataclass(frozen=True)
class Unit:
    """One schedulable piece of work: kind F (forward), L (last shard fwd+loss+bwd), B (recompute+bwd),
    E (eval forward; on the last shard also the loss). ``prefetch`` prepares its shard on a device ahead of it."""

    task: str
    kind: str
    shard: int
    segment: int
    run: Callable[[Device], None] = field(repr=False, compare=False)
    prefetch: Callable[[Device], int] = field(repr=False, compare=False)  # returns the bytes it copied

    def __str__(self) -> str:
        return f"{self.kind}{self.shard}"


@dataclass(frozen=True)
class Segment:
    """Units that run back to back on one device: a training minibatch (F.. L B..) or one eval batch."""

    task: str
    index: int
    units: tuple[Unit, ...]
    train: bool
    key: Any = None  # (train, input shapes): segments with equal keys allocate alike

    def __str__(self) -> str:
        return " ".join(str(u) for u in self.units)


# Factories run one at a time per process: trials submit from many threads (Tune's runtime actor, Optuna's
# n_jobs), and lazy-import machinery such as transformers' is not thread-safe on first import.
_BUILD_LOCK = threading.RLock()


def _build(factory: Any, what: str, *args: Any) -> Any:
    """Call a user factory; its error keeps its type and gains which factory raised it."""
    try:
        with _BUILD_LOCK:
            return factory(*args)
    except Exception as exc:
        message = f"building the task's {what} failed: {type(exc).__name__}: {exc}"
        try:
            wrapped = type(exc)(message)
        except Exception:  # an exception type with a different constructor
            wrapped = HydraError(message)
        raise wrapped from exc


def _batch_size(batch: Any) -> int:
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 1


class TaskState:
    """Everything the runtime holds for one task. Build with ``TaskState.build`` (in the submitting thread)."""

    def __init__(self, task: ModelTask, model: nn.Module, optimizer: Any, scheduler: Any, train_iterable: Any,
                 eval_iterable: Any, cut: ModelStages, plan: Plan, rng: TaskRNG) -> None:
        self.task, self.model, self.optimizer, self.scheduler = task, model, optimizer, scheduler
        self.train_iterable, self.eval_iterable = train_iterable, eval_iterable
        self.cut, self.plan, self.rng = cut, plan, rng
        self.autocast = _DTYPES[task.precision]
        self.execs = [ShardExec(s.index, cut.stages[s.start:s.stop], self.autocast) for s in plan.shards]
        # fp16: dynamic loss scaling by torch's own GradScaler over the host gradients (the optimizer is there)
        self.scaler = torch.amp.GradScaler("cpu") if task.precision == "fp16" else None
        self.store = HostStore()
        self.steps = 0
        self.epoch = 0
        self.segments = 0
        self.batch_in_epoch = 0
        self.eval_in_epoch = 0
        self.train_batches: int | None = None  # counted in the first epoch (for data without a length)
        self.eval_batches: int | None = None
        self.resume: Position | None = None  # where a resumed task continues (checkpoint.restore)
        self.costs: Any = None
        self.replans = 0
        self._attempt: _Attempt | None = None  # how to start the current segment over (retry)
        self.skipping = False  # the minibatch in flight had a non-finite loss under nonfinite_loss="skip_step"
        self.held_bytes = 0    # host_bytes() at its first two steps (then steady): what other threads may read
        self._measured_steps = 0
        self._lock = threading.Lock()
        self._requests: list[CheckpointRequest] = []
        self._ended: str | None = None  # why the task trains no more: later checkpoint requests fail at once

    @classmethod
    def build(cls, task: ModelTask, budget: int | None, bandwidth: float | None = None,
              keep: bool = True) -> "TaskState":
        rng = TaskRNG(task.seed)
        with UnitMode(rng.cpu):  # init and data order draw from the task's stream, as after manual_seed(seed)
            model = task.model if isinstance(task.model, nn.Module) else _build(task.model, "model")
            check_model(task, model)
            model.train()
            optimizer = _build(task.optimizer, "optimizer (`optimizer(model)`)", model)
            check_optimizer(task, model, optimizer)
            scheduler = None if task.lr_scheduler is None else _build(task.lr_scheduler, "lr_scheduler", optimizer)
            train_iterable = _iterable(task.train_data)
            eval_iterable = None if task.eval_data is None else _iterable(task.eval_data)
        cut = extract_stages(model, task.stages)
        with UnitMode(torch.Generator().manual_seed(task.seed)):  # a scratch stream: the task's stays untouched
            sample = next(iter(train_iterable), None)
        if sample is None:
            raise rule_error("`train_data` yields at least one batch", "check the dataset's length and the "
                             "DataLoader's batch_size and drop_last", task=task.name, batches=0)
        check_batch(sample, task.name, "train_data", 1)
        costs = measure_costs(cut, sample, task.loss, task.seed, _DTYPES[task.precision])
        try:
            plan = partition(costs, budget, bandwidth=bandwidth, keep=keep)
        except PlanError as exc:
            if cut.family != "whole":
                raise
            raise PlanError(_uncut_message(model, exc)) from None
        state = cls(task, model, optimizer, scheduler, train_iterable, eval_iterable, cut, plan, rng)
        state.costs = costs  # what a re-plan after a device out-of-memory starts from (hydra_tune/oom.py)
        state.held_bytes = state.host_bytes()
        if task.resume_from is not None:
            state.resume = restore(state, load(task.resume_from), keep_hparams=task.resume_hparams == "task")
            state.steps = state.resume.steps
        return state

    # -- the loop -------------------------------------------------------------------------------------------
    def units(self, emit: Callable[[dict[str, Any]], None]) -> Iterator[Segment]:
        """The task's training as segments of units; host work (step, data) runs while advancing."""
        task, k, rng, resume = self.task, self.task.grad_accumulation, self.rng, self.resume
        start = time.perf_counter()
        samples = resume.samples if resume else 0
        for epoch in range(resume.epoch if resume else 1, task.epochs + 1):
            self.epoch = epoch
            self.batch_in_epoch = self.eval_in_epoch = 0
            losses: list[float] = []
            skip = 0
            if resume is not None:  # repeat the epoch's data order, step over what was trained, continue
                rng.cpu.set_state(resume.epoch_rng)
                losses, skip = list(resume.losses), resume.batch_in_epoch
                if skip == 0:  # an epoch-start position: nothing to step over, continue from its state now
                    rng.restore((resume.rng, resume.accel_rng))
                    resume = self.resume = None
            epoch_rng = rng.cpu.get_state()
            pending = skipped = 0
            for batch in self._batches(self.train_iterable):
                self.batch_in_epoch += 1  # counted when handed out: remaining() is what is not yet handed out
                if self.batch_in_epoch <= skip:
                    if self.batch_in_epoch == skip:  # the next fetch and all after draw as they did originally
                        rng.restore((resume.rng, resume.accel_rng))  # type: ignore[union-attr]
                        resume = self.resume = None
                    continue
                yield self._train_segment(batch, losses)
                if self.skipping:  # nonfinite_loss="skip_step": as `optimizer.zero_grad(); continue`
                    self.skipping = False
                    self.store.clear()
                    self.optimizer.zero_grad()
                    pending, skipped = 0, skipped + 1
                    continue
                self.store.flush_grads()
                self.store.clear()
                samples += _batch_size(batch)
                pending += 1
                if pending == k:
                    self._step()
                    pending = 0
                    self._serve_checkpoints(Position(epoch, self.batch_in_epoch, self.steps, samples, list(losses),
                                                     epoch_rng, *rng.snapshot()))
                    if task.max_steps is not None and self.steps >= task.max_steps:
                        break
            self.train_batches = self.batch_in_epoch if epoch == 1 else self.train_batches
            if pending:
                self._step()
            metrics: dict[str, Any] = {
                "epoch": epoch, "train_loss": sum(losses) / len(losses) if losses else math.nan,
                "steps": self.steps, "samples": samples, "lr": self.optimizer.param_groups[0]["lr"]}
            if task.nonfinite_loss == "skip_step":
                metrics["skipped_batches"] = skipped
            if self.scaler is not None:
                metrics["loss_scale"] = self.scaler.get_scale()
            if self.eval_iterable is not None:
                metrics["eval_loss"] = yield from self._evaluate()
            metrics["seconds"] = time.perf_counter() - start
            emit(metrics)
            if task.max_steps is not None and self.steps >= task.max_steps:
                break
            snap = rng.snapshot()
            self._serve_checkpoints(Position(epoch + 1, 0, self.steps, samples, [], snap[0], *snap))
        self.abandon_checkpoints("finished")

    def request_checkpoint(self, path: str) -> "CheckpointRequest":
        """Ask for a checkpoint at the task's next step boundary (or epoch end); wait on the returned request."""
        req = CheckpointRequest(path)
        with self._lock:
            ended = self._ended
            if ended is None:
                self._requests.append(req)
        if ended is not None:  # asked after the last chance to serve it: no step boundary will come
            req.finish(None, RuntimeError(f"task {self.task.name!r} {ended} before a checkpoint could be taken"))
        return req

    def abandon_checkpoints(self, why: str) -> None:
        """Fail the checkpoint requests still waiting, and any asked from now on (the task trains no more)."""
        with self._lock:
            requests, self._requests = self._requests, []
            self._ended = self._ended or why
        for req in requests:
            req.finish(None, RuntimeError(f"task {self.task.name!r} {why} before a checkpoint could be taken"))

    def _serve_checkpoints(self, position: Position) -> None:
        with self._lock:
            requests, self._requests = self._requests, []
        for req in requests:
            try:
                req.finish(save(capture(self, position), req.path), None)
            except BaseException as exc:  # a failed write fails the request, not the task
                req.finish(None, exc)

    def _batches(self, iterable: Any) -> Iterator[Any]:
        # Only data loading draws random numbers on the host (shuffling, workers' seeds): it alone runs in the
        # task's RNG mode; the optimizer step and the rest of the host work run at full speed outside it.
        with UnitMode(self.rng.cpu):
            it = iter(iterable)
        while True:
            with UnitMode(self.rng.cpu):
                batch = next(it, _END)
            if batch is _END:
                return
            yield batch

    def _segment(self, units: list[tuple[str, ShardExec, Callable[[Device], Any], Callable[[Device], int]]],
                 train: bool) -> Segment:
        self.segments += 1
        shapes = tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                       for t in tree_flatten(self.store.batch)[0])
        return Segment(self.task.name, self.segments, tuple(
            Unit(self.task.name, kind, ex.index, self.segments, run, pre) for kind, ex, run, pre in units), train,
            (train, shapes))

    def retry(self, plan: Plan) -> Segment:
        """Start the segment in flight over with ``plan`` (after a device out-of-memory): the task's RNG, the
        epoch's losses and the host buffers go back to where the segment began; the same batch runs again."""
        attempt = self._attempt
        if attempt is None:
            raise RuntimeError(f"task {self.task.name!r} has no segment in flight to retry")
        self.rng.restore(attempt.rng)
        del attempt.losses[attempt.n_losses:]
        self.skipping = False
        self.store.reset_attempt()
        self.plan = plan
        self.execs = [ShardExec(s.index, self.cut.stages[s.start:s.stop], self.autocast) for s in plan.shards]
        self.replans += 1
        return attempt.rebuild()

    def _begin(self, batch: Any, losses: list[float], rebuild: Callable[[], Segment]) -> Segment:
        self.store.batch = batch
        self.store.carries[0] = self.cut.prepare(batch)
        self._attempt = _Attempt(self.rng.snapshot(), losses, len(losses), rebuild)
        return rebuild()

    def _train_segment(self, batch: Any, losses: list[float]) -> Segment:
        check_batch(batch, self.task.name, "train_data", self.batch_in_epoch)
        if self.scaler is not None:  # scale() also initialises the scaler's state, as in the plain loop
            self.store.loss_scale = self.scaler.scale(torch.ones((), dtype=torch.float32))
        return self._begin(batch, losses, lambda: self._train_units(losses))

    def _train_units(self, losses: list[float]) -> Segment:
        store, rng, plan = self.store, self.rng, self.plan
        last = self.execs[-1]

        def run_last(d: Device) -> None:
            # The loss is on the host already (metrics): checking it costs no device sync.
            value = last.last(d, store, rng, self.task.loss, self.task.grad_accumulation)
            if math.isfinite(value) or self._nonfinite(value):
                losses.append(value)

        def pre(ex: ShardExec, kind: str) -> Callable[[Device], int]:
            return lambda d: ex.prefetch(d, store, kind)

        units = [("F", ex, lambda d, ex=ex: ex.forward(d, store, rng, keep=plan.keeps(ex.index),
                                                        offload=plan.offloads(ex.index)), pre(ex, "F"))
                 for ex in self.execs[:-1]]
        units.append(("L", last, run_last, pre(last, "L")))
        units += [("B", ex, lambda d, ex=ex: ex.backward(d, store, rng), pre(ex, "B"))
                  for ex in reversed(self.execs[:-1])]
        return self._segment(units, True)

    def _nonfinite(self, value: float) -> bool:
        """The task's ``nonfinite_loss`` policy for a NaN/inf training loss: raise ("fail"), drop the minibatch
        ("skip_step", False) or keep it (True)."""
        policy = self.task.nonfinite_loss
        if policy == "fail":
            fix = ("lower the learning rate, clip gradients (grad_clip_norm=1.0), check that batch for inf/NaN "
                   "inputs or labels that are all ignored (-100)")
            if self.task.precision == "fp16":
                fix += ", use precision='bf16' (fp16 overflows above 65504) or leave nonfinite_loss=None"
            raise rule_error("the training loss is finite (nonfinite_loss='fail')", fix + ", or pass "
                             "nonfinite_loss='skip_step' to drop such batches ('ignore' trains on them)",
                             kind=NonFiniteLoss, task=self.task.name, epoch=self.epoch,
                             batch_in_epoch=self.batch_in_epoch, steps_done=self.steps, loss=value)
        self.skipping = policy == "skip_step"
        return not self.skipping

    def _step(self) -> None:
        # Measured here, in the thread that steps (gradients present, optimizer state from earlier steps): other
        # threads read ``held_bytes``, never the tensors a step is changing (that read crashed the interpreter).
        # Gradients appear by the first step and optimizer state at it: from the second step on the bytes stay.
        if self._measured_steps < 2:  # counted from this build: a resumed task starts again
            self._measured_steps += 1
            self.held_bytes = max(self.held_bytes, self.host_bytes())
        scaler = self.scaler
        if self.task.grad_clip_norm is not None:
            if scaler is not None:
                scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.task.grad_clip_norm)
        if scaler is not None:
            scaler.step(self.optimizer)  # skipped when a gradient is inf/nan; then update() lowers the scale
            scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad()
        self.steps += 1

    def _evaluate(self) -> Iterator[Segment]:
        store = self.store
        self.model.eval()
        losses: list[float] = []
        n = 0
        try:
            for batch in self._batches(self.eval_iterable):
                check_batch(batch, self.task.name, "eval_data", self.eval_in_epoch + 1)
                self.eval_in_epoch += 1
                yield self._begin(batch, losses, lambda: self._eval_units(losses))
                store.clear()
                n += 1
        finally:
            self.model.train()
        self.eval_batches = n
        return sum(losses) / max(len(losses), 1)

    def _eval_units(self, losses: list[float]) -> Segment:
        store, rng, last = self.store, self.rng, self.execs[-1]
        units = [("E", ex, lambda d, ex=ex: ex.forward(d, store, rng, train=False),
                  lambda d, ex=ex: ex.prefetch(d, store, "E")) for ex in self.execs[:-1]]
        units.append(("E", last, lambda d: losses.append(last.evaluate(d, store, rng, self.task.loss)),
                      lambda d: last.prefetch(d, store, "E")))
        return self._segment(units, False)

    def remaining(self) -> dict[str, int]:
        """Estimated units left per kind (for the scheduler): from the data's length when it has one, else from
        the first epoch's count; capped by ``max_steps``."""
        task, n_sh = self.task, len(self.execs)
        per_epoch = self.train_batches or _length(self.train_iterable) or self.batch_in_epoch + 1
        batches = max(per_epoch - self.batch_in_epoch, 0) + per_epoch * (task.epochs - max(self.epoch, 1))
        if task.max_steps is not None:
            batches = min(batches, max(task.max_steps - self.steps, 0) * task.grad_accumulation)
        epochs_left = task.epochs - max(self.epoch, 1) + 1
        evals = 0
        if self.eval_iterable is not None:
            per_eval = self.eval_batches or _length(self.eval_iterable) or 1
            evals = max(per_eval * epochs_left - self.eval_in_epoch, 0) * n_sh
        return {"F": batches * (n_sh - 1), "L": batches, "B": batches * (n_sh - 1), "E": evals}

    def host_bytes(self) -> int:
        """Host bytes this task holds: parameters, gradients, buffers, optimizer state, minibatch in flight. Only
        for the thread that runs the task's host work (or when it is not running): other threads read
        ``held_bytes``."""
        seen: dict[int, int] = {}
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        for st in self.optimizer.state.values():
            tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values()) + self.store.nbytes()


_END = object()


@dataclass
class _Attempt:
    """Where the segment in flight began: the task's RNG state, the losses list and its length, and how to build
    the segment's units again (over the task's current shards)."""

    rng: Any
    losses: list[float]
    n_losses: int
    rebuild: Callable[[], Segment]


_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _uncut_message(model: nn.Module, exc: PlanError) -> str:
    from ..stages import FAMILIES

    return (f"{exc} The model {type(model).__name__} is one stage: hydra_tune cuts nn.Sequential and the "
            f"transformers classes {sorted(FAMILIES)} by itself, and any model whose stages are declared. Fix: "
            "pass ModelTask(..., stages=lambda m: [m.part1, m.part2, ...]) or give the model a `hydra_stages()` "
            "method returning its parts in order (hydra_tune/stages/explicit.py), or raise device_memory.")


def _length(data: Any) -> int | None:
    try:
        return int(len(data))
    except TypeError:
        return None


def _iterable(data: Any) -> Any:
    if callable(data) and not hasattr(data, "__iter__"):
        data = _build(data, "data (the data factory)")
        if iter(data) is data:
            raise TypeError(f"the data factory returns something iterable once per epoch, but got a one-shot "
                            f"iterator (type={type(data).__name__}). Fix: return a list or DataLoader.")
    return data

