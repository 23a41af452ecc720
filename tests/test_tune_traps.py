"""Ray Tune traps: a task's own error type reaches the trial, a wrapped trainable that reserves resources which
serialize trials is warned about, a script named hydra_tune.py that shadows the package is named."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import textwrap

import pytest
import torch
import torch.nn.functional as F

import hydra_tune as ht
from hydra_tune.errors import NonFiniteLoss

ray = pytest.importorskip("ray")
from ray import cloudpickle, tune  # noqa: E402

from hydra_tune.integrations import _tune_proxy as proxy  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the train_fns below travel to the runtime actor


class ShapeMismatch(ValueError):
    """A user's own exception type, raised inside train_fn."""


class Unpicklable(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()   # does not pickle: the trial gets a RuntimeError naming the type


def _task(loss_scale: float) -> ht.ModelTask:
    data = [(torch.randn(4, 8), torch.randn(4, 2)) for _ in range(3)]
    return ht.ModelTask(lambda: torch.nn.Sequential(torch.nn.Linear(8, 2)),
                        lambda m: torch.optim.SGD(m.parameters(), lr=0.1), data,
                        loss=lambda out, b: F.mse_loss(out, b[1]) * loss_scale, epochs=2, name="traps")


def failing_fn(config: dict) -> None:
    kind = config["kind"]
    if kind == "nonfinite":   # the task's own error: the runtime raises NonFiniteLoss from ht.train
        for metrics in ht.train(_task(float("nan"))):
            tune.report(metrics)
    elif kind == "user":
        raise ShapeMismatch("expected 8 features, got 7")
    else:
        raise Unpicklable("holds a lock")


def ok_fn(config: dict) -> None:
    for metrics in ht.train(_task(1.0)):
        tune.report(metrics)


def test_trial_error_keeps_the_tasks_own_type(local_ray, tmp_path):
    ex = ht.HydraExecutor(devices=["cpu"])
    results = tune.Tuner(ex.wrap(failing_fn), param_space={"kind": tune.grid_search(["nonfinite", "user", "lock"])},
                         run_config=tune.RunConfig(callbacks=[ex], storage_path=str(tmp_path), name="errors",
                                                   verbose=0)).fit()
    errors = {r.config["kind"]: r.error for r in results}
    assert isinstance(errors["nonfinite"], NonFiniteLoss), repr(errors["nonfinite"])
    assert "the training loss is finite (nonfinite_loss='fail') must hold" in str(errors["nonfinite"])
    assert isinstance(errors["user"], ShapeMismatch), repr(errors["user"])
    assert "expected 8 features, got 7" in str(errors["user"])
    lock = errors["lock"]
    assert isinstance(lock, RuntimeError) and not isinstance(lock, Unpicklable)
    assert "(it does not pickle, so raised as RuntimeError): Unpicklable: holds a lock" in str(lock)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a node where a CUDA runtime cannot start")
def test_a_runtime_actor_that_cannot_start_fails_the_search_with_its_error(local_ray, tmp_path):
    """The callback does not wait for the runtime actors in ``setup`` (they start while Tune starts the trials):
    one that fails to start still fails ``fit`` with the runtime's own message, not only its trials."""
    ht.HydraExecutor(devices=["cpu"]).shutdown()   # no runtime actor left from an earlier test (it keeps its settings)
    ex = ht.HydraExecutor(devices=["cuda:0"])
    with pytest.raises(Exception, match="a CUDA device is available"):
        tune.Tuner(ex.wrap(ok_fn), param_space={"x": tune.grid_search([1, 2])},
                   run_config=tune.RunConfig(callbacks=[ex], storage_path=str(tmp_path), name="no-start",
                                             verbose=0)).fit()


def test_trial_error_rebuilds_the_exception_with_the_runtime_traceback_as_a_note():
    try:
        raise NonFiniteLoss("loss=nan")
    except NonFiniteLoss as exc:
        got = proxy.trial_error("t1", "NonFiniteLoss: loss=nan\nTraceback ...", proxy._pickled(exc))
    assert type(got) is NonFiniteLoss and got.args == ("loss=nan",)
    if sys.version_info >= (3, 11):
        assert got.__notes__ == ["trial t1 failed in its node's hydra_tune runtime; its traceback there:\n"
                                 "NonFiniteLoss: loss=nan\nTraceback ..."]
    stop = proxy.trial_error("t2", "KeyboardInterrupt: ", proxy._pickled(KeyboardInterrupt()))
    assert type(stop) is RuntimeError and "KeyboardInterrupt is not an Exception" in str(stop)


def test_resources_that_serialize_trials_are_warned_about(local_ray, tmp_path):
    ex = ht.HydraExecutor(devices=["cpu"])
    trainable = tune.with_resources(ex.wrap(ok_fn), {"cpu": 2})
    with pytest.warns(UserWarning) as caught:
        results = tune.Tuner(trainable, param_space={"i": tune.grid_search([0, 1])},
                             run_config=tune.RunConfig(callbacks=[ex], storage_path=str(tmp_path), name="serial",
                                                       verbose=0)).fit()
    assert results.num_errors == 0, [r.error for r in results]
    notes = [str(w.message) for w in caught if "HydraExecutor.wrap" in str(w.message)]
    assert notes == [
        "each trial of HydraExecutor.wrap(train_fn) reserves 2 CPU and 0 GPU (tune.with_resources or "
        "resources_per_trial around the wrapped trainable), but wrap requests proxy_cpus=0.05 CPU: a trial only "
        "forwards reports, its training runs in its node's hydra_tune runtime on the executor's devices. Tune "
        "therefore starts trials 1 at a time for the cluster's 2 CPUs. Fix: pass ex.wrap(train_fn) to tune.Tuner "
        "as it is and bound concurrency with TuneConfig(max_concurrent_trials=...); set the compute with "
        "HydraExecutor(devices=..., device_memory=...)."]


def test_resources_warning_rule():
    cluster = {"CPU": 16.0, "GPU": 2.0}
    assert proxy.resources_warning({"CPU": 0.05}, 0.05, cluster) is None          # what wrap requests
    assert proxy.resources_warning({"CPU": 0.01}, 0.05, cluster) is None
    assert "starts trials 4 at a time for the cluster's 16 CPUs" in proxy.resources_warning({"CPU": 4}, 0.05,
                                                                                             cluster)
    gpu = proxy.resources_warning({"CPU": 0.05, "GPU": 1}, 0.05, cluster)
    assert "reserves 0.05 CPU and 1 GPU" in gpu and "none while the runtime actors hold the cluster's 2 GPUs" in gpu


def test_check_package_names_a_shadowing_script_or_folder(tmp_path, monkeypatch):
    proxy.check_package()   # the installed package: nothing to say
    script = tmp_path / "script" / "hydra_tune.py"
    script.parent.mkdir()
    script.write_text("print('my experiment')\n")
    monkeypatch.delitem(sys.modules, "hydra_tune")
    monkeypatch.syspath_prepend(str(script.parent))
    with pytest.raises(ImportError) as info:
        proxy.check_package()
    assert str(info.value) == (
        f"`import hydra_tune` loads the installed hydra_tune package must hold, but got (hydra_tune='{script}'). "
        f"Fix: rename {script} (a script or folder named hydra_tune shadows the package; Ray starts its workers "
        "with the driver script's folder first on sys.path) and remove its __pycache__ entry.")
    folder = tmp_path / "folder" / "hydra_tune"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(folder.parent))
    with pytest.raises(ImportError, match=f"Fix: rename {folder} "):
        proxy.check_package()


_SHADOWED_RUN = textwrap.dedent("""
    import sys, ray, hydra_tune as ht
    from ray import tune
    sys.path.insert(0, {tests!r})
    from test_tune_traps import ok_fn
    ray.init(address={address!r}, log_to_driver=False, runtime_env={{"env_vars": {{"PYTHONPATH": {shadow!r}}}}})
    ex = ht.HydraExecutor(devices=["cpu"])
    results = tune.Tuner(ex.wrap(ok_fn), run_config=tune.RunConfig(storage_path={store!r}, verbose=0)).fit()
    print("IMPORT-ERROR", isinstance(results[0].error, ImportError))
    print("ERROR", results[0].error)
    ex.shutdown()
    ray.shutdown()
""")


def test_shadowing_script_on_the_workers_path_is_named_in_the_trials_error(local_ray, tmp_path):
    """The user's hydra_tune.py first on the Ray workers' path (as the driver script's folder is): the trial fails
    with an ImportError naming that file, not an ActorDiedError. The script is a driver of its own, a job with
    that path, on the shared local Ray (a Ray of its own would cost seconds to start)."""
    shadow = tmp_path / "experiments"
    shadow.mkdir()
    (shadow / "hydra_tune.py").write_text("raise SystemExit('this is the user script, not the package')\n")
    code = _SHADOWED_RUN.format(tests=os.path.dirname(__file__), shadow=str(shadow), store=str(tmp_path / "store"),
                                address=ray.get_runtime_context().gcs_address)
    # cwd: Ray puts the driver's folder (here the working directory) first on its workers' paths
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert "IMPORT-ERROR True" in out.stdout, out.stdout + out.stderr[-3000:]
    assert f"(hydra_tune='{shadow / 'hydra_tune.py'}'). Fix: rename {shadow / 'hydra_tune.py'}" in out.stdout
