"""Ray Tune integration: one shared hydra_tune runtime per node under an unchanged Tune search.

    ex = hydra_tune.HydraExecutor(devices="auto", device_memory=None, host_memory="64GiB", policy="lrtf")
    tuner = tune.Tuner(ex.wrap(train_fn), param_space=space, run_config=tune.RunConfig(callbacks=[ex]))
    results = tuner.fit()            # train_fn: `for metrics in hydra_tune.train(task): tune.report(metrics)`

Shape (Ray 2.x has no custom trial executors, so this lives on Tune's extension points):
  * ``HydraExecutor`` is a ``tune.Callback``. ``setup`` starts one runtime actor per alive node, pinned to it
    (hard node affinity, which also keeps it out of the trials' placement groups), named
    ``hydra_rt_<node_id>``, ``num_cpus=0``, holding the node's GPUs, its runtime made from the executor's
    ``RuntimeConfig``; ``on_experiment_end`` stops them.
  * ``wrap(train_fn)`` returns a thin Tune trainable (a proxy that imports ray only, requests ``proxy_cpus``).
    The proxy asks its own node's runtime actor (routing by node id) to run ``train_fn(config)`` in a thread
    there, so models are built where they train, and forwards every ``tune.report`` (metrics + checkpoint)
    to Tune. ``tune.report``/``tune.get_context``/``tune.get_checkpoint`` work unchanged inside ``train_fn``.
  * When Tune stops a trial (ASHA/HyperBand, ``max_t``/stop, an error, PBT's pause, experiment end) the
    callback and the proxy cancel its hydra_tune tasks at once (``TaskHandle.cancel``: their state is freed).
  * ``wrap`` alone works too: the first trial on a node creates that node's runtime (detached);
    ``HydraExecutor.shutdown()`` (or ``ray.shutdown()``) removes it.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray import cloudpickle, tune

from hydra_tune import shipping
from hydra_tune.config import RuntimeConfig
from hydra_tune.errors import rule_error
from hydra_tune.runtime.progress import progress_seconds

from . import _tune_proxy as _proxy
from ._versions import require

require("ray", ray.__version__)   # a clear ImportError outside the tested range, before Ray's privates are used

__all__ = ["HydraExecutor"]


class HydraExecutor(tune.Callback):
    """Tune callback + function wrapper that runs every trial on its node's shared hydra_tune runtime.

        ex = HydraExecutor(devices=["cpu", "cpu"], device_memory="64MiB", host_memory="8GiB")
        tune.Tuner(ex.wrap(train_fn), run_config=tune.RunConfig(callbacks=[ex])).fit()

    Settings: a ``hydra_tune.RuntimeConfig`` (``config=``) or its keywords ``devices``, ``device_memory``,
    ``host_memory``, ``policy``, meaning what they mean for ``hydra_tune.Runtime``; validated here, applied to
    every node's runtime. ``proxy_cpus``: the CPU share each trial's proxy requests from Tune. ``progress``: as
    for ``hydra_tune.Runtime``, seconds between one-line status logs of each node's runtime (tasks, devices busy,
    samples/s, steps/s; at INFO on ``hydra_tune.progress`` in the runtime actor, whose output Ray shows in the
    driver's console unless ``ray.init(log_to_driver=False)``); None reads ``HYDRA_TUNE_PROGRESS`` here, in the
    driver, once; unset means off.
    Concurrency: Tune's ``max_concurrent_trials`` bounds the trials in flight (each proxy requests only
    ``proxy_cpus`` CPU, so Tune's CPU accounting no longer does; ``tune.with_resources`` around the wrapped
    trainable only makes each trial reserve more and fewer run at once: a warning says so). Every running trial
    keeps its model, gradients and optimizer state in its node's host memory: each node's runtime starts a trial's
    task only when its host footprint fits ``host_memory`` (None: the memory available); until then the task
    waits (state "queued") and its trial with it (``hydra_tune.plan_model`` reports a task's host bytes).
    Errors: a trial whose ``train_fn`` raises fails with that exception's own type (rebuilt from the runtime
    actor, its traceback there in a note), or a RuntimeError naming it when it cannot be rebuilt.
    """

    def __init__(self, devices: int | str | Sequence[str] = "auto", device_memory: int | str | None = None,
                 proxy_cpus: float = 0.05, *, host_memory: int | str | None = None, policy: str = "lrtf",
                 config: RuntimeConfig | None = None, report_proxy_modules: bool = False,
                 progress: float | None = None) -> None:
        self.config = RuntimeConfig.of(config, devices=devices, device_memory=device_memory,
                                       host_memory=host_memory, policy=policy)
        # read here, once (the argument, else this process's HYDRA_TUNE_PROGRESS); every node's runtime gets it
        self.progress = progress_seconds(progress)
        if not isinstance(proxy_cpus, (int, float)) or isinstance(proxy_cpus, bool) or not 0 <= proxy_cpus <= 1:
            raise rule_error("`0 <= proxy_cpus <= 1`", "the proxy only forwards reports: give it a small CPU "
                             "share such as 0.05", proxy_cpus=proxy_cpus)
        self.proxy_cpus = float(proxy_cpus)
        self.report_proxy_modules = report_proxy_modules
        self.actors: dict[str, Any] = {}   # node id -> runtime actor handle (the creator's handle keeps it alive)
        self._starting: dict[str, Any] = {}  # node id -> its new runtime actor's first where(), until answered
        self.final_stats: dict[str, dict[str, Any]] = {}   # per node id, taken as the runtimes stop
        self.final_traces: dict[str, Any] = {}              # per node id: hydra_tune Trace of the whole search
        self._resources_checked = False

    # -- the trainable ------------------------------------------------------------------------------------
    def wrap(self, train_fn: Callable[[dict[str, Any]], Any]) -> Any:
        """A Tune trainable that runs ``train_fn(config)`` inside its node's runtime actor."""
        if not callable(train_fn):
            raise rule_error("`train_fn` is callable", "pass the Tune function `def train_fn(config): ...`",
                             kind=TypeError, train_fn=type(train_fn).__name__)
        # unpickled (with torch and the model code) only in the runtime, once per trial; each tensor storage it
        # holds travels once (a dataset sliced into minibatches: once, not once per minibatch)
        fn_bytes = shipping.dump(train_fn, cloudpickle)
        return _proxy.make_proxy(fn_bytes, self.runtime_settings(), self.proxy_cpus,
                                 getattr(train_fn, "__name__", "hydra_trial"), self.report_proxy_modules)

    def tuner(self, trainable: Callable[[dict[str, Any]], Any], **tuner_kwargs: Any) -> Any:
        """``tune.Tuner(self.wrap(trainable), **tuner_kwargs)`` with this executor among its run config's callbacks:
        the one line that moves a Tune script onto hydra_tune.

            tuner = hydra_tune.HydraExecutor(devices="auto").tuner(train_fn, param_space=..., tune_config=...)
        """
        import dataclasses

        run_config = tuner_kwargs.pop("run_config", None) or tune.RunConfig()
        callbacks = [*(run_config.callbacks or []), self]
        tuner_kwargs["run_config"] = dataclasses.replace(run_config, callbacks=callbacks)
        return tune.Tuner(self.wrap(trainable), **tuner_kwargs)

    # -- runtimes -----------------------------------------------------------------------------------------
    def start_runtimes(self) -> dict[str, dict[str, Any]]:
        """Start (or find) one runtime actor per alive node and wait until each is up; returns where each runs."""
        self._create_runtimes()
        where = ray.get([a.where.remote() for a in self.actors.values()])
        return dict(zip(self.actors, where))

    def _create_runtimes(self) -> dict[str, Any]:
        """Create (or find) the runtime actors of the alive nodes that have none yet, without waiting for them:
        per node id, the reference of its first ``where()`` (ready once the actor is up, raising if it failed)."""
        started = {}
        for n in ray.nodes():
            if n["Alive"] and n["NodeID"] not in self.actors:
                actor = _proxy.get_or_create_runtime(n["NodeID"], self.runtime_settings(), "callback-setup")
                self.actors[n["NodeID"]] = actor
                started[n["NodeID"]] = actor.where.remote()
        return started

    def _check_started(self) -> None:
        """A runtime actor that failed to start fails the experiment with its error, as soon as that is known
        (checked without waiting at every Tune step, until each has answered)."""
        if not self._starting:
            return
        ready, _ = ray.wait(list(self._starting.values()), num_returns=len(self._starting), timeout=0)
        for nid, ref in list(self._starting.items()):
            if ref in ready:
                del self._starting[nid]
                ray.get(ref)  # raises the actor's start error

    def runtime_settings(self) -> dict[str, Any]:
        """What each node's runtime actor is made from: ``RuntimeConfig.as_dict()`` plus ``progress`` (seconds or
        None: off)."""
        return dict(self.config.as_dict(), progress=self.progress)

    def runtime_stats(self) -> dict[str, dict[str, Any]]:
        """Per node id: the node's runtime stats (devices, per-task state incl. "cancelled"), trials, log."""
        return self._ask_runtimes("stats")

    def runtime_traces(self) -> dict[str, Any]:
        """Per node id: the node runtime's ``hydra_tune.Trace`` (``.save(path)``, ``plot_timeline``)."""
        return self._ask_runtimes("trace")

    def _ask_runtimes(self, method: str) -> dict[str, Any]:
        """Per node id: what its runtime actor's ``method`` returns (nodes without a live runtime are left out)."""
        out = {}
        for nid in self._node_ids():
            try:
                actor = ray.get_actor(_proxy.actor_name(nid), namespace=_proxy.NAMESPACE)
                out[nid] = ray.get(getattr(actor, method).remote())
            except (ValueError, ray.exceptions.RayActorError):
                pass
        return out

    def shutdown(self) -> None:
        """Cancel what still runs and stop every runtime actor, lazily created (detached) ones included."""
        for a in self.actors.values():
            try:
                ray.get(a.shutdown.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass   # killed mid-run; a lazily created successor may exist under the same name
        self.final_stats = self.runtime_stats()
        self.final_traces = self.runtime_traces()
        for nid in self._node_ids():
            try:
                actor = ray.get_actor(_proxy.actor_name(nid), namespace=_proxy.NAMESPACE)
            except ValueError:
                continue
            try:
                ray.get(actor.shutdown.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
            ray.kill(actor)
        for a in self.actors.values():
            ray.kill(a)
        self.actors = {}

    def _node_ids(self) -> list[str]:
        return sorted(set(self.actors) | {n["NodeID"] for n in ray.nodes() if n["Alive"]})

    def _cancel(self, trial: Any, why: str) -> None:
        for nid in self._node_ids():
            try:
                actor = ray.get_actor(_proxy.actor_name(nid), namespace=_proxy.NAMESPACE)
            except ValueError:
                continue
            # held in a variable: Ray before 2.4x keeps only a weak reference from `actor.cancel` to the handle, so
            # a handle used inline is collected first ("RuntimeError: Lost reference to actor")
            actor.cancel.remote(trial.trial_id, why)

    # -- tune.Callback hooks ------------------------------------------------------------------------------
    def setup(self, **info: Any) -> None:
        # Not waited for here: each runtime actor (a process that imports torch and sets its devices up) starts
        # while Tune starts the trials' own actors; a trial's first call waits for its node's runtime (waiting
        # here made the two start times add up: ~2 s more per search on a 2-core machine)
        self._starting = self._create_runtimes()
        self._resources_checked = False   # per experiment

    def on_step_begin(self, iteration: int, trials: list, **info: Any) -> None:
        """Once, at the first step with trials (pending ones too: a trial that can never start fires no other
        hook): warn when the trials reserve resources that bound how many run at once (_tune_proxy). At every
        step: a runtime actor that failed to start raises here (``_check_started``)."""
        self._check_started()
        if self._resources_checked or not trials:
            return
        self._resources_checked = True
        note = _proxy.resources_warning(trials[0].placement_group_factory.required_resources, self.proxy_cpus,
                                        ray.cluster_resources())
        if note:
            warnings.warn(note, stacklevel=2)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._cancel(trial, "complete")

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._cancel(trial, "error")

    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        """A failed trial Tune will restart (FailureConfig): its proxy may have died without a word (SIGKILL, the
        OOM killer, a lost node), leaving its train_fn thread blocked at its next report and its tasks training
        where no one reads them; the restart may land on another node and never meet them. Cancel them now. The
        restart is not touched: Tune makes its trial process only after this hook, so its ``start`` reaches the
        runtime after this cancel, which ends the incarnation running now only."""
        self._cancel(trial, "recover")

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        self.shutdown()
