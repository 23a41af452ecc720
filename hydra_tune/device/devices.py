"""Device discovery, budgets, memory measurement and RNG scoping per unit: the base class and CPU stand-ins (CUDA
devices: cuda.py).

    devices = resolve_devices(["cpu", "cpu"], 64 << 20)      # two CPU stand-ins for two GPUs (resolve.py)
    with devices[0].unit_scope(task_rng) as mode: ...        # run one unit: measured memory, task's RNG stream
    devices[0].peak_bytes() <= devices[0].budget

CPU devices measure memory with the runtime's own accounting (device/dispatch.py: every storage created while a
unit runs on the device, until it is freed); CUDA devices with ``torch.cuda`` memory statistics. Discovery uses
NVML (pynvml, imported lazily) for free memory and falls back to ``torch.cuda``. A task's random streams are
``TaskRNG`` (device/rng.py); host<->device copies are the device's ``copier`` (device/streams.py).
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..errors import rule_error
from . import dispatch
from .dispatch import MemoryAccount, UnitMode, router_for
from .draws import ROUTED, OutermostCall
from .measured import COUNT, KNOWN, PENDING, Measurements
from .offload import releases_graphs
from .quiet import QuietUnits, UnroutedDraw
from .rng import TaskRNG
from .seeding import seeding_to
from .streams import CudaCopier, HostCopier, make_copier

_NULL = contextlib.nullcontext()  # (reusable)


class Device:
    """One execution device: a worker thread runs one unit at a time on it.

    Lifecycle: created by ``resolve_devices``; for every unit the worker enters ``unit_scope(rng)``,
    copies in with ``copier``, computes, copies out, leaves the scope; ``peak_bytes()`` reports the measured peak.
    """

    def __init__(self, name: str, torch_device: torch.device, budget: int | None) -> None:
        self.name = name
        self.torch_device = torch_device
        self.budget = budget
        self.copier: HostCopier = make_copier(torch_device)
        self.overhead = 0  # bytes the device holds before any unit (library workspaces), set by start()
        self.resident: Any = None  # the runtime's ShardCache for this device (shard copies made ahead of use)
        self.states: Any = None  # the runtime's StateCache (training/resident.py): tasks' state kept here; None: off
        self.copy_bandwidth: float | None = None  # bytes/s host<->device, measured by start()
        self.measuring = False  # count this segment's allocations op by op (CPU stand-ins, see measure())
        self.quiet: QuietUnits | None = None  # CPU stand-ins: segments that run with no RNG routing (quiet.py)
        # Kept and offloaded forwards free storages their graph still references (resize_(0)) and refill them
        # for the backward: see releases_graphs() for CUDA.
        self.releases_graphs = releases_graphs(torch_device.type)
        # Whether a task's fp16 GradScaler (torch.amp.GradScaler("cpu"), in host memory) may unscale and step
        # gradients on this device. Not on CUDA: its update() copies found_inf device->host non-blocking into
        # page-locked memory and reads it at once, so fp16 tasks keep their state in host memory there.
        self.steps_loss_scaler = torch_device.type == "cpu"
        # Whether another thread than the worker may run this device's units (runtime/lend.py, in lent.py's
        # scope). Not on CUDA: the worker's current device and stream are its thread's.
        self.units_any_thread = torch_device.type == "cpu"

    def start(self, elsewhere: Sequence[Callable[[Callable[[], None]], Any]] = ()) -> None:
        """Called once in the device's worker thread before its first unit; ``elsewhere``: one callable per other
        runtime thread that works on this device (the copy thread), running a function there and waiting."""
        self.copy_bandwidth = self._measure_bandwidth()
        self.overhead = self.warm_up(elsewhere)
        self.copier.counts.reset()  # the counters are the tasks' copies and waits, not this measurement's

    def warm_up(self, elsewhere: Sequence[Callable[[Callable[[], None]], Any]] = ()) -> int:
        """Run a warm-up unit in this thread and in each of ``elsewhere``'s, then return the bytes the device holds:
        its start-up overhead (what no unit's plan may use).

            device.overhead = device.warm_up([lambda fn: copy_pool.submit(fn).result()])

        Rule: every runtime thread that runs device work has run a forward and a backward first, so the library
        workspaces each thread (and autograd's device thread, which runs the backward) makes on first use are in
        the overhead, not in the first unit's peak: the one CUDA run had the copy thread's and autograd's cuBLAS
        workspaces (0.1 MiB) push a measured peak over its budget."""
        self._warm_unit()
        for run in elsewhere:
            run(self._warm_unit)
        return self._held_bytes()

    def _warm_unit(self) -> None:
        """One small forward and backward on this device, in the calling thread (CPU stand-ins: nothing to make)."""

    def _held_bytes(self) -> int:
        """What the device holds outside any unit now; its peak counter starts again from here."""
        return 0

    def after_oom(self) -> None:
        """Called after a unit ran out of memory and its tensors were dropped, before the task is re-planned."""

    def _measure_bandwidth(self, nbytes: int = 16 << 20) -> float:
        """Host -> device -> host copy rate into ready buffers (best of 3): what offloading activations costs per
        byte once the allocator has warmed up. Plain tensors, freed before the device's overhead is read."""
        host = torch.ones(nbytes // 4)
        dev = torch.empty_like(host, device=self.torch_device)
        back = torch.empty_like(host)
        best = float("inf")
        for _ in range(3):
            self.copier.synchronize()
            t0 = time.perf_counter()
            dev.copy_(host)
            back.copy_(dev)
            self.copier.synchronize()
            best = min(best, (time.perf_counter() - t0) / 2)
        del dev
        return nbytes / best

    @property
    def plan_budget(self) -> int | None:
        """What the planner may give one unit: the budget less the device's own overhead."""
        return None if self.budget is None else self.budget - self.overhead

    def unit_scope(self, rng: TaskRNG) -> contextlib.AbstractContextManager[UnitMode | None]:
        raise NotImplementedError

    def limit_memory(self, nbytes: int | None) -> None:
        """Test-only: an allocation that would take this device's accounted bytes past ``nbytes`` raises
        ``torch.OutOfMemoryError``, as CUDA does when memory runs out (None: no limit). Every segment is then
        counted op by op, so the limit applies to all of them."""
        self.account.limit = nbytes

    def would_measure(self, key: Any) -> bool:
        """Whether ``measure(key)`` would say so now, without its effects (a unit run outside a segment:
        training/light_run.py). CUDA: never."""
        return False

    def measure(self, key: Any, task: str | None = None) -> bool:
        """Whether the segment about to run (``key``: task or class, and input shapes) must be measured op by op,
        for ``task``; the caller sets ``measuring`` to the answer. CUDA measures itself: never."""
        return False

    def segment_done(self) -> None:
        """The segment ``measure`` was last asked about ran whole on this device (what it counted holds now)."""

    def shares(self, key: Any, task: str) -> bool:
        """Whether ``task`` may run segment ``key`` of its class of equal tasks (training/measure_class.py) as the
        class was measured (on this device or, CPU stand-ins, another of its runtime's: measured.py). Never: a device
        that measures nothing (CUDA) keeps its records by task."""
        return False

    def forget(self, task: str) -> None:
        """``task`` ended: drop what ``measure`` learned of it (a later task may take its name)."""

    def profile_device(self) -> Device | None:
        """Where the memory model measures stages for this device (None: the CPU profile holds for it)."""
        return None

    def copy_scope(self) -> contextlib.AbstractContextManager[Any]:
        """Where the device's copy engine (the prefetch thread) makes device copies: counted, no RNG swap."""
        raise NotImplementedError

    def refill_scope(self) -> contextlib.AbstractContextManager[Any]:
        """Where released device copies get their bytes back (``copier.refill``, which counts them itself)."""
        return self.copy_scope()

    def step_scope(self) -> contextlib.AbstractContextManager[Any]:
        """Where a task's host thread runs its optimizer step over tensors on this device."""
        return _NULL

    def stage_scope(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """Around one stage's call inside a unit (CPU stand-ins: routing by stage, device/quiet.py)."""
        return _NULL

    def scoped_stages(self) -> frozenset[str] | None:
        """The stages whose calls need ``stage_scope`` in the unit about to run (every other stage runs with
        nothing around it), or None: ask ``stage_scope`` for every stage."""
        return frozenset()

    def unrouted_draw(self, stage: str) -> BaseException:
        """The error for a draw from torch's global CPU generator in stage ``stage``, made while the unit's function
        modes were set aside for a module's inference fast path (fastpath.py). A device with no mode that routes
        every draw (CUDA) cannot give it the task's stream: the error names the fix."""
        return rule_error("a stage holding a module with torch's inference fast path (nn.MultiheadAttention, "
                          "nn.TransformerEncoderLayer) in eval mode draws no CPU random numbers on this device",
                          "draw on the GPU (device=...) in that stage, or call "
                          "torch.backends.mha.set_fastpath_enabled(False) before training (then the stage runs "
                          "routed, as every other)", kind=RuntimeError, stage=stage, device=self.name)

    def hold(self, tensors: Sequence[torch.Tensor]) -> None:
        """Count ``tensors`` (made outside any unit, e.g. by an optimizer step on this device) as this device's
        memory until they are freed. CUDA counts every allocation itself: nothing to do."""

    def hold_storages(self, storages: Sequence[torch.UntypedStorage]) -> None:
        """``hold`` for storages (one call for many: no tensor per storage needed). CUDA: nothing to do."""

    def peak_bytes(self) -> int:
        raise NotImplementedError

    def current_bytes(self) -> int:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"Device({self.name!r}, budget={self.budget})"


class CpuDevice(Device):
    """A CPU stand-in for a GPU: its memory is whatever its units allocate, counted by a MemoryAccount."""

    def __init__(self, name: str, budget: int | None, records: Measurements | None = None) -> None:
        super().__init__(name, torch.device("cpu"), budget)
        self.account = MemoryAccount()
        self.copier = make_copier(self.torch_device, self.account)
        self._scratch = torch.Generator()
        self.measuring = True
        # what counting segments taught, shared by the runtime's CPU stand-ins (measured.py; resolve.py makes one)
        self.records = records if records is not None else Measurements()
        self._again: set[Any] = set()  # keys this device counts itself next (a guarded PENDING unit drew)
        self._task: Any = None
        self._key: Any = None
        self._pending = False  # the segment running is counted on another device now (measured.py PENDING)
        self._counting: Any = None  # the key this device counts now
        self.quiet = QuietUnits(self.records)  # segment keys measured to draw nothing: run with no router (quiet.py)

    def limit_memory(self, nbytes: int | None) -> None:
        """Test-only: an allocation that would take this device's accounted bytes past ``nbytes`` raises
        ``torch.OutOfMemoryError``, as CUDA does when memory runs out (None: no limit). Every segment is then
        counted op by op, so the limit applies to all of them."""
        self.account.limit = nbytes

    def would_measure(self, key: Any) -> bool:
        return self._verdict(key) == COUNT

    def _verdict(self, key: Any) -> str:
        verdict = self.records.verdict(key, self._again, self.account.limit is not None)
        # a PENDING unit is guarded by the global generator's state, which tells nothing once a task lent it
        return COUNT if verdict == PENDING and dispatch.lent_global() else verdict

    def measure(self, key: Any, task: str | None = None) -> bool:
        # Counting every op costs a Python call per aten op. A segment repeats the allocations of an earlier
        # one with the same task (or class of equal tasks: training/measure_class.py) and input shapes exactly,
        # so each distinct one is counted once: the device's peak is the peak over them (what else the device
        # held while an uncounted one ran is not in it). Memory held across segments (prefetched shards) is always
        # counted. A task whose counted units drew random numbers the light router does not know keeps the full
        # mode. A key another of the runtime's CPU stand-ins counted (or counts now) is not counted here
        # (measured.py): the peak that device counted for it is this one's too.
        verdict = self._verdict(key)
        self._task, self._key = (key[0] if isinstance(key, tuple) else key), key
        self._pending, self._counting = verdict == PENDING, None
        self.quiet.begin_segment()
        if verdict == KNOWN:
            peak = self.records.peak(key, self.name)
            if peak:  # (counted on another device: this one's peak has not seen it)
                self.account.note(peak)
            return False
        if verdict == COUNT:
            self._again.discard(key)
            self.records.begin(key, task)
            self._counting = key
            self.account.window()
        return verdict == COUNT

    def segment_done(self) -> None:
        key, self._counting = self._counting, None
        if key is not None:
            self.records.done(key, self.account.high, self.name)

    def shares(self, key: Any, task: str) -> bool:
        # not measured yet (the asking task measures it for its class), measured by ``task`` itself (as a key of its
        # own: what it would run on anyway), being measured on another device (run guarded meanwhile), or measured
        # with every draw inside a stage it routes and none the router does not know: its units then run quiet,
        # guarded (quiet.py), so a task of the class that draws elsewhere is caught and rerun, never wrong. Else
        # each task is measured as its own.
        return self.records.shares(key, task, self.quiet.allows(key))

    def sync(self) -> None:
        """Wait for the work queued on this device (a CPU stand-in's is done)."""

    def forget(self, task: Any) -> None:
        # (a task's name; classes fall out of the records by themselves: measured.py MEASURED_CLASSES)
        # Else a later task of that name and batch shapes would skip being measured, and could run on the light
        # router with a random op it does not know; and the records would grow with every task the runtime saw.
        self.records.forget(task)
        self._again = {k for k in self._again if not (isinstance(k, tuple) and k[0] == task)}

    def unit_scope(self, rng: TaskRNG) -> contextlib.AbstractContextManager[UnitMode | None]:
        if self.measuring:
            return self._counted(rng)
        if self.quiet.allows(self._key):  # (returned as it is: one block less per unit)
            return self.quiet.guarded(self._key, rng)
        if self._pending:
            return self._routed_guarded(rng)
        return self._routed(rng)

    @contextlib.contextmanager
    def _counted(self, rng: TaskRNG) -> Iterator[UnitMode]:
        with UnitMode(rng.cpu, self.account) as mode, OutermostCall() as mode.outermost, seeding_to(rng):
            with self.quiet.measuring(self._key, mode) if self._key is not None else contextlib.nullcontext():
                yield mode
        if mode.seeded - ROUTED:
            self.records.note_unrouted(self._task)

    @staticmethod
    @contextlib.contextmanager
    def _routed(rng: TaskRNG) -> Iterator[None]:
        with router_for(rng), seeding_to(rng):
            yield None

    @contextlib.contextmanager
    def _routed_guarded(self, rng: TaskRNG) -> Iterator[None]:
        """A unit of a segment another device is counting now (measured.py PENDING): routed, and guarded as a quiet
        unit is, since whether all its draws are ones the router knows is not known yet."""
        before = dispatch.global_rng_state()
        with router_for(rng), seeding_to(rng):
            yield None
        if not dispatch.unmoved(before):  # (the unit's own error, raised above, is what its retry handles)
            key, self._pending = self._key, False
            self._again.add(key)  # its rerun is counted here (a needless one, if another thread drew: never wrong)
            self.quiet.counts["reruns"] += 1
            raise UnroutedDraw(f"a unit of segment {key!r}, counted on another device meanwhile, drew from torch's "
                               "global CPU generator; it runs again counted, its draws routed to the task's stream")

    def copy_scope(self) -> contextlib.AbstractContextManager[Any]:
        return UnitMode(self._scratch, self.account)  # clones count as this device's memory

    def refill_scope(self) -> contextlib.AbstractContextManager[Any]:
        return _NULL  # a refill makes no storage (HostCopier.refill counts the refilled one); a mode: ~20 us an op

    def stage_scope(self, name: str) -> contextlib.AbstractContextManager[Any]:
        return self.quiet.stage_scope(name)  # type: ignore[union-attr]

    def scoped_stages(self) -> frozenset[str] | None:
        return self.quiet.scoped_stages()

    def unrouted_draw(self, stage: str) -> BaseException:
        # the task's units run counted from now on: UnitMode routes every draw, with our function modes aside too
        self.records.note_unrouted(self._task)
        self.quiet.counts["fast_path_reruns"] += 1
        return UnroutedDraw(f"stage {stage!r} drew from torch's global CPU generator while a module's inference "
                            "fast path ran without the router (fastpath.py); the minibatch runs again counted, "
                            "its draws routed to the task's stream")

    def hold(self, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            self.account.track(t.untyped_storage(), enforce=False)  # already made: counted, never refused

    def hold_storages(self, storages: Sequence[torch.UntypedStorage]) -> None:
        self.account.track_many(storages)

    def peak_bytes(self) -> int:
        return self.account.peak

    def current_bytes(self) -> int:
        return self.account.current

    def start(self, elsewhere: Sequence[Callable[[Callable[[], None]], Any]] = ()) -> None:
        # A CPU stand-in's copies are host memory copies: their rate is the process's, measured once (each runtime
        # measuring again would cost ~0.1 s per start on a busy machine, a tenth of a small trial).
        with _CPU_RATE_LOCK:
            if not _CPU_RATE:
                _CPU_RATE.append(self._measure_bandwidth())
        self.copy_bandwidth = _CPU_RATE[0]
        self.overhead = self.warm_up(elsewhere)
        self.copier.counts.reset()  # the counters are the tasks' copies and waits, not this measurement's


class ProfileDevice(CpuDevice):
    """Where a task's stages are measured for the memory model when its devices are GPUs: a private device on
    ``torch_device`` whose memory is what the stage running in this thread allocates there, counted op by op as a
    CPU stand-in counts it (other threads' units on the same GPU do not count), rounded as CUDA's caching
    allocator rounds. The GPU's own kernels decide what is saved (fused attention saves far less than the CPU's
    math path), so the plan predicts the device's units, not the CPU's.

        costs = measure_costs(cut, batch, device=cuda_device)   # profile.py makes one of these

    Random draws on the GPU come from its default generator, which the profile forks and puts back."""

    def __init__(self, torch_device: torch.device) -> None:
        super().__init__("profile", None)
        self.torch_device = torch_device
        self.account = MemoryAccount(types=(torch_device.type,), granule=512 if torch_device.type == "cuda" else 1)
        self.copier = HostCopier(torch_device, self.account)  # plain copies onto the GPU, counted
        if torch_device.type == "cuda":  # the runtime's copier leaves tensors this small on the GPU: so here
            self.copier.offload_min_bytes = CudaCopier.offload_min_bytes

    def sync(self) -> None:
        if self.torch_device.type == "cuda":  # a forward's measured time is its kernels', not their launches'
            torch.cuda.synchronize(self.torch_device)


_CPU_RATE: list[float] = []  # the CPU stand-ins' copy rate, bytes/s, once measured
_CPU_RATE_LOCK = threading.Lock()
