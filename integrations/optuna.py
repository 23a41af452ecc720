"""Optuna integration: ``hydra_tune.optuna_study`` runs a study's concurrent trials on one shared runtime.

    study = hydra_tune.optuna_study(direction="minimize", pruner=optuna.pruners.MedianPruner(), devices="auto",
                                    host_memory="32GiB")      # or config=hydra_tune.RuntimeConfig(...)
    study.optimize(objective, n_trials=16)     # objective: `for m in hydra_tune.train(task): trial.report(...)`
    print(study.best_params, study.runtime_stats()["devices"])

Shape:
  * ``optuna_study(**create_study_kwargs)`` builds the study with ``optuna.create_study`` (so every argument means
    what it means there) and returns a ``HydraStudy``, an ``optuna.Study`` whose sampler is a ``HydraSampler``:
    it delegates all sampling to the user's sampler (TPE by default) and, in ``after_trial`` (which Optuna calls
    for every ending trial: complete, pruned, failed, ``study.tell``), cancels and frees the trial's tasks.
  * Runtime: made from a ``RuntimeConfig`` (``config=``, or its keywords ``devices``, ``device_memory``,
    ``host_memory``, ``policy``), validated before the study is created. In-memory storage -> one in-process
    ``hydra_tune.Runtime`` owned by the study. A persistent storage (RDB URL, journal file) means other processes
    may work on the study too -> the node's runtime server (``hydra_tune.node``: one per user and runtime
    configuration, shared by every process on the node, started by the first one; a process that dies has its
    tasks cancelled by the server at once). ``share=`` overrides ("spread": a node server per device).
  * Grouping: ``optimize`` runs ``n_jobs`` trials at once in threads (Optuna's own mechanism); every trial's
    ``hydra_tune.train(task)`` submits to the study's runtime, whose scheduler interleaves all their shards on
    all devices. Without ``n_jobs`` the study runs ``study.concurrency`` trials at once: ``trials_per_device``
    (default 2) per device — one computing, one doing its host-side optimizer step and prefetch — which keeps
    every device busy without sampling more trials blind than needed. Ask/tell batches:
    ``handles = [study.submit(t, task_for(t)) for t in trials]``.
  * String RDB URLs get Optuna's heartbeat (``heartbeat_interval``, default 10 s): a killed process's running
    trials are marked failed by ``fail_stale_trials`` (Optuna runs it before each trial).
"""
from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import optuna
from optuna.samplers import BaseSampler
from optuna.storages import BaseStorage, InMemoryStorage
from optuna.trial import FrozenTrial, Trial, TrialState

from hydra_tune import api
from hydra_tune.config import RuntimeConfig
from hydra_tune.errors import rule_error
from hydra_tune.prepare.streams import trial_stream
from hydra_tune.runtime.progress import ProgressLog, progress_seconds
from hydra_tune.runtime.runtime import Runtime
from hydra_tune.task import ModelTask

from ._optuna_storage import creating, study_storage
from ._versions import require

require("optuna", optuna.__version__)   # a clear ImportError outside the tested range

__all__ = ["optuna_study", "HydraStudy", "HydraSampler"]

SHARE = ("auto", "process", "node", "spread")
CANCEL_WAIT = 60.0   # seconds a trial's end waits for its cancelled tasks to stop (one unit, normally far less)


class _TrialTasks:
    """Which live tasks each running trial of one study submitted, by trial number (unique within a study);
    ``release`` cancels them when the trial ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, list[Any]] = {}
        self._ended: set[int] = set()
        self.names: dict[int, list[str]] = {}   # trial number -> names of the tasks it submitted
        self.cancelled = 0                       # tasks that ended cancelled because their trial ended first

    def add(self, number: int, handle: Any) -> None:
        with self._lock:
            late = number in self._ended
            if not late:
                self._live.setdefault(number, []).append(handle)
            self.names.setdefault(number, []).append(handle.name)
        if late:   # the trial ended while its task was being planned
            self._cancel([handle])

    def release(self, number: int) -> None:
        with self._lock:
            self._ended.add(number)
            handles = self._live.pop(number, [])
        self._cancel(handles)

    def release_all(self) -> None:
        with self._lock:
            handles = [h for hs in self._live.values() for h in hs]
            self._live.clear()
        self._cancel(handles)

    def _cancel(self, handles: list[Any]) -> None:
        ended = [h for h in handles if not h.done()]
        for h in ended:
            h.cancel()
        for h in ended:   # a running task stops at its unit boundary: once the trial is over, so is its task
            try:
                h.result(timeout=CANCEL_WAIT)
            except TimeoutError:
                warnings.warn(f"hydra_tune task {h.name!r} did not stop within {CANCEL_WAIT} s of its trial's end; "
                              "it will be freed when its current unit returns", RuntimeWarning, stacklevel=2)
            except BaseException:  # noqa: BLE001  (TaskCancelled, or the task's own error: the trial is over)
                pass
        # Counted once ended: a task the objective's own `ht.train` loop cancelled as it raised (a pruned trial),
        # which ends at once when it is not on a device, counts as one its trial's end cancelled.
        with self._lock:
            self.cancelled += sum(h.status == "cancelled" for h in handles)


class HydraSampler(BaseSampler):
    """Delegates every sampling decision to ``base``; when a trial ends, cancels and frees its tasks.

        sampler = HydraSampler(optuna.samplers.TPESampler(seed=0))
        sampler.base                        # the user's sampler, untouched
        # after_trial(...) -> base.after_trial(...), then the trial's hydra_tune tasks are cancelled

    ``optuna_study`` makes it, one per study (it knows trials by number); you need not build one yourself.
    """

    def __init__(self, base: BaseSampler, tasks: _TrialTasks | None = None) -> None:
        if not isinstance(base, BaseSampler):
            raise rule_error("`sampler` is an optuna.samplers.BaseSampler or None", "pass e.g. "
                             "optuna.samplers.TPESampler(seed=0), or None for TPE", kind=TypeError,
                             sampler=type(base).__name__)
        self.base = base
        self.tasks = tasks if tasks is not None else _TrialTasks()

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, Any]:
        return self.base.infer_relative_search_space(study, trial)

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, Any]) -> dict:
        return self.base.sample_relative(study, trial, search_space)

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: Any) -> Any:
        return self.base.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.base.before_trial(study, trial)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        try:
            self.base.after_trial(study, trial, state, values)
        finally:   # every way a trial ends comes through here (optimize, tell, KeyboardInterrupt)
            self.tasks.release(trial.number)

    def reseed_rng(self) -> None:
        self.base.reseed_rng()

    def __str__(self) -> str:
        return f"HydraSampler({self.base})"


class HydraStudy(optuna.Study):
    """An ``optuna.Study`` whose trials train on a shared hydra_tune runtime.

        study = hydra_tune.optuna_study(direction="minimize")
        study.optimize(objective, n_trials=8)             # n_jobs defaults to study.concurrency
        trial = study.ask(); handle = study.submit(trial, task); study.tell(trial, handle.result()["eval_loss"])

    Lifecycle: the study owns its runtime (or its connection to the node's runtime server) unless one was passed
    in; ``close()`` (or the end of a ``with`` block, or interpreter exit) cancels what its trials still run and
    releases it. A trial's tasks are cancelled the moment the trial ends, whatever way its objective exits.
    """

    def __init__(self, base: optuna.Study, storage: BaseStorage, runtime: Any, owns_runtime: bool,
                 trials_per_device: int = 2, progress: float | None = None,
                 local: RuntimeConfig | None = None) -> None:
        """``base``: the study ``optuna.create_study`` made on ``storage`` (the storage object it was given);
        ``progress``: seconds between status lines of ``runtime.stats()`` logged here (None: none); ``local``: the
        settings of a runtime in this process for prepared models (hydra_tune.prepare), made at the first one, when
        ``runtime`` is node servers (a prepared model is driven by this process's loop: it cannot train there)."""
        sampler = base.sampler
        if not isinstance(sampler, HydraSampler):
            sampler = HydraSampler(sampler)
        super().__init__(base.study_name, storage, sampler, base.pruner)
        self.sampler: HydraSampler
        self.runtime = runtime
        self.trials_per_device = trials_per_device
        self._owns = owns_runtime
        log = ProgressLog(runtime.stats, progress) if progress is not None else None
        spread = getattr(runtime, "nodes", None) is not None   # a node.spread pool
        self._local = _LocalRuntime(local, "spread" if spread else "node") if local is not None else None
        self._closer = weakref.finalize(self, _close_runtime, runtime if owns_runtime else None, self.sampler.tasks,
                                        log, self._local)

    @property
    def concurrency(self) -> int:
        """Trials ``optimize`` runs at once without ``n_jobs``: ``trials_per_device`` x the runtime's devices."""
        return self.trials_per_device * _device_count(self.runtime)

    @property
    def trial_tasks(self) -> dict[int, list[str]]:
        """Trial number -> names of the hydra_tune tasks it submitted (keys of ``runtime_stats()["tasks"]``)."""
        return {k: list(v) for k, v in self.sampler.tasks.names.items()}

    @property
    def cancelled_tasks(self) -> int:
        """How many tasks were cancelled because their trial ended first (pruned, failed, or left unfinished)."""
        return self.sampler.tasks.cancelled

    def submit(self, trial: Trial, task: ModelTask) -> Any:
        """Start ``task`` for ``trial`` on the study's runtime; its handle (``metrics()``, ``result()``, ``cancel()``).
        The task is cancelled when the trial ends (``study.tell``, or the objective returning or raising)."""
        if not isinstance(trial, Trial) or trial.study is not self:
            raise rule_error("`trial` is an optuna.Trial of this study", "pass the trial that `study.ask()` of this "
                             "study returned (or the one `optimize` hands your objective)", kind=TypeError,
                             trial=type(trial).__name__, study=self.study_name)
        runtime = self.runtime
        if self._local is not None and getattr(task, "drive_segments", None) is not None:
            runtime = self._local.get()  # a prepared model: this process's runtime (see _LocalRuntime)
        handle = runtime.submit(task)
        self.sampler.tasks.add(trial.number, handle)
        return handle

    def optimize(self, func: Callable[[Trial], Any], n_trials: int | None = None, timeout: float | None = None,
                 n_jobs: int | None = None, catch: Iterable[type[Exception]] | type[Exception] = (),
                 callbacks: Iterable[Callable[[optuna.Study, FrozenTrial], None]] | None = None,
                 gc_after_trial: bool = False, show_progress_bar: bool = False) -> None:
        """``optuna.Study.optimize``; ``n_jobs=None`` runs ``self.concurrency`` trials at once (an explicit value,
        -1 included, is Optuna's). Inside ``func``, ``hydra_tune.train(task)`` trains on this study's runtime."""
        if self._closer.alive is False:
            raise rule_error("the study is open", "create a new study with hydra_tune.optuna_study(...)",
                             kind=RuntimeError, closed=True)

        jobs = self.concurrency if n_jobs is None else n_jobs

        def objective(trial: Trial) -> Any:
            # trials in threads: each its own stream of torch's random numbers (hydra_tune/prepare/streams.py)
            with api.bind(lambda task: self.submit(trial, task)), trial_stream(concurrent=jobs != 1):
                try:
                    return func(trial)
                finally:   # free its tasks now, before Optuna's bookkeeping (after_trial releases them too)
                    self.sampler.tasks.release(trial.number)

        super().optimize(objective, n_trials=n_trials, timeout=timeout, n_jobs=jobs, catch=catch,
                         callbacks=callbacks, gc_after_trial=gc_after_trial, show_progress_bar=show_progress_bar)

    def runtime_stats(self) -> dict[str, Any]:
        """The runtime's ``stats()``: per device busy seconds and peaks, per task state (incl. "cancelled")."""
        return self.runtime.stats()

    def close(self) -> None:
        """Cancel what this study's trials still run; close the runtime if the study made it. Idempotent."""
        self._closer()

    def __enter__(self) -> "HydraStudy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_runtime(runtime: Any, tasks: _TrialTasks, log: ProgressLog | None = None,
                   local: _LocalRuntime | None = None) -> None:
    if log is not None:
        log.stop()
    tasks.release_all()
    if runtime is not None:
        runtime.close()
    if local is not None:
        local.close()


class _LocalRuntime:
    """The runtime in this process for the prepared models (hydra_tune.prepare) of a study on node servers
    (share "node" or "spread"), made at the first one with the study's settings, with a RuntimeWarning: the user's
    loop in this process drives a prepared model, so it cannot train on a server (another process); its device
    memory is this runtime's budget, which the servers do not see (their tasks on the same devices are not counted
    against it)."""

    def __init__(self, config: RuntimeConfig, share: str = "node") -> None:
        self.config, self.share = config, share
        self._runtime: Runtime | None = None
        self._lock = threading.Lock()

    def get(self) -> Runtime:
        with self._lock:
            if self._runtime is None:
                where = ("on the node's runtime server (persistent storage, or share='node')" if self.share == "node"
                         else "on a node server per device (share='spread')")
                warnings.warn(f"hydra_tune.prepare in a study {where}: prepared models train on a runtime in this "
                              "process, whose device memory budget the servers do not count; pass share='process' "
                              "to train every task here, or use hydra_tune.ModelTask with hydra_tune.train to train "
                              "on the servers", RuntimeWarning, stacklevel=4)
                self._runtime = Runtime(config=self.config)
            return self._runtime

    def close(self) -> None:
        with self._lock:
            runtime, self._runtime = self._runtime, None
        if runtime is not None:
            runtime.close()


def _device_count(runtime: Any) -> int:
    devices = runtime.devices
    return devices if isinstance(devices, int) else len(devices)


def optuna_study(*, devices: int | str | Sequence[str] = "auto", device_memory: int | str | None = None,
                 host_memory: int | str | None = None, policy: str = "lrtf", config: RuntimeConfig | None = None,
                 runtime: Any = None, share: str = "auto", heartbeat_interval: int | None = 10,
                 trials_per_device: int = 2, progress: float | None = None,
                 **create_study_kwargs: Any) -> HydraStudy:
    """``optuna.create_study(**create_study_kwargs)`` whose trials share one hydra_tune runtime.

        study = hydra_tune.optuna_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=0),
                                        storage="sqlite:///hpo.db", devices="auto", device_memory="20GiB")
        study.optimize(objective, n_trials=16)

    The runtime's settings: a ``hydra_tune.RuntimeConfig`` (``config=``) or its keywords ``devices``,
    ``device_memory``, ``host_memory``, ``policy``, as for ``hydra_tune.Runtime``; validated before the study is
    created. ``runtime``: use this runtime (a ``Runtime``, a ``hydra_tune.node.connect(...)`` client or a
    ``hydra_tune.node.spread(...)`` pool) instead (the settings are then unused); the study does not close it.
    ``share``: "process" (an
    in-process runtime), "node" (the node's runtime server, shared with other processes), "spread" (one node
    server per device, ``hydra_tune.node.spread``: devices that share no interpreter lock, the fast way for small
    models on several CPU devices; each task stays on one device) or "auto" ("node" when the storage is
    persistent, else "process"); with "node" or "spread", models of ``hydra_tune.prepare`` (driven by this
    process's loop) train on a runtime in this process made with the same settings, with a RuntimeWarning.
    ``sampler=None`` means ``TPESampler(constant_liar=True)``: TPE
    that does not sample the same point for trials running at the same time. ``progress``: as for
    ``hydra_tune.Runtime``, seconds between one-line status logs (tasks, devices busy, samples/s, steps/s) at INFO on
    ``hydra_tune.progress``, in this process (a node server's or a passed runtime's status too: every task on it);
    None reads ``HYDRA_TUNE_PROGRESS``; unset means off.
    """
    settings = RuntimeConfig.of(config, devices=devices, device_memory=device_memory, host_memory=host_memory,
                                policy=policy)
    seconds = progress_seconds(progress)
    if share not in SHARE:
        raise rule_error(f"`share` in {SHARE}", "'process' for a runtime in this process, 'node' to share the "
                         "node's runtime server with other processes, 'spread' for a node server per device, "
                         "'auto' to decide by the storage", share=share)
    if isinstance(trials_per_device, bool) or not isinstance(trials_per_device, int) or trials_per_device < 1:
        raise rule_error("`trials_per_device >= 1` (an int)", "pass 2 (one trial computing, one preparing) or "
                         "more", trials_per_device=trials_per_device)
    if runtime is not None and not callable(getattr(runtime, "submit", None)):
        raise rule_error("`runtime` is a hydra_tune.Runtime, a hydra_tune.node client, or None", "pass the runtime "
                         "object, or None to let the study make one from its settings", kind=TypeError,
                         runtime=type(runtime).__name__)
    kwargs = dict(create_study_kwargs)
    sampler = kwargs.pop("sampler", None)
    if sampler is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            sampler = optuna.samplers.TPESampler(constant_liar=True)
    sampler = HydraSampler(sampler)   # checks it before the study is created
    with creating(kwargs.get("storage")):
        storage = kwargs["storage"] = study_storage(kwargs.get("storage"), heartbeat_interval)
        base = optuna.create_study(sampler=sampler, **kwargs)
    owns = runtime is None
    local: RuntimeConfig | None = None
    if owns:
        runtime, local, seconds = _own_runtime(share, storage, settings, seconds)
    return HydraStudy(base, storage, runtime, owns, trials_per_device, seconds, local=local)


def _own_runtime(share: str, storage: Any, settings: RuntimeConfig,
                 seconds: float | None) -> tuple[Any, RuntimeConfig | None, float | None]:
    """The runtime a study makes for itself (``share``: "auto" decides by ``storage``): an in-process ``Runtime``,
    a client of the node's runtime server or a pool of one-device servers ("spread"); with it the settings of a
    runtime in this process for prepared models (node servers only, see _LocalRuntime) and the progress seconds
    the study still logs itself (None: the in-process runtime logs them)."""
    if share == "auto":
        share = "process" if isinstance(storage, InMemoryStorage) else "node"
    if share in ("node", "spread"):
        from hydra_tune import node

        remote = node.connect(config=settings) if share == "node" else node.spread(config=settings)
        return remote, settings, seconds
    return Runtime(config=settings, progress=seconds), None, None
