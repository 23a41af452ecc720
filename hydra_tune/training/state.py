"""What the runtime holds for one admitted task: its built model, optimizer and data, its plan, and its progress.

    state = TaskState.build(task, budget=devices[0].budget)     # model, optimizer, stages, measured costs, plan
    for segment in state.segments(emit=print):                   # the training loop as segments (loop.py)
        for unit in segment.units: unit.run(device)
    state.remaining(), state.held_bytes                          # for the scheduler and host-memory admission
    state.home.where(i)                                          # where shard i's parameters and optimizer state are

Rules: build in the submitting thread (factory errors raise there); the loop's thread alone touches the tensors
(``host_bytes()``), other threads read ``held_bytes`` and the progress numbers; checkpoints and snapshots are
asked from any thread and served by the loop at a step boundary (boundary.py).
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch
import torch.nn as nn

from ..device.dispatch import UnitMode
from ..device.rng import TaskRNG
from ..device.seeding import seeding_to
from ..errors import PlanError, rule_error
from ..policy.partition import Plan, StageCost, partition
from ..stages import ModelStages, extract_stages
from ..stages.check import check_stages
from ..task import ModelTask, check_batch
from . import host_rng
from .boundary import Boundary, BoundaryRequest, BoundaryRequests
from .build import AUTOCAST_DTYPES, build_part, check_model, check_optimizer, check_scheduler
from .checkpoint import AsBuilt, Position, check_position, load, restore
from .data import NO_BATCH, check_resume, data_length, sample_batch, task_data
from .evaluate import empty_eval
from .light_run import LightRun
from .loop import TrainingLoop
from .measure_class import measure_as
from .metrics import check_metrics_run
from .profile import measure_costs
from .resident import StateHome
from .segments import Segment
from .shard import ShardExec
from .shared_frozen import SharedFrozen, TaskShares
from .store import HostStore


class TaskState:
    """Everything the runtime holds for one task. Build with ``TaskState.build`` (in the submitting thread)."""

    def __init__(self, task: ModelTask, model: nn.Module, optimizer: Any, scheduler: Any, train_iterable: Any,
                 eval_iterable: Any, cut: ModelStages, plan: Plan, rng: TaskRNG,
                 costs: list[StageCost] | None = None) -> None:
        self.task, self.model, self.optimizer, self.scheduler = task, model, optimizer, scheduler
        self.as_built = AsBuilt(model, optimizer, eval_iterable)  # what checkpoints are taken against
        # the task's data: its own copy of a DataLoader, other iterables, or factories each epoch calls (data.py)
        self.train_iterable, self.eval_iterable = train_iterable, eval_iterable
        self.cut, self.plan, self.rng = cut, plan, rng
        self.costs = costs  # the measured stage costs a re-plan after a device out-of-memory starts from
        self.autocast = AUTOCAST_DTYPES[task.precision]
        self.store = HostStore()
        # where its parameters, gradients and optimizer state are: host memory, or a device (resident.py)
        self.home = StateHome(task.name, optimizer, self.store, task.grad_accumulation, task.precision == "fp16")
        self.shares: TaskShares | None = None   # its frozen parameters held in the runtime's pool
        self._pool: SharedFrozen | None = None
        self._prepare_host: Any = None   # readies a tensor for copies to the devices (the pool's ``prepare``)
        self.privatize: Callable[[], None] | None = None  # the ended model's private copies (shared_frozen.py)
        self.model_reachable = True  # its user holds the model (build): private copies at its end, not later
        self.execs = self._execs(plan)
        # what a CPU device measures this task's segments as: its own name, or the class of equal tasks it belongs
        # to (measure_class.py; set by build)
        self.measure_as: Hashable = task.name
        # fp16: dynamic loss scaling by torch's own GradScaler over the gradients, wherever they are (a "cpu"
        # scaler unscales device gradients too: its scale is copied to each gradient's device)
        self.scaler = torch.amp.GradScaler("cpu") if task.precision == "fp16" else None
        # Progress, written by the training loop (loop.py) only
        self.steps = 0
        self.samples_trained = 0  # samples of the minibatches trained here (a resumed task's earlier ones not)
        self.epoch = 0
        self.batch_in_epoch = 0
        self.eval_in_epoch = 0
        self.train_batches: int | None = None  # counted in the first epoch (for data without a length)
        self.eval_batches: int | None = None
        self.trained = False  # its last metrics are out: nothing is left to train (a cancel lets it end as done)
        self.resume: Position | None = None  # where a resumed task continues (checkpoint.restore)
        self.replans = 0       # re-plans after a device out-of-memory (replan.py)
        self.held_bytes = 0    # host_bytes() at its first two steps (then steady): what other threads may read
        self._measured_steps = 0
        self._loop: TrainingLoop | None = None
        self._requests = BoundaryRequests(task.name)

    @classmethod
    def build(cls, task: ModelTask, budget: int | None, bandwidth: float | None = None,
              keep: bool = True, device: Any = None,
              claim: Callable[[str, nn.Module], None] | None = None) -> TaskState:
        """Build ``task``'s model, optimizer, scheduler and data, cut it into stages, measure them on its first
        batch (on ``device`` where it measures itself: a GPU) and plan shards for a device ``budget``; load
        ``task.resume_from`` when given. ``claim(name, model)``: called on the model before anything touches it
        (the runtime's: it raises when a running task trains that module)."""
        rng = TaskRNG(task.seed)
        # init draws from the task's stream, as after manual_seed(seed); a factory's own torch.manual_seed(s)
        # seeds that stream (device/seeding.py), as it seeds the global generator the plain loop draws from
        with UnitMode(rng.cpu), seeding_to(rng), host_rng.replayed(task):  # Python's and numpy's draws too
            model = task.model if isinstance(task.model, nn.Module) else build_part(task.model, "model")
            if claim is not None:
                claim(task.name, model)
            # a model its user can reach (passed in, or a factory returning one held elsewhere: `lambda: model`,
            # a cache) takes private copies of shared frozen weights as soon as it ends (runtime.py); only this
            # name and getrefcount's argument refer to a model the factory made for us alone
            reachable = isinstance(task.model, nn.Module) or sys.getrefcount(model) > 2
            check_model(task, model)
            model.train()
            optimizer = build_part(task.optimizer, "optimizer (`optimizer(model)`)", model)
            check_optimizer(task, model, optimizer)
            scheduler = None
            if task.lr_scheduler is not None:
                scheduler = build_part(task.lr_scheduler, "lr_scheduler", optimizer)
                check_scheduler(task, scheduler)
        # Each epoch makes its data (a factory is called then) and a DataLoader is iterated as the task's own clone
        # (training/data.py); the sample batch leaves the user's data untouched and draws from a scratch stream.
        cut = extract_stages(model, task.stages)
        sample = sample_batch(task.train_data, task.seed, task.name)
        if sample is NO_BATCH:
            raise rule_error("`train_data` yields at least one batch", "check the dataset's length and the "
                             "DataLoader's batch_size and drop_last", task=task.name, batches=0)
        check_batch(sample, task.name, "train_data", 1)
        if task.eval_data is not None and data_length(task.eval_data) == 0:  # (a factory's data: at its evaluation)
            raise empty_eval(task.name, epoch=None)
        # declared stages must compute the model's own forward (on copies, a scratch stream: nothing changes)
        check_stages(model, cut, sample, UnitMode, task.seed, AUTOCAST_DTYPES[task.precision], task.name,
                     evaluate=task.eval_data is not None)
        check_metrics_run(task, model, sample, UnitMode)  # each metric tried once, on a copy of the model
        costs = measure_costs(cut, sample, task.loss, task.seed, AUTOCAST_DTYPES[task.precision], device)
        rng.host_draws = any(c.draws_host for c in costs)
        try:
            plan = partition(costs, budget, bandwidth=bandwidth, keep=keep)
        except PlanError as exc:
            if cut.family != "whole":
                raise
            raise PlanError(_uncut_message(model, exc)) from None
        state = cls(task, model, optimizer, scheduler, task_data(task.train_data), task_data(task.eval_data), cut,
                    plan, rng, costs)
        state.held_bytes = state.host_bytes()
        state.model_reachable = reachable
        state.measure_as = measure_as(task, cut, plan, AUTOCAST_DTYPES[task.precision])
        if task.resume_from is not None:
            state.resume = restore(state, load(task.resume_from), keep_hparams=task.resume_hparams == "task")
            check_position(task, state.resume)   # nothing silently left untrained, no step past max_steps
            if not state.resume.is_final(task.epochs):  # at the end nothing iterates the data again
                check_resume(task, state.resume.epoch, state.resume.data_rng)
            state.steps = state.resume.steps
        return state

    # -- training -------------------------------------------------------------------------------------------
    def segments(self, emit: Callable[[dict[str, Any]], None]) -> Iterator[Segment]:
        """The task's training as a chain of segments (loop.py); each epoch's metrics go to ``emit``. A task with
        a ``drive_segments(state, emit)`` method (hydra_tune.prepare: the user's own loop drives it) makes its own."""
        drive = getattr(self.task, "drive_segments", None)
        if drive is not None:
            return drive(self, emit)
        self._loop = TrainingLoop(self)
        return self._loop.segments(emit)

    def loop_ended(self, loop: TrainingLoop) -> None:
        """``loop`` (this task's) trains no more: the task lets go of it (loop.py: no cycle left to collect)."""
        if self._loop is loop:
            self._loop = None

    def light_host_work(self) -> bool:
        """Whether the host work between this task's segments may run on a device's thread (the runtime's inline
        opening, runtime/worker.py): only for our own loop over lists or tuples of batches (their ``next`` runs no
        code, so no iterator depends on its thread or can block), with no ``eval_fn`` (the whole model on the
        host) and no checkpoint or snapshot waiting to be written."""
        task = self.task
        return (getattr(task, "drive_segments", None) is None and task.eval_fn is None
                and isinstance(self.train_iterable, (list, tuple))
                and (self.eval_iterable is None or isinstance(self.eval_iterable, (list, tuple)))
                and not self._requests.waiting())

    @contextlib.contextmanager
    def inline(self, light: LightRun) -> Iterator[None]:
        """Inside, the device opening this task's next segment in its own thread (runtime/worker.py) trains the
        minibatches it may there (``light``, light_run.py) before the loop hands out a segment."""
        loop = self._loop
        if loop is None:
            yield
            return
        loop.inline = light
        try:
            yield
        finally:
            loop.inline = None

    def requests_waiting(self) -> bool:
        """Whether a checkpoint or snapshot is asked and not yet served (a hint: read without the lock)."""
        return self._requests.waiting()

    def retry(self, plan: Plan, replanned: bool = True) -> Segment:
        """Start the segment in flight over with ``plan`` (after a device out-of-memory): the task's RNG, the
        epoch's losses and the host buffers go back to where the segment began; the same batch runs again.
        ``replanned=False``: the same plan again (a rerun, device/quiet.py), not counted in ``replans``."""
        replans = self.replans
        retry = getattr(self.task, "retry_segment", None)  # a user-driven task (hydra_tune.prepare)
        if self._loop is None and retry is not None:
            segment = retry(self, plan)
        elif self._loop is None:
            raise RuntimeError(f"task {self.task.name!r} has no segment in flight to retry")
        else:
            segment = self._loop.retry(plan)
        if not replanned:  # both retry paths re-cut the model through reshard(), which counts a re-plan
            self.replans = replans
        return segment

    def reshard(self, plan: Plan, replanned: bool = True) -> None:
        """Cut the model along ``plan`` from now on (a re-plan: counted in ``replans``; else planned for per-shard
        state entries, entry_plan.py). Its state goes back to host memory first (the new shards are different
        entries)."""
        self.home.release()
        self.plan = plan
        self.execs = self._execs(plan)
        self.measure_as = self.task.name  # (its units now differ from its class's: measured as its own)
        self.replans += int(replanned)

    def share_frozen(self, pool: SharedFrozen, prepare: Any = None) -> TaskShares:
        """Hold the model's frozen parameters in ``pool`` (shared_frozen.py): equal ones of other tasks once;
        ``prepare``: readies a new entry's tensor (pinning)."""
        self.shares, self._pool, self._prepare_host = pool.share(self.task.name, self.model, prepare), pool, prepare
        for ex in self.execs:
            ex.use_pool(pool, self.shares.keys())
        self.held_bytes = self.host_bytes()
        return self.shares

    def check_frozen(self) -> None:
        """Raise when the task wrote into a frozen parameter it shares (after each optimizer step)."""
        if self.shares is not None:
            self.shares.check()

    def own_thawed(self) -> None:
        """Before each optimizer step: frozen parameters the task shares, made trainable since (gradual
        unfreezing), become its own (``SharedFrozen.thaw``), so that its step writes no other task's weights."""
        if self.shares is None or self._pool is None:
            return
        thawed = self.shares.thawed(self.optimizer)
        if not thawed:
            return
        self.shares.check()  # one another task wrote into, with no clean copy left: fails here, not taken over
        params = self._pool.thaw(self.shares, thawed)
        if self._prepare_host is not None:
            self._prepare_host(params)
        for ex in self.execs:
            ex.use_pool(self._pool, self.shares.keys())
        self.held_bytes = max(self.held_bytes, self.host_bytes())

    def _execs(self, plan: Plan) -> list[ShardExec]:
        execs = [ShardExec(s.index, self.cut.stages[s.start:s.stop], self.autocast, self.home) for s in plan.shards]
        for ex in execs:
            ex.snapshot_against(self.as_built.python["model"])
        if self._pool is not None and self.shares is not None:
            for ex in execs:
                ex.use_pool(self._pool, self.shares.keys())
        self.home.reshard(execs)
        return execs

    # -- checkpoints and snapshots (boundary.py) ------------------------------------------------------------
    def request_checkpoint(self, path: str) -> BoundaryRequest:
        """Ask for a checkpoint at the task's next step boundary (or epoch end); ``wait()`` returns the path."""
        return self._requests.ask_checkpoint(path)

    def request_snapshot(self) -> BoundaryRequest:
        """Ask for a copy of the model at the task's next step boundary (or epoch end; the final model once the
        loop is through); ``wait()`` returns a ``Snapshot``."""
        return self._requests.ask_snapshot()

    def abandon_checkpoints(self, why: str) -> None:
        """Fail the checkpoint and snapshot requests still waiting, and any asked from now on (the task trains no
        more); snapshots of a loop that finished keep getting its final model."""
        self._requests.end(why)

    def reach_boundary(self, position: Position, epoch_end: bool) -> None:
        """The loop stands at a step boundary (``position``; ``epoch_end``: after the epoch's evaluation): serve
        the requests asked so far, and those asked before it hands out its next minibatch."""
        self._requests.reach(self, Boundary(position, self.epoch, self.steps, epoch_end))

    def leave_boundary(self) -> None:
        """The loop hands out a minibatch (the model may change from now on): serve what was asked meanwhile."""
        self._requests.leave(self)

    def finish_requests(self) -> None:
        """The loop trains no more: its state goes back to host memory; waiting checkpoints fail, snapshots (now
        and later) get the final model."""
        self.home.release()
        self._requests.finish(self.model, Boundary(None, self.epoch, self.steps, True))

    # -- what it holds and what is left --------------------------------------------------------------------
    def remaining(self) -> dict[str, int]:
        """Estimated units left per kind (for the scheduler): from the data's length when it has one, else from
        the first epoch's count; capped by ``max_steps``."""
        task, n_sh = self.task, len(self.execs)
        per_epoch = self.train_batches or data_length(self.train_iterable) or self.batch_in_epoch + 1
        # epochs=None: max_steps bounds it; with no bound either, say one more epoch (until it is stopped)
        epochs = task.epochs if task.epochs is not None else max(self.epoch, 1) + (1 if task.max_steps is None
                                                                                  else 1 << 20)
        batches = max(per_epoch - self.batch_in_epoch, 0) + per_epoch * (epochs - max(self.epoch, 1))
        if task.max_steps is not None:
            batches = min(batches, max(task.max_steps - self.steps, 0) * task.grad_accumulation)
        epochs_left = epochs - max(self.epoch, 1) + 1
        evals = 0
        if self.eval_iterable is not None:
            per_eval = self.eval_batches or data_length(self.eval_iterable) or 1
            if task.eval_every is None:
                evals = max(per_eval * epochs_left - self.eval_in_epoch, 0) * n_sh
            else:  # one pass every eval_every steps, and one after the last step if that is not one
                evals = per_eval * -(-batches // (task.grad_accumulation * task.eval_every)) * n_sh
        return {"F": batches * (n_sh - 1), "L": batches, "B": batches * (n_sh - 1), "E": evals}

    def host_bytes(self) -> int:
        """Host bytes this task holds: parameters, gradients, buffers, optimizer state, minibatch in flight (state
        resident on a device: the host tensors kept for it instead). Only for the thread that runs the task's
        host work (or when it is not running): other threads read ``held_bytes``."""
        seen: dict[int, int] = {}
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        for st in self.optimizer.state.values():
            tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
        on_device = self.home.device_storages()
        if self.shares is not None:  # held once by the runtime's pool, charged there (shared_frozen.py)
            on_device |= self.shares.storages()
        for t in tensors:
            s = t.untyped_storage()
            if s.data_ptr() not in on_device:
                seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values()) + self.home.home_bytes() + self.store.nbytes()

    def measure_held_bytes(self) -> None:
        """Update ``held_bytes`` from ``host_bytes()``; called by the loop before each optimizer step, in its
        thread (gradients present, optimizer state from earlier steps). Gradients appear by the first step and
        optimizer state at it: from the second step on the bytes stay, so only the first two are measured."""
        if self._measured_steps < 2:  # counted from this build: a resumed task measures again
            self._measured_steps += 1
            self.held_bytes = max(self.held_bytes, self.host_bytes())


def _uncut_message(model: nn.Module, exc: PlanError) -> str:
    from ..stages import FAMILIES

    return (f"{exc} The model {type(model).__name__} is one stage: hydra_tune cuts nn.Sequential and the "
            f"transformers classes {sorted(FAMILIES)} by itself, and any model whose stages are declared. Fix: "
            "pass ModelTask(..., stages=lambda m: [m.part1, m.part2, ...]) or give the model a `hydra_stages()` "
            "method returning its parts in order (hydra_tune/stages/explicit.py), or raise device_memory.")
