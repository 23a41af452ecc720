"""The user-driven task: the user's thread hands the runtime one forward or one backward at a time.

    driver = Driver("prepared-1", None, guard)          # runner.py makes one per prepared model
    driver.run(lambda: driver.open_forward(True), after)  # the user's thread: its host thread opens the segment,
                                                          # a device runs it, then after() runs; the call returns
    driver.run(lambda: driver.open_backward(grads), after)
    driver.release()                                    # the task ends ("done"): the runtime frees what it held

Why this shape: the runtime drives a task through its chain of segments (training/loop.py), advanced by the task's
own host thread between segments. A prepared model has no loop of ours: its chain (``drive_segments``, reached
through ``TaskState.segments``) waits in the host thread for the user's next call, hands the board that call's
segment, and once the segment ran tells the waiting user thread. So the user's thread blocks for its own units
only; other tasks' units run on the devices meanwhile, and the board, the gate, the trace and the stats see a
prepared model as any other task.

Segments: a training forward is F0..F(K-1) (the last shard's forward too: the loss is the user's), the output
carry of the last shard is the model's output; its backward is B(K-1)..B0 from the output's gradients (a shard
that kept its graph backpropagates through it, else it recomputes its forward from the saved input and RNG state,
exactly as the loop's B units); an evaluation forward (no autograd) is E0..E(K-1). The last shard keeps its graph
where the device has room for it (``_train_forward``), so a step costs about a ModelTask's (one forward, one
backward); a new forward, the task's end, or a device that needs the room drops it.

State: kept as a ModelTask's (training/resident.py): resident on a device when it fits, else per-shard entries
with the lazy per-shard step when the optimizer is on its allowlist, else in host memory; the user's thread steps
and reads it through access.py.

RNG: without ``seed`` the units draw from the stream the user's thread draws from (torch's global generator, or its
trial stream: streams.py): its
state is handed to the task before a forward and taken back after it, so dropout and the user's own draws
(shuffling) interleave as in the plain loop. With ``seed`` the task keeps a stream of its own (reproducible when
several trials run in threads of one process, where the global generator is shared).

A device out-of-memory re-plans the task (replan.py) and retries the segment in flight (``retry_segment``): a
forward from its RNG state; a backward, whose forward's graphs and carries went with the old shards, as its forward
once more (same RNG state, buffers and Python state put back first) followed by the backward.

Rules: one minibatch in flight: a new forward drops a training forward whose backward never came; a backward
needs the latest training forward's output. Errors of a unit end the task (the runtime's rule) and raise in the
user's thread.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..device.devices import Device
from ..errors import rule_error
from ..training import host_rng
from ..training.boundary import task_work
from ..training.segments import Segment, Unit, segment_key
from ..training.step import check_lazy
from .guard import PendingGuard
from .lazy import PreparedLazySteps
from .optimizer import direct, unwrapped

_POLL = 0.05  # seconds between looks at the task's status while the user's thread waits for its units


class _Request:
    """One call of the user's: the segment to run, then done (or the task ended)."""

    def __init__(self, make: Callable[[], Segment], after: Callable[[], None]) -> None:
        self.make, self.after = make, after
        self.done = threading.Event()


class Driver:
    """The user-driven chain of one prepared model (see the module docstring)."""

    def __init__(self, name: str, seed: int | None, guard: PendingGuard) -> None:
        self.name, self.seed, self.guard = name, seed, guard
        self.handle: Any = None
        self.state: Any = None
        self.lender: Any = None  # runs a call's segment in the caller's thread when a device is lent (lend.py)
        self._cv = threading.Condition()
        self._request: _Request | None = None
        self._calling = threading.Lock()  # held by the user's thread while its call runs
        self._closed = False
        self._told = False  # the task's error was raised in one of the user's calls already
        self._made = 0
        # the segment in flight: RNG (and Python's generators where the task draws from them), rebuild (given the
        # generators to go on from once a retried backward's forward replayed its draws)
        self._attempt: tuple[Any, Callable[[dict[str, Any] | None], Segment]] | None = None
        self.forward_snap: Any = None  # the RNG state the latest training forward started from
        self.finished = False  # the chain ended: the state is back in host memory for good
        self.pending = 0   # the training forward awaiting its backward (its number), 0: none
        self.forwards = 0  # training forwards run
        self.host_hold: Callable[[], str | None] | None = None  # why the state must stay in host memory (access.py)

    # -- the runtime's side (the task's host thread) ---------------------------------------------------------
    def drive_segments(self, state: Any, emit: Callable[[dict[str, Any]], None]) -> Iterator[Segment]:
        """The chain ``TaskState.segments`` returns for this task: the user's requests, as they come."""
        self.state = state
        # the state is kept as a ModelTask's (resident, or per-shard entries stepped lazily: access.py); the lazy
        # allowlist sees the optimizer as the user built it (ours only routes its step)
        with unwrapped(state.optimizer) as opt:
            verdict = check_lazy(opt, None, state.model)
        # no scaler: the user's loop scales its loss with its own GradScaler (its scaler.step calls our step)
        state.home.set_lazy(PreparedLazySteps(state.optimizer, list(state.model.parameters()), verdict, self.guard))
        if self.host_hold is not None:
            state.home.hold_on_host(self.host_hold)
        try:
            while True:
                request = self._next_request()
                if request is None:
                    return
                yield request.make()
                with direct():
                    request.after()
                request.done.set()
        finally:
            self.lender = None
            with direct():
                state.home.finish()
            self.finished = True

    def _next_request(self) -> _Request | None:
        with self._cv:
            while self._request is None and not self._closed and not self._ended():
                self._cv.wait(_POLL)
            request, self._request = self._request, None
            return request

    def _ended(self) -> bool:
        return self.handle is not None and self.handle.done()

    # -- the user's side -------------------------------------------------------------------------------------
    def run(self, make: Callable[[], Segment], after: Callable[[], None] = lambda: None) -> None:
        """Hand the task's host thread one segment and wait until it ran (and ``after`` it); raise the task's
        error if it ended instead."""
        if not self._calling.acquire(blocking=False):
            raise rule_error("a prepared model is called by one thread at a time", "prepare one model per "
                             "thread (each trial its own), or call it from one thread", kind=RuntimeError,
                             task=self.name, thread=threading.current_thread().name)
        try:
            if not self._lent(make, after):
                self._handed(make, after)
        except BaseException:
            self._told = self._told or self._ended()  # the call that met the task's error raised it
            raise
        finally:
            self._calling.release()

    def _lent(self, make: Callable[[], Segment], after: Callable[[], None]) -> bool:
        """The call's segment run in this thread on the device the scheduler kept on the task, with no hand-off
        (runtime/lend.py): whether it ran; the task's error raises if it ended instead."""
        lender = self.lender
        if lender is None or self._closed:
            return False
        with direct():  # as the host thread's work: the runtime's own reads and steps (guard.py, optimizer.py)
            ran = lender.run(make, after)
        if ran is False:
            self._check_live()
            raise RuntimeError(f"hydra_tune: prepared task {self.name!r} stopped in a lent segment without an "
                               "error; please report this as a bug")
        return bool(ran)

    def _handed(self, make: Callable[[], Segment], after: Callable[[], None]) -> None:
        """The call's segment through the task's host thread and the board; wait until it ran."""
        request = _Request(make, after)
        with self._cv:
            self._check_live()
            self._request = request
            self._cv.notify_all()
        while not request.done.wait(_POLL):
            if self._ended():
                self._check_live()

    def _check_live(self) -> None:
        if self._closed:
            raise rule_error("a prepared model is used before it is released", "call hydra_tune.prepare(...) "
                             "again for a new run", kind=RuntimeError, task=self.name)
        if self._ended():
            error = self.handle.error
            if error is not None and not self._told:
                raise error
            if error is not None:  # a later call: the old error again would read as this call's own
                raise rule_error("a prepared model whose task failed is not called again", "prepare the model "
                                 "again (hydra_tune.prepare(model, optimizer)) to go on; an error in a call of the "
                                 "model ends its task, as an error in a ModelTask's unit does", kind=RuntimeError,
                                 task=self.name, failed_with=f"{type(error).__name__}: {error}"[:200]) from error
            raise rule_error("a prepared model's task is running when the model is called", "prepare the model "
                             "again (its task ended: cancelled by the runtime, the study or Tune)",
                             kind=RuntimeError, task=self.name, status=self.handle.status)

    def release(self, wait: bool = True) -> None:
        """End the task (done): the host thread leaves the chain, the runtime frees what it held; ``wait``: until
        it ended (not from garbage collection, which may run in any thread, the task's own included)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        handle = self.handle
        if wait and handle is not None and not handle.done():
            handle.wait(timeout=10)
            if not handle.done():
                handle.cancel()

    # -- segments --------------------------------------------------------------------------------------------
    def segment(self, units: list[tuple[str, Any, Callable[[Device], Any]]], train: bool,
                follows: bool = False) -> Segment:
        """A Segment of ``(kind, shard, run)`` units over the store's batch, each as the loop wraps its units:
        the shard's state in place first (home.use), the run as the task's own work; ``follows``: a training
        forward, whose backward is the loop's next call (Segment.follows)."""
        state = self.state
        home, store, name = state.home, state.store, self.name
        self._made += 1

        def work(run: Callable[[Device], Any], shard: int) -> Callable[[Device], Any]:
            def in_work(d: Device) -> Any:
                with direct():  # a pending per-shard update steps through optimizer.step(): the original one
                    home.use(shard, d)
                with task_work(name):
                    return run(d)
            return in_work

        def pre(ex: Any, kind: str) -> Callable[[Device], int]:
            return lambda d: ex.prefetch(d, store, kind)

        return Segment(name, self._made, tuple(Unit(name, kind, ex.index, self._made, work(run, ex.index),
                                                    pre(ex, kind)) for kind, ex, run in units),
                       train, segment_key(train, store.batch), follows)

    def open_forward(self, train: bool) -> Segment:
        """F0..F(K-1) (``train``) or E0..E(K-1) over ``store.batch``, from the task's RNG state now (kept: a
        retry, and a training forward's backward retried, start from it)."""
        snap = host_rng.retry_point(self.state.rng)
        if train:
            self.forward_snap = snap
        self._attempt = (snap, lambda now: self.segment(self._forward_list(train), train, follows=train))
        return self._attempt[1](None)

    def open_backward(self, out_grads: list[Any]) -> Segment:
        """B(K-1)..B0 from the output's gradients. Retried after a device out-of-memory (its forward's kept
        graphs and carries are gone then): the forward once more from its RNG state, then the backward."""
        state = self.state

        def put() -> None:
            state.store.out_grads[len(state.execs) - 1] = out_grads

        def again(now: dict[str, Any] | None) -> Segment:
            put()
            forward = self._forward_list(True)
            if now is not None:  # the forward draws from Python's generators what it drew; after it they go on
                kind, ex, run = forward[-1]  # from where the user's loop has them (it may have drawn since)
                forward[-1] = (kind, ex, lambda d: (run(d), host_rng.restore(now))[0])
            return self.segment(forward + self._backward_list(), True)
        put()
        self._attempt = (self.forward_snap, again)
        return self.segment(self._backward_list(), True)

    def retry_segment(self, state: Any, plan: Any) -> Segment:
        """``TaskState.retry`` for this task (replan.py, after a device out-of-memory): the segment in flight
        again over ``plan``'s shards, from where it began (RNG, buffers, Python state: ``reset_attempt``)."""
        if self._attempt is None:
            raise RuntimeError(f"task {self.name!r} has no segment in flight to retry")
        snap, rebuild = self._attempt
        now = host_rng.states() if snap[1] is not None else None  # (the backward's retry goes on from here)
        host_rng.back_to(state.rng, snap)
        state.store.reset_attempt()  # buffers and Python state as before the forward (undo kept since then)
        with direct():  # pending per-shard updates are applied first, where their entries are (before the new
            state.home.flush()  # shards are cut: their parameters are plain nn.Parameters again, guard.py)
            state.reshard(plan)
        return rebuild(now)

    def _forward_list(self, train: bool) -> list[tuple[str, Any, Callable[[Device], Any]]]:
        state = self.state
        store, rng = state.store, state.rng
        if train:
            return [("F", ex, lambda d, ex=ex: self._train_forward(d, ex)) for ex in state.execs]
        light = len(state.execs) == 1  # the only shard's eval forward may take the light path (direct.py)
        return [("E", ex, lambda d, ex=ex: ex.forward(d, store, rng, train=False, light=light)) for ex in state.execs]

    def _train_forward(self, device: Device, ex: Any) -> None:
        """F of one shard as the plan says; the last shard's keeps its graph for the backward call when the device
        has room for it beside what it holds (state_cache.py ``room_for_graph``): that B unit then backpropagates
        through it instead of recomputing the forward (a ModelTask's L unit runs that forward once too). The plan's
        peak holds that B unit recomputing this forward (``backward_peak``), and until the B unit no other unit of
        the task runs (one minibatch in flight), so the part of the graph within that unit's peak is room the task
        has already. Its F saves what a recompute needs as well, so the device may drop the graph when another task
        needs the room (held_graphs.py), or the backward run on another device, and B recomputes instead."""
        state = self.state
        store, rng, plan = state.store, state.rng, state.plan
        index = ex.index
        cache = device.states
        shard = plan.shards[index]
        nbytes = shard.kept_bytes
        if (index == len(state.execs) - 1 and plan.may_keep() and cache is not None
                and cache.room_for_graph(nbytes, reserved=min(nbytes, shard.backward_peak))):
            ex.forward(device, store, rng, keep=True, droppable=True, light=index == 0)
            cache.hold_graph(store, index, nbytes)
            return
        ex.forward(device, store, rng, keep=plan.keeps(index), offload=plan.offloads(index))

    def _backward_list(self) -> list[tuple[str, Any, Callable[[Device], Any]]]:
        state = self.state
        store, rng = state.store, state.rng
        return [("B", ex, lambda d, ex=ex: ex.backward(d, store, rng)) for ex in reversed(state.execs)]


def float_leaf(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
