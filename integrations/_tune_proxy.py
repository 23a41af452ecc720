"""Torch-free half of the Ray Tune integration: the per-node runtime actor and the thin trial proxy.

    fn_bytes = shipping.dump(train_fn, cloudpickle)        # the user's function, unpickled only in the runtime
    trainable = make_proxy(fn_bytes, RuntimeConfig(devices="auto").as_dict(), cpus=0.05, name="train_fn")
    tune.Tuner(trainable, ...)                             # each trial streams train_fn's reports from its node

This module imports ray only, never torch or hydra_tune at module level, and ``ray_tune.HydraExecutor.wrap``
registers it with ``cloudpickle.register_pickle_by_value``: Tune's trial actors unpickle the proxy without
importing the parent package (which imports torch). The runtime actor imports hydra_tune (and torch) itself.
The runtime settings travel as ``RuntimeConfig.as_dict()`` (plain values, validated where the executor was made)
and become a ``RuntimeConfig`` again in the actor.

How ``tune.report``/``tune.get_context`` keep working inside ``train_fn``: _tune_session.py.

How ``hydra_tune.train`` inside ``train_fn`` reaches the node's runtime: each trial thread runs ``train_fn`` inside
``hydra_tune.api.bind``, whose submit records every handle on the trial's session, so cancelling the trial
cancels its tasks.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
import warnings
from typing import Any, Callable

import ray
from ray import cloudpickle, tune

NAMESPACE = "hydra_tune"
_MARKER = "__hydra_tune_package__ = True"   # a line of hydra_tune/__init__.py


def check_package() -> None:
    """Raise ImportError naming the file when ``import hydra_tune`` in this process would not load the installed
    package, before anything imports it: a script or folder named hydra_tune earlier on ``sys.path`` shadows it
    (Ray puts the driver script's folder ahead of site-packages on its workers' paths), or it is not installed
    on this node. Without the check such a trial dies with an ActorDiedError or an AttributeError naming nothing.
    In the user's own process nothing of hydra_tune runs when a script shadows it, so nothing can check there."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("hydra_tune")
    except (ImportError, ValueError):   # ValueError: a module in sys.modules without a spec
        spec = None
    origin = getattr(spec, "origin", None)
    if spec is None or origin is None:
        raise ImportError(f"hydra_tune is importable where trials run must hold, but got (hydra_tune=None, node="
                          f"{ray.get_runtime_context().get_node_id()}, executable={sys.executable!r}). Fix: install "
                          "hydra_tune[ray] into the Python environment of every Ray node (or a runtime_env).")
    package = spec.submodule_search_locations is not None and os.path.basename(origin) == "__init__.py"
    if not package or not _has_marker(origin):
        raise ImportError(f"`import hydra_tune` loads the installed hydra_tune package must hold, but got "
                          f"(hydra_tune={origin!r}). Fix: rename {origin if not package else os.path.dirname(origin)}"
                          " (a script or folder named hydra_tune shadows the package; Ray starts its workers with "
                          "the driver script's folder first on sys.path) and remove its __pycache__ entry.")


def _has_marker(path: str) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return any(line.strip() == _MARKER for line in f)
    except OSError:
        return False


def actor_name(node_id: str) -> str:
    return f"hydra_rt_{node_id}"


class RuntimeActor:
    """The Ray actor of one node: owns the node's devices through the process's hydra_tune default runtime, made
    from ``config`` (a ``RuntimeConfig.as_dict()`` plus ``progress``), and runs every trial's ``train_fn`` in a
    thread of its own."""

    def __init__(self, config: dict[str, Any], origin: str) -> None:
        check_package()   # before the import: a shadowing hydra_tune.py would run as the package
        # (imported here, not at the top: Tune's trial actors unpickle this module by value without hydra_tune)
        from hydra_tune.integrations._tune_session import ThreadRoutedSession, route_sessions

        self.router = ThreadRoutedSession()
        route_sessions(self.router)
        import hydra_tune
        from hydra_tune.runtime.progress import ENV

        settings = dict(config)
        # HydraExecutor read `progress` (or its driver's environment) once: this process's runtime logs as asked
        os.environ[ENV] = str(settings.pop("progress", None) or 0)
        hydra_tune.configure(config=hydra_tune.RuntimeConfig(**settings))
        self.runtime = hydra_tune.default_runtime()   # devices are set up now, before the first trial
        self.trials: dict[str, Any] = {}   # trial id -> its ForwardSession
        self.log: list[tuple[float, str, str]] = []
        self.origin = origin
        self.lock = threading.Lock()

    def where(self) -> dict[str, Any]:
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(), "origin": self.origin,
                "device_names": [d.name for d in self.runtime.devices], "progress": self.runtime.progress}

    def stats(self) -> dict[str, Any]:
        """The hydra_tune runtime's stats plus this actor's trials (state, threads alive), log and where it runs."""
        out = dict(self.runtime.stats(), **self.where())
        out["trials"] = {tid: ("cancelled:" + s.cancelled if s.cancelled else
                               "running" if s.thread is not None and s.thread.is_alive() else "ended")
                         for tid, s in self.trials.items()}
        out["threads"] = sorted(tid for tid, s in self.trials.items()   # train_fn threads alive now, cancelled or not
                                if s.thread is not None and s.thread.is_alive())
        out["log"] = list(self.log)
        return out

    def trace(self) -> Any:
        """The node runtime's timeline so far (a hydra_tune Trace)."""
        return self.runtime.trace()

    def start(self, trial_id: str, fn_bytes: bytes, config: dict[str, Any], info: dict[str, Any],
              checkpoint: Any) -> str:
        from hydra_tune.integrations._tune_names import tune_checked  # refuses Tune's own result keys
        from hydra_tune.integrations._tune_session import ForwardSession

        from hydra_tune import api, shipping

        old = self.trials.get(trial_id)
        if old is not None and old.thread is not None and old.thread.is_alive():
            self.cancel(trial_id, "restarted")
        s = ForwardSession(trial_id, info, checkpoint)

        def run() -> None:
            self.router.use(s)
            try:
                fn = shipping.load(fn_bytes)  # (ray_tune.py wrote it: each tensor storage once)
                from hydra_tune.prepare.streams import trial_stream

                # trials run in threads of this actor: each its own stream of torch's random numbers
                with api.bind(lambda task: s.track(self.runtime.submit(tune_checked(task)))), trial_stream():
                    fn(config)
                s.events.put(("done", None, None))
            except BaseException as exc:  # noqa: BLE001  (reported to the proxy, which re-raises it)
                if s.cancelled:
                    s.events.put(("stopped", s.cancelled, None))
                else:
                    s.events.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                                  _pickled(exc)))
            finally:
                self.router.use(None)
                s.forget_tasks()
                self.log.append((time.time(), trial_id, "thread-exit"))

        with self.lock:
            self.trials[trial_id] = s
        s.thread = threading.Thread(target=run, name=f"trial-{trial_id}", daemon=True)
        s.thread.start()
        self.log.append((time.time(), trial_id, "start"))
        return s.token

    def next_event(self, trial_id: str, acked: bool) -> tuple[str, Any, Any]:
        s = self.trials[trial_id]
        if acked:
            s.ack.release()
        return s.events.get()

    def cancel(self, trial_id: str, reason: str, token: str | None = None) -> bool:
        """Stop the trial's thread at its next report and cancel its hydra_tune tasks now (memory freed);
        with ``token``, only that incarnation (a late cancel from a paused proxy spares the restarted trial)."""
        s = self.trials.get(trial_id)
        if s is None or (token is not None and s.token != token) or s.cancelled is not None or s.thread is None \
                or not s.thread.is_alive():
            return False
        with s.lock:   # under the lock: a task submitted from now on is cancelled by track
            s.cancelled = reason
        s.cancel_tasks()
        self.log.append((time.time(), trial_id, f"cancel:{reason}"))
        return True

    def shutdown(self) -> int:
        n = sum(self.cancel(tid, "experiment-end") for tid in list(self.trials))
        for s in self.trials.values():
            if s.thread is not None:
                s.thread.join(timeout=10)
        return n


_RemoteRuntime = ray.remote(num_cpus=0, max_concurrency=1000)(RuntimeActor)


def node_gpus(node_id: str) -> float:
    for n in ray.nodes():
        if n["NodeID"] == node_id:
            return float(n.get("Resources", {}).get("GPU", 0))
    return 0.0


def get_or_create_runtime(node_id: str, config: dict[str, Any], origin: str, detached: bool = False) -> Any:
    """The node's runtime actor (named, so every trial and the callback find the same one); ``config`` is a
    ``RuntimeConfig.as_dict()``. An actor already running keeps the settings it was made with."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return _RemoteRuntime.options(
        name=actor_name(node_id), namespace=NAMESPACE, get_if_exists=True,
        lifetime="detached" if detached else None, num_gpus=node_gpus(node_id),   # owns the node's GPUs
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),  # outside trial PGs
    ).remote(config, origin)


def resources_warning(resources: dict[str, float], proxy_cpus: float, cluster: dict[str, float]) -> str | None:
    """The warning for a wrapped trainable whose trials reserve more than ``wrap`` asked (``proxy_cpus`` CPU, no
    GPU), or None. ``resources``: one trial's (``PlacementGroupFactory.required_resources``); ``cluster``:
    ``ray.cluster_resources()``. Such a request changes nothing in the training (it runs in the node's runtime
    actor, on its devices) but bounds how many trials Tune starts at once: with 2 CPUs per trial on a 2-CPU
    machine, one at a time; GPUs are held by the runtime actors, so trials asking for them wait."""
    cpu, gpu = float(resources.get("CPU", 0.0)), float(resources.get("GPU", 0.0))
    if cpu <= proxy_cpus + 1e-9 and gpu == 0:
        return None
    total_cpu = float(cluster.get("CPU", 0.0))
    at_once = [f"{int(total_cpu // cpu)} at a time for the cluster's {total_cpu:g} CPUs"] if cpu > 0 else []
    if gpu:
        at_once.append(f"none while the runtime actors hold the cluster's {float(cluster.get('GPU', 0.0)):g} GPUs")
    return (f"each trial of HydraExecutor.wrap(train_fn) reserves {cpu:g} CPU and {gpu:g} GPU (tune.with_resources "
            f"or resources_per_trial around the wrapped trainable), but wrap requests proxy_cpus={proxy_cpus:g} CPU: "
            f"a trial only forwards reports, its training runs in its node's hydra_tune runtime on the executor's "
            f"devices. Tune therefore starts trials {' and '.join(at_once)}. Fix: pass ex.wrap(train_fn) to "
            f"tune.Tuner as it is and bound concurrency with TuneConfig(max_concurrent_trials=...); set the compute "
            f"with HydraExecutor(devices=..., device_memory=...).")


def _run_proxy(config: dict[str, Any], fn_bytes: bytes, runtime_config: dict[str, Any],
               report_modules: bool, proxy_cpus: float) -> None:
    """The Tune trial: forwards ``train_fn``'s reports (run in this node's runtime actor) to Tune."""
    check_package()   # the trial's error names a shadowing hydra_tune.py (the runtime actor would die of it)
    node = ray.get_runtime_context().get_node_id()
    rt = get_or_create_runtime(node, runtime_config, "lazy-from-proxy", detached=True)
    ctx = tune.get_context()
    note = resources_warning(ctx.get_trial_resources().required_resources, proxy_cpus, ray.cluster_resources())
    if note and ray.get(rt.where.remote())["origin"] != "callback-setup":   # else HydraExecutor warned already
        warnings.warn(note, stacklevel=1)
    info = {"trial_name": ctx.get_trial_name(), "trial_dir": ctx.get_trial_dir(),
            "experiment_name": ctx.get_experiment_name(), "trial_resources": ctx.get_trial_resources()}
    tid = ctx.get_trial_id()
    token = ray.get(rt.start.remote(tid, fn_bytes, config, info, tune.get_checkpoint()))
    finished, acked = False, False
    try:
        while True:
            kind, payload, ckpt = ray.get(rt.next_event.remote(tid, acked))
            if kind == "report":
                if report_modules:
                    payload["proxy_torch_loaded"] = "torch" in sys.modules
                    payload["proxy_hydra_tune_loaded"] = "hydra_tune" in sys.modules
                    payload["proxy_node"] = node
                tune.report(payload, checkpoint=ckpt)   # raises (SystemExit) when Tune stops the trial
                acked = True
            elif kind in ("done", "stopped"):
                finished = True
                return
            else:
                finished = True
                raise trial_error(tid, payload, ckpt)
    finally:
        if not finished:   # Tune stopped or paused us (PBT fires no callback hook), or the actor died
            try:
                rt.cancel.remote(tid, f"proxy-exit:{type(sys.exc_info()[1]).__name__}", token)
            except Exception:  # noqa: BLE001  (the actor may be gone already)
                pass


def _pickled(exc: BaseException) -> bytes | None:
    """``exc`` pickled for the trial's proxy (its traceback stays here, as text), or None when it cannot be."""
    try:
        return cloudpickle.dumps(exc)
    except Exception:  # noqa: BLE001  (an argument that does not pickle: the proxy names the type instead)
        return None


def trial_error(trial_id: str, text: str, pickled: bytes | None) -> Exception:
    """What the trial raises for ``train_fn``'s exception in the runtime actor: that exception itself, rebuilt here
    (its type, so ``except NonFiniteLoss`` and Tune's ``result.error`` see the task's own error), with the actor's
    traceback as a note; a RuntimeError naming the type and message when it cannot be rebuilt (its arguments do not
    pickle, its class is not importable here, or it is a BaseException such as KeyboardInterrupt)."""
    where = f"trial {trial_id} failed in its node's hydra_tune runtime"
    why = "it does not pickle"
    if pickled is not None:
        try:
            exc = cloudpickle.loads(pickled)
        except Exception as err:  # noqa: BLE001  (any failure to rebuild falls back to the text)
            why = f"{type(err).__name__}: {err}"
        else:
            if isinstance(exc, Exception):
                if hasattr(exc, "add_note"):   # Python >= 3.11
                    exc.add_note(f"{where}; its traceback there:\n{text}")
                return exc
            why = f"{type(exc).__name__} is not an Exception"
    return RuntimeError(f"{where} ({why}, so raised as RuntimeError): {text}")


def make_proxy(fn_bytes: bytes, runtime_config: dict[str, Any], cpus: float, name: str,
               report_modules: bool = False) -> Callable[[dict], None]:
    """A Tune function trainable that runs the pickled ``train_fn`` in its node's runtime actor (made from
    ``runtime_config``, a ``RuntimeConfig.as_dict()``, if the trial is the node's first). ``report_modules``:
    each report also says whether the proxy's process loaded torch or hydra_tune, and its node."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

    def proxy(config: dict[str, Any]) -> None:
        return _run_proxy(config, fn_bytes, runtime_config, report_modules, cpus)

    proxy.__name__ = proxy.__qualname__ = name
    return tune.with_resources(proxy, {"cpu": cpus})
