"""A task's training loop as a chain of segments: the plain PyTorch loop, cut into units that devices run.

    loop = TrainingLoop(state)                            # TaskState.segments(emit) makes one, returns its chain
    for segment in loop.segments(emit=print):             # Segment "F0 F1 L2 B1 B0"
        for unit in segment.units: unit.run(device)

The chain does the host-side work between segments in the plain loop's order: fetch a batch (in the task's RNG
stream; a data factory is called at the start of each pass over the data), hand out its segment, add the minibatch's
gradients, and every ``grad_accumulation`` batches clip, step the optimizer and the LR scheduler, and zero the
gradients (in the task's RNG stream when its first step drew random numbers: a noisy optimizer; a step that only
starts drawing later draws from torch's global generator); after each epoch it evaluates (eval_loss and the task's
metrics, summed in the last shard's eval units: metrics.py; then ``eval_fn(model)``: evaluate.py), steps a
metric-driven scheduler (ReduceLROnPlateau) with the named metric, and emits the epoch's metrics; with
``eval_every=N`` it evaluates and emits after every N-th
step and after the last one instead, before that step's boundary (a checkpoint there resumes after the report).
``epochs=None``: epochs go on until ``max_steps`` or until the task is cancelled. At each step boundary and epoch
end it serves the checkpoints and snapshots asked, and those asked before it hands out its next minibatch (the model
is unchanged until then); when it trains no more, snapshots get the final model (boundary.py). A resumed task
repeats its epoch's data order from the checkpointed epoch-start RNG state and steps over the batches already
trained on; one resumed from the end of its last epoch trains nothing: it emits that epoch's metrics again (the
checkpoint holds them) and ends.

Rules: once the state is built, only the loop writes its progress (``epoch``, ``batch_in_epoch``,
``eval_in_epoch``, ``steps``, ``samples_trained``, ``train_batches``, ``eval_batches``, ``resume``); a segment
that ran out of device memory starts over with ``retry`` with the same batch and RNG draws, and nothing of the
failed attempt has reached the parameters (gradients are added, and the optimizer steps, only after a segment).
"""
from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..device.devices import Device
from ..policy.partition import Plan
from ..task import check_batch
from . import host_rng
from .boundary import task_work
from .checkpoint import Position
from .data import close_workers, data_generators, is_factory, sampler_state
from .loop_data import LoopData
from .loss import nonfinite_policy
from .evaluate import empty_eval, epoch_metrics, run_eval_fn, schedule_on_metric
from .metrics import MetricSums, measure
from .optstep import OptimizerStep
from .epoch_run import Attempt, EpochRun, batch_size
from .segments import Segment, Unit, segment_key
from .shard import ShardExec

if TYPE_CHECKING:
    from .light_run import LightRun
    from .state import TaskState

UnitSpec = tuple[str, ShardExec, Callable[[Device], Any], Callable[[Device], int]]  # kind, shard, run, prefetch


class TrainingLoop(LoopData):
    """Drives one TaskState through its epochs; ``segments`` is the chain, ``retry`` restarts its segment."""

    def __init__(self, state: TaskState) -> None:
        self.state = state
        self.made = 0  # segments handed out (each one's index)
        self._attempt: Attempt | None = None  # how to start the current segment over (retry)
        self._skipping = False  # the minibatch in flight had a non-finite loss under nonfinite_loss="skip_step"
        self._data_rng: list[torch.Tensor] = []  # the train data's own generators' states at the epoch's start
        self._data_py: list[Any] | None = None   # what had changed in its samplers' Python state by then
        self._data_due: tuple[Any, Any] | None = None  # a resumed epoch's (generator states, sampler entries)
        # the train data's samplers as built (a factory's are made anew each epoch: none); see data.sampler_state
        self._samplers = None if is_factory(state.train_iterable) else sampler_state(state.train_iterable)
        self._optimizer_step = OptimizerStep(state)
        self._emit: Callable[[dict[str, Any]], None] = lambda m: None
        self._start = 0.0
        self._reported: dict[str, Any] | None = None  # the last metrics emitted, and at which step count
        self._reported_at: int | None = None
        # while a device opens this chain in its own thread (runtime/worker.py): it trains minibatches here
        self.inline: LightRun | None = None

    def segments(self, emit: Callable[[dict[str, Any]], None]) -> Iterator[Segment]:
        """The task's training as segments of units; host work (step, data) runs while advancing. However it
        stops (done, failed, closed: ``close()`` runs in the thread that lets it go), its state goes back to host
        memory: a host thread that was busy in its step when the task ended releases it here."""
        try:
            yield from self._epochs(emit)
        finally:
            self._ended()

    def _ended(self) -> None:
        """The chain's end, however it stops: what a light run still holds is counted, the state goes back to host
        memory, data workers stop."""
        try:
            if self.inline is not None:  # a light run lasting to the task's end: its units counted before it ends
                self.inline.finish()
        finally:
            self.state.home.finish()
            for data in (self.state.train_iterable, self.state.eval_iterable):
                close_workers(data)
            # the loop, its attempt's rebuild closure and the task's state point at each other: a cycle that only
            # Python's collector frees. Broken here, an ended task's model its user lets go (with its copy of a
            # shared base) is freed by reference counting at once
            self._attempt = None
            self.state.loop_ended(self)

    def _epochs(self, emit: Callable[[dict[str, Any]], None]) -> Iterator[Segment]:
        state, task = self.state, self.state.task
        final = state.resume
        if final is not None and final.is_final(task.epochs) and final.metrics is not None:
            yield from self._resumed_at_the_end(final, final.metrics, emit)
            return
        self._emit, self._start = emit, time.perf_counter()
        samples = state.resume.samples if state.resume else 0
        first = state.resume.epoch if state.resume else 1
        for epoch in range(first, task.epochs + 1) if task.epochs is not None else itertools.count(first):
            run = yield from self._train_epoch(epoch, samples)
            samples = run.samples
            stop = task.max_steps is not None and state.steps >= task.max_steps
            last = stop or epoch == task.epochs
            # eval_every=N reports every N steps (in _train_epoch) and once after the last step if that was not one
            if task.eval_every is None or (last and self._reported_at != state.steps):
                yield from self._report(epoch, run, final=last)
            state.trained = state.trained or last
            emitted = self._reported
            if stop:
                break
            if not is_factory(state.train_iterable):  # a factory's next epoch has no data yet: the next step serves
                snap = state.rng.snapshot()
                data_rng = [g.get_state() for g in data_generators(state.train_iterable)]
                data_py = None if self._samplers is None else self._samplers.changes(frozen=True)
                state.reach_boundary(Position(epoch + 1, 0, state.steps, samples, [], snap[0], *snap,
                                              data_rng=data_rng, data_python=data_py, metrics=emitted,
                                              host_rng=host_rng.mark(state.rng)), epoch_end=True)
        state.home.flush()  # the final model, whole (lazy per-shard updates applied)
        state.finish_requests()

    def _resumed_at_the_end(self, resume: Position, metrics: dict[str, Any],
                            emit: Callable[[dict[str, Any]], None]) -> Iterator[Segment]:
        """Resumed from the end of its last epoch (a Tune trial restored from its final checkpoint): nothing is
        left to train; the task emits that epoch's metrics again, as it did when the checkpoint was taken, stands
        at that boundary (a checkpoint asked now is that one again) and ends."""
        state = self.state
        state.resume = None
        state.rng.restore((resume.rng, resume.accel_rng))
        state.epoch, state.steps = resume.epoch - 1, resume.steps
        state.trained = True
        # the rate its optimizer holds now: PBT's explored one under resume_hparams="task" (else the same)
        emit(dict(metrics, lr=state.optimizer.param_groups[0]["lr"]))
        state.reach_boundary(resume, epoch_end=True)
        state.finish_requests()
        yield from ()

    def retry(self, plan: Plan) -> Segment:
        """Start the segment in flight over with ``plan`` (after a device out-of-memory): the task's RNG, the
        epoch's losses, the host buffers and the modules' Python state go back to where the segment began
        (``HostStore.reset_attempt``, which refuses when a forward changed a tensor attribute in place); the same
        batch runs again."""
        attempt, state = self._attempt, self.state
        if attempt is None:
            raise RuntimeError(f"task {state.task.name!r} has no segment in flight to retry")
        host_rng.back_to(state.rng, attempt.rng)
        del attempt.losses[attempt.n_losses:]
        self._skipping = False
        state.store.reset_attempt()
        state.reshard(plan)
        return attempt.rebuild()

    # -- one epoch's training -------------------------------------------------------------------------------
    def _train_epoch(self, epoch: int, samples: int) -> Generator[Segment, None, EpochRun]:
        state, task, rng = self.state, self.state.task, self.state.rng
        state.epoch = epoch
        state.batch_in_epoch = state.eval_in_epoch = 0
        losses, skip, skipped = self._resume_epoch()
        run = EpochRun(losses, skip, samples, skipped=skipped)
        epoch_rng = rng.cpu.get_state()
        for batch in self._batches(state.train_iterable, "train_data"):
            state.batch_in_epoch += 1  # counted when handed out: remaining() is what is not yet handed out
            if state.batch_in_epoch <= run.skip:
                if state.batch_in_epoch == run.skip:  # the next fetch and all after draw as they did originally
                    self._resume_rng()
                    if task.max_steps is not None and state.steps >= task.max_steps:
                        break  # checkpointed at its last step: the task only ends its epoch, as it did then
                continue
            # trained and stepped in the device's thread that opens this chain now, or a segment (light_run.py)
            here = yield from self._light(True, lambda light: light.train(self, batch, run.losses))
            if not here:
                yield self._train_segment(batch, run.losses)
                if self._skipping:  # nonfinite_loss="skip_step": as `optimizer.zero_grad(); continue`
                    self._skipping = False
                    with state.home.locked():
                        state.home.flush()
                        state.store.clear()
                        state.optimizer.zero_grad()
                    state.home.settle()
                    run.pending, run.skipped = 0, run.skipped + 1
                    continue
                step_now = run.pending + 1 >= task.grad_accumulation
                # the gradients may be on a device: no eviction while they are added
                state.home.land_grads(state.store, step_follows=step_now and state.home.steps_here())
            run.samples += (size := batch_size(batch))
            state.samples_trained += size
            run.pending += 1
            if run.pending < task.grad_accumulation:
                state.home.settle()  # no step due: its gradients are in, evictions may go on (state_cache.py)
            else:
                if not here:
                    self._step()
                run.pending = 0
                yield from self._report_due(epoch, run)  # before the boundary: a checkpoint there follows it
                if not here or state.requests_waiting():  # (trained here: no one waits at it, light_run.py)
                    state.reach_boundary(Position(epoch, state.batch_in_epoch, state.steps, run.samples,
                                                  list(run.losses), epoch_rng, *rng.snapshot(), skipped=run.skipped,
                                                  data_rng=self._data_rng, data_python=self._data_py,
                                                  host_rng=host_rng.mark(rng)),
                                         epoch_end=False)
                if task.max_steps is not None and state.steps >= task.max_steps:
                    break
        state.train_batches = state.batch_in_epoch if epoch == 1 else state.train_batches
        if run.pending:
            self._step()
            yield from self._report_due(epoch, run)
        return run

    def _report_due(self, epoch: int, run: EpochRun) -> Generator[Segment, None, None]:
        """``eval_every=N``: after every N-th optimizer step, evaluate and report."""
        every = self.state.task.eval_every
        if every is not None and self.state.steps % every == 0:
            yield from self._report(epoch, run)

    def _report(self, epoch: int, run: EpochRun, final: bool = False) -> Generator[Segment, None, None]:
        """Evaluate (with eval_data), step a metric-driven scheduler, and emit the metrics (``final``: the last
        ones; the task is ``trained`` before its caller sees them)."""
        state = self.state
        metrics = epoch_metrics(state, epoch, run.losses, run.samples, run.skipped)
        if state.eval_iterable is not None:
            metrics.update((yield from self._evaluate()))
        metrics.update(run_eval_fn(state, metrics))  # the whole model, on this host thread (evaluate.py)
        schedule_on_metric(state, metrics)
        metrics["seconds"] = time.perf_counter() - self._start
        self._reported, self._reported_at = dict(metrics), state.steps
        state.trained = state.trained or final
        self._emit(metrics)

    # -- segments -------------------------------------------------------------------------------------------
    def _light(self, train: bool, attempt: Callable[[LightRun], bool]) -> Generator[Segment, None, bool]:
        """Whether ``attempt`` ran the minibatch in a light run of the device opening this chain; one the policy
        just gave to another task hands it over first (``Segment.handover``), then the next device attempts it."""
        light = self.inline
        if light is None:
            return False
        if attempt(light):
            return True
        if not light.released:
            return False
        yield Segment(self.state.task.name, self.made, (), train, handover=True)
        light = self.inline  # (the device that took it, or None: its host thread opened it)
        return light is not None and attempt(light)

    def _segment(self, units: list[UnitSpec], train: bool) -> Segment:
        self.made += 1
        name = self.state.task.name

        home = self.state.home

        def work(run: Callable[[Device], Any], shard: int) -> Callable[[Device], Any]:
            def in_work(d: Device) -> Any:  # the model's forward and the loss: the task's own work
                home.use(shard, d)  # its entries move in, its pending update is applied (resident.py)
                with task_work(name):
                    return run(d)
            return in_work

        return Segment(name, self.made, tuple(Unit(name, kind, ex.index, self.made, work(run, ex.index), pre)
                                              for kind, ex, run, pre in units),
                       train, segment_key(train, self.state.store.batch))

    def _begin(self, batch: Any, losses: list[float], rebuild: Callable[[], Segment]) -> Segment:
        self.hold(batch)
        return self._attempted(losses, rebuild)

    def hold(self, batch: Any) -> None:
        """The minibatch in flight and its prepared input into the host store."""
        store = self.state.store
        store.batch = batch
        store.carries[0] = self.state.cut.prepare(batch)

    def _attempted(self, losses: list[float], rebuild: Callable[[], Segment]) -> Segment:
        self._attempt = Attempt(host_rng.retry_point(self.state.rng), losses, len(losses), rebuild)
        return rebuild()

    def _train_segment(self, batch: Any, losses: list[float]) -> Segment:
        self.start_minibatch(batch)
        return self._attempted(losses, lambda: self._train_units(losses))

    def start_minibatch(self, batch: Any) -> None:
        """A training minibatch is handed out: the boundary left, the batch checked (and the loss scaled), the
        batch and its prepared input in the host store."""
        state = self.state
        state.leave_boundary()  # before anything of this minibatch (the loss scaler's scale() included)
        check_batch(batch, state.task.name, "train_data", state.batch_in_epoch)
        if state.scaler is not None:  # scale() also initialises the scaler's state, as in the plain loop
            state.store.loss_scale = state.scaler.scale(torch.ones((), dtype=torch.float32))
        self.hold(batch)

    def next_segment(self) -> int:
        """The number of a minibatch trained with no segment (light_run.py), counted as segments are."""
        self.made += 1
        return self.made

    def steps_quietly(self) -> bool:
        """Whether the task's optimizer step is known to draw no random numbers (``OptimizerStep``)."""
        return self._optimizer_step.draws is False

    def update_here(self, device: Device) -> None:
        """A light run's step (light_run.py): the whole update where the state is, on ``device``."""
        self._optimizer_step.update_here(device)

    def _train_units(self, losses: list[float]) -> Segment:
        state = self.state
        store, rng, plan, task, execs = state.store, state.rng, state.plan, state.task, state.execs
        last = execs[-1]

        def run_last(d: Device) -> None:
            # The loss is on the host already (metrics): checking it costs no device sync.
            value = last.forward_loss_backward(d, store, rng, task.loss, task.grad_accumulation)
            if math.isfinite(value) or self._nonfinite(value):
                losses.append(value)

        def pre(ex: ShardExec, kind: str) -> Callable[[Device], int]:
            return lambda d: ex.prefetch(d, store, kind)

        units: list[UnitSpec] = [
            ("F", ex, lambda d, ex=ex: ex.forward(d, store, rng, keep=plan.keeps(ex.index),
                                                 offload=plan.offloads(ex.index)), pre(ex, "F"))
            for ex in execs[:-1]]
        units.append(("L", last, run_last, pre(last, "L")))
        units += [("B", ex, lambda d, ex=ex: ex.backward(d, store, rng), pre(ex, "B")) for ex in reversed(execs[:-1])]
        return self._segment(units, True)

    def _nonfinite(self, value: float) -> bool:
        """The task's ``nonfinite_loss`` policy for a NaN/inf training loss (loss.py): raise, drop the minibatch
        (False) or keep it (True)."""
        state = self.state
        keep = nonfinite_policy(state.task, value, epoch=state.epoch, batch_in_epoch=state.batch_in_epoch,
                                steps_done=state.steps)
        self._skipping = not keep
        return keep

    # -- the optimizer step and evaluation ------------------------------------------------------------------
    def _step(self) -> None:
        self.state.own_thawed()  # a shared weight made trainable since becomes its own: the step writes no one else's
        self._optimizer_step()  # optstep.py: where the task's state is (or lazily per shard: lazy.py)
        self.state.check_frozen()  # a write into a weight other tasks share fails this task (shared_frozen.py)
        self.state.home.settle()  # its step went first: evictions may go on (state_cache.py)

    def _evaluate(self) -> Generator[Segment, None, dict[str, float]]:
        """One pass over the eval data: ``eval_loss`` (the mean of the batches' losses) and the task's metrics."""
        state = self.state
        state.home.flush()  # eval sees step t's weights: pending per-shard updates applied first
        state.model.eval()
        losses: list[float] = []
        sums = MetricSums(state.task.metrics)
        n = 0
        try:
            for batch in self._batches(state.eval_iterable, "eval_data"):
                check_batch(batch, state.task.name, "eval_data", state.eval_in_epoch + 1)
                state.eval_in_epoch += 1
                state.leave_boundary()  # an evaluation forward may change what the model holds, too
                measured: list[dict[str, Any]] = []  # a retried segment's measures are replaced, not added
                if not (yield from self._light(False, lambda light: light.evaluate(self, batch, losses, measured))):
                    yield self._begin(batch, losses, lambda: self._eval_units(losses, measured))
                state.home.settle()
                for m in measured[-1:]:
                    sums.add(m)
                state.store.clear()
                n += 1
        finally:
            state.model.train()
        if n == 0:  # (a factory's or an iterable's pass that yielded nothing: a sized empty set fails at submit)
            raise empty_eval(state.task.name, state.epoch)
        state.eval_batches = n
        # (max: a chain driven without running its units, as a test may, has batches but no losses)
        return {"eval_loss": sum(losses) / max(len(losses), 1), **sums.values()}

    def measuring(self, measured: list[dict[str, Any]]) -> Callable[[Any, Any], None] | None:
        """An eval unit's ``measure(outputs, batch)``: the task's metrics of the eval batch in flight into
        ``measured`` (on the device, inside the unit: metrics.py); None without metrics."""
        state, fns = self.state, self.state.task.metrics
        if not fns:
            return None

        def on_outputs(out: Any, batch: Any) -> None:
            measured.append(measure(fns, out, batch, task=state.task.name, step=state.steps, epoch=state.epoch,
                                    eval_batch=state.eval_in_epoch))
        return on_outputs

    def _eval_units(self, losses: list[float], measured: list[dict[str, Any]]) -> Segment:
        state = self.state
        store, rng, last, loss_fn = state.store, state.rng, state.execs[-1], state.task.loss
        units: list[UnitSpec] = [("E", ex, lambda d, ex=ex: ex.forward(d, store, rng, train=False),
                                  lambda d, ex=ex: ex.prefetch(d, store, "E")) for ex in state.execs[:-1]]

        def run_last(d: Device) -> None:
            losses.append(last.evaluate(d, store, rng, loss_fn, self.measuring(measured)))

        units.append(("E", last, run_last, lambda d: last.prefetch(d, store, "E")))
        return self._segment(units, False)
