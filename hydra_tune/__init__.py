"""hydra_tune: train many models at once, sharded and spilled, on the devices you have (Hydra for Tune/Optuna).

    task = hydra_tune.ModelTask(make_model, lambda m: torch.optim.AdamW(m.parameters()), loader, epochs=2)
    with hydra_tune.Runtime(devices=["cpu", "cpu"], device_memory="64MiB") as rt:
        print(rt.submit(task).result())

Also here: ``Trace`` (``Runtime.trace()``) and ``plot_timeline`` for timelines, ``simulate`` for schedules of
clusters you do not have, ``plan_model`` for a model's shard plan without building its weights.
Importing this package imports torch, never ray, optuna, transformers, pynvml or matplotlib: those load lazily.
"""
from __future__ import annotations

from typing import Any

from . import _torch_version  # noqa: F401  (first: it refuses an old torch before a module below touches its internals)
from .api import configure, current_handle, default_runtime, save_checkpoint, train
from .config import RuntimeConfig
from .prepare import prepare
from .errors import EvaluationError, HydraError, NonFiniteLoss, PlanError, RuntimeClosed, TaskCancelled
from .runtime.handle import TaskHandle
from .runtime.runtime import Runtime
from .runtime.trace import Trace
from .sim import simulate
from .task import ModelTask
from .training.plan_model import plan_model

__version__ = "0.1.0"
# Found by hydra_tune.integrations._tune_proxy.check_package in this file's text, without importing it: a script or
# folder named hydra_tune that shadows this package lacks it.
__hydra_tune_package__ = True
__all__ = ["ModelTask", "Runtime", "RuntimeConfig", "TaskHandle", "train", "save_checkpoint", "current_handle",
           "configure", "default_runtime", "prepare", "HydraError", "EvaluationError", "PlanError", "NonFiniteLoss",
           "TaskCancelled", "RuntimeClosed", "Trace", "plot_timeline", "simulate", "plan_model", "__version__"]

_LAZY = {"HydraExecutor": ("hydra_tune.integrations.ray_tune", "HydraExecutor"),
         "optuna_study": ("hydra_tune.integrations.optuna", "optuna_study"),
         "plot_timeline": ("hydra_tune.sim.plot", "plot_timeline")}   # matplotlib is imported when it is called


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        try:
            return getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as exc:
            raise AttributeError(f"hydra_tune.{name} is not available yet or its extra is not installed "
                                 f"({exc}). Fix: pip install 'hydra_tune[all]'.") from exc
    raise AttributeError(f"module 'hydra_tune' has no attribute {name!r}")
