"""The runtime's host-memory gate: each submitted task's footprint is estimated, then the task is admitted, waits, or
is rejected; a thread of the gate's own starts waiting tasks, first come first served, as admitted ones end.

    gate = HostGate(budget, plan, hooks); gate.start()   # budget: host_memory in bytes, None: measured
    handle, footprint, state = gate.submit(task)   # handle: the task waits for memory (None: admitted, start it)
    gate.release(name)                             # an admitted task ended: its footprint is free again

The rules are policy/admission.py's; the footprints training/footprint.py's. At submit, the task's parameters,
gradients and optimizer state are measured on the meta device (no forward: cheap). If that fits what is free and
nobody waits, that much is reserved, the task is built in the caller (the build allocates only its parameters,
and measures and plans it), and its own plan adds the activations: it is admitted if the total still fits. Otherwise (it
does not fit, others wait, or its activations tipped it over) its activations are bounded on the meta device
too, and it waits unbuilt, or is rejected when it could never fit. (A task whose model cannot be built on the
meta device is built at submit to be measured, and waits built.)

Only a waiting task defers its errors: it is built when it is admitted, in the gate's thread, and what that
build raises (a plan error, a factory's error) ends its handle (``handle.result()`` raises it). A task admitted
at submit is built in the caller, whose submit raises.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..device.threads import adopt_thread_count
from ..errors import RuntimeClosed, TaskCancelled, detach_frames, rule_error
from ..policy.admission import HostAdmission, measured_capacity
from ..task import ModelTask
from ..training.footprint import Footprint, Unmeasurable, estimate_footprint, footprint_of_state, state_footprint
from ..training.state import TaskState
from .handle import TaskHandle

_Waiting = tuple[TaskHandle, ModelTask, Footprint, "TaskState | None"]


@dataclass(frozen=True)
class GateHooks:
    """What the gate asks of its runtime. ``handle(name)``: a new handle for a task that waits. ``held()``: the
    host bytes each admitted task holds now (by name). ``start(handle, task, footprint, state)``: build an
    admitted waiting task (unless built) and queue it for the devices; raises when it cannot start."""

    handle: Callable[[str], TaskHandle]
    held: Callable[[], dict[str, int]]
    start: Callable[[TaskHandle, ModelTask, Footprint, "TaskState | None"], Any]
    room: Callable[[int], bool] | None = None  # drop this many bytes kept for later tasks; True if any went


class HostGate:
    """Host-memory admission for one runtime (``Runtime(host_memory=...)``). ``plan``: the arguments every task
    is built with after ``TaskState.build(task, ...)`` (budget, copy bandwidth, whether graphs may be kept).

    Lock order: the gate's lock may be held while ``hooks.held`` takes the runtime's; the runtime never calls the
    gate while holding its own lock.
    """

    def __init__(self, budget: int | None, plan: tuple[int | None, float | None, bool], hooks: GateHooks) -> None:
        self.host = HostAdmission(budget)
        self._plan, self._hooks = plan, hooks
        self.profile_on: Any = None  # the device tasks are profiled on (GPUs; set by the runtime), None: the CPU
        # each build's model before it is measured (set by the runtime: raises if a running task trains it)
        self.claim: Callable[[str, Any], None] | None = None
        self._cv = threading.Condition()  # guards host and _waiting; the runtime's lock is never taken inside it
        self._waiting: dict[str, _Waiting] = {}
        self._building: TaskHandle | None = None  # the waiting task the gate's thread is building now
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hydra-admit", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def footprint(self, task: ModelTask) -> tuple[Footprint, TaskState | None]:
        """``task``'s footprint from its meta-device build; when that cannot run (a factory that needs real
        tensors, a model over the device budget, no data, ...), from the task built here for real (its errors
        raise now) together with that state."""
        try:
            return estimate_footprint(task, *self._plan), None
        except Unmeasurable:
            state = TaskState.build(task, *self._plan, device=self.profile_on, claim=self.claim)
            return footprint_of_state(state), state

    def submit(self, task: ModelTask) -> tuple[TaskHandle | None, Footprint, TaskState | None]:
        """Estimate and decide ``task``: a handle when it waits; None when it is admitted (the caller starts it,
        and releases it if that fails); raises when it could never fit."""
        try:
            base = state_footprint(task)
        except Unmeasurable:  # its model cannot be built on the meta device: built here, measured, then decided
            state = TaskState.build(task, *self._plan, device=self.profile_on, claim=self.claim)
            footprint = footprint_of_state(state)
        else:
            with self._cv:
                self._check_open()
                reserved = self.host.reserve(task.name, base.total, *self._now())
                if not reserved and self._room(base.total):
                    reserved = self.host.reserve(task.name, base.total, *self._now())
            if reserved:
                built = self._build_reserved(task, base)
                if built is not None:
                    return None, *built
            footprint, state = self.footprint(task)
        with self._cv:
            self._check_open()
            self._room(footprint.total)  # frozen weights kept for later tasks go first if it needs the room
            capacity, held = self._now()
            verdict = self.host.offer(task.name, footprint.total, capacity, held)
            if verdict == "queue":
                handle = self._hooks.handle(task.name)
                self._waiting[task.name] = (handle, task, footprint, state)
                self._cv.notify_all()
                return handle, footprint, state
        if verdict == "reject":
            raise self._never_fits(task.name, footprint, capacity)
        return None, footprint, state

    def _build_reserved(self, task: ModelTask, base: Footprint) -> tuple[Footprint, TaskState] | None:
        """Build a task admitted for its state part; its plan's activations added, keep it if it still fits."""
        try:
            state = TaskState.build(task, *self._plan, device=self.profile_on, claim=self.claim)
            footprint = footprint_of_state(state, (base.optimizer, base.optimizer_measured))
        except BaseException:
            self.release(task.name)
            raise
        with self._cv:
            if self.host.resize(task.name, footprint.total, *self._now()):
                return footprint, state
            self.host.release(task.name)
            self._cv.notify_all()
        return None  # its activations do not fit now: dropped, it waits (or is rejected) unbuilt

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeClosed("the runtime is open, but got (closed=True). Fix: submit to a new Runtime.")

    def recharge(self, charges: dict[str, int]) -> None:
        """Charge these admitted tasks (and the pool of shared frozen weights, ``SHARED_POOL``) new footprints:
        shared bytes are charged once, to the pool."""
        with self._cv:
            for name, footprint in charges.items():
                self.host.set_charge(name, footprint)
            self._cv.notify_all()

    def release(self, name: str) -> None:
        with self._cv:
            self.host.release(name)
            self._cv.notify_all()

    def withdraw(self, handle: TaskHandle, error: BaseException) -> bool:
        """End ``handle``'s task if it is waiting (cancelled, or the runtime closing); False if it is not. One the
        gate's thread is building ends at once too (its build may be stuck in its data), but False: the build may
        have put it on the board already."""
        with self._cv:
            entry = self._waiting.get(handle.name)
            waiting = entry is not None and entry[0] is handle
            building = not waiting and handle is self._building
            if waiting:
                del self._waiting[handle.name]
                self.host.withdraw(handle.name)
                self._cv.notify_all()  # the task behind it may fit now
            if waiting or building:
                handle.cancel_requested = True  # a building one: the board refuses it when its build returns
        if waiting or building:
            handle.finish("cancelled", error)
        return waiting

    def close(self, timeout: float | None = None) -> str | None:
        """Stop the thread (a build in progress ends first, within ``timeout`` seconds; its task sees the runtime
        closed) and end every waiting task with RuntimeClosed. Returns the name of a task whose build did not end
        in time (stuck in its data): it is ended now and the thread left behind."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        for handle, *_ in list(self._waiting.values()):
            self.withdraw(handle, RuntimeClosed(f"the runtime was closed before task {handle.name!r} started"))
        with self._cv:
            stuck = self._building if self._thread.is_alive() else None
        if stuck is not None:
            self.withdraw(stuck, RuntimeClosed(f"the runtime was closed before task {stuck.name!r} started"))
        return None if stuck is None else stuck.name

    def snapshot(self) -> dict[str, Any]:
        """What ``Runtime.host_memory()`` reports."""
        with self._cv:
            capacity, held = self._now()
            return {"budget": capacity, "measured": self.host.measured, "admitted_bytes": self.host.charged(held),
                    "free": self.host.free(capacity, held), "admitted": dict(self.host.admitted),
                    "waiting": dict(self.host.waiting)}

    def waiting_stats(self) -> dict[str, dict[str, Any]]:
        with self._cv:
            return {name: {"state": "queued", "waiting_for_host_memory": True, "host_footprint": fp.parts()}
                    for name, (_, _, fp, _) in self._waiting.items()}

    # -- inside ---------------------------------------------------------------------------------------------
    def _now(self) -> tuple[int, dict[str, int]]:
        """(capacity, host bytes each admitted task holds): the fixed budget and nothing, or measured now."""
        if not self.host.measured:
            return self.host.budget, {}  # type: ignore[return-value]
        held = self._hooks.held()
        return measured_capacity(sum(held.values())), held

    def _room(self, footprint: int) -> bool:
        """Under the lock: when ``footprint`` does not fit what is free, drop what the runtime keeps for later
        tasks (frozen weights retained after their last task) to make the room; True when some went."""
        if self._hooks.room is None:
            return False
        need = footprint - self.host.free(*self._now())
        return need > 0 and self._hooks.room(need)

    def _run(self) -> None:
        adopt_thread_count()
        while True:
            with self._cv:
                while True:
                    if self._closed:
                        return  # close() ends the waiting tasks
                    turn, capacity = None, 0
                    if self.host.waiting:
                        self._room(next(iter(self.host.waiting.values())))
                        capacity, held = self._now()
                        turn = self.host.next(capacity, held)
                    if turn is not None:
                        break
                    # A fixed budget frees up only when a task ends (release notifies); measured memory also when
                    # other processes free theirs, so look again now and then.
                    self._cv.wait(1.0 if self.host.measured and self.host.waiting else None)
                verdict, name = turn
                handle, task, footprint, state = self._waiting.pop(name)
                self._building = handle if verdict != "reject" else None
            if verdict == "reject":
                handle.finish("failed", self._never_fits(name, footprint, capacity))
                continue
            try:
                self._hooks.start(handle, task, footprint, state)
            except BaseException as exc:  # its build failed, or it was cancelled or the runtime closed meanwhile
                self.release(name)
                detach_frames(exc, name)
                handle.finish("cancelled" if isinstance(exc, (TaskCancelled, RuntimeClosed)) else "failed", exc)
            with self._cv:
                self._building = None
            del handle, task, state  # a failed build's model must not outlive it here

    def _never_fits(self, name: str, fp: Footprint, capacity: int) -> Exception:
        return rule_error(
            "`task host footprint <= host_memory`", "train a smaller model or smaller batches, use an optimizer "
            "with less state (SGD keeps none, SGD with momentum one copy of the parameters, Adam two), or give the "
            "runtime more host memory (Runtime(host_memory=...), or free memory on the machine)", task=name,
            footprint=fp.total, params=fp.params, grads=fp.grads, optimizer=fp.optimizer,
            activations=fp.activations, overhead=fp.overhead, host_memory=capacity, measured=self.host.measured)
