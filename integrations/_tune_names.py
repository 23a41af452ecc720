"""The names Ray Tune writes into every result itself: a task trained under Tune may not report them.

    task = tune_checked(task)     # the Tune runtime actor's submit: metrics refused now, eval_fn's keys as it returns

Why: Tune fills ``training_iteration``, ``time_total_s``, ``timestamp``, ``done``, ``trial_id``, ``config`` ...
into each reported dict, over what the trial reported (or it reads them: ``done`` ends the trial,
``should_checkpoint`` asks for a checkpoint). A metric with such a name would be overwritten or act as a command
without a word. The names come from the installed Ray (``ray.tune.result``, imported when first needed), plus the
few it sets under other names; ``mean_accuracy``/``mean_loss`` are Tune's suggested names, not its own keys: allowed.

Rules: ``metrics=`` names are refused at submit (``rule_error``, ValueError); ``eval_fn``'s keys are known only when
it returns: the task submitted is a copy whose ``eval_fn`` checks them and fails the task with ``EvaluationError``.
"""
from __future__ import annotations

import copy
import functools
from typing import Any

from hydra_tune.errors import EvaluationError, rule_error

# Set by Tune under names ray.tune.result has no constant for in every supported version.
_ALSO = ("experiment_id", "date", "time_since_restore", "timesteps_since_restore", "iterations_since_restore",
         "checkpoint_dir_name", "config", "trial_id", "experiment_tag", "done", "should_checkpoint")
_RULE = "a metric's name is not one of Ray Tune's own result keys"


@functools.lru_cache(maxsize=1)
def tune_keys() -> frozenset[str]:
    """Every key Tune sets or reads in a result, for the installed Ray."""
    from ray.tune import result

    names = set(_ALSO)
    for attr in ("AUTO_RESULT_KEYS", "DEBUG_METRICS"):
        names.update(getattr(result, attr, ()))
    for attr in ("DONE", "SHOULD_CHECKPOINT", "TRIAL_ID", "EXPERIMENT_TAG", "TIMESTEPS_THIS_ITER",
                 "EPISODES_THIS_ITER", "TIMESTEPS_TOTAL", "EPISODES_TOTAL", "TRIAL_INFO", "RESULT_DUPLICATE",
                 "TIME_THIS_ITER_S", "TIME_TOTAL_S", "TIMESTAMP", "TRAINING_ITERATION", "PID", "HOSTNAME",
                 "NODE_IP"):
        value = getattr(result, attr, None)
        if isinstance(value, str):
            names.add(value)
    return frozenset(names)


def _fix(name: Any) -> str:
    return f"rename it (e.g. 'val_{name}'); Tune's own keys: {sorted(tune_keys())}"


def tune_checked(task: Any) -> Any:
    """``task`` as the Tune runtime submits it: its ``metrics`` names checked now; with an ``eval_fn``, a shallow
    copy whose ``eval_fn`` checks the keys it returns (the user's task object is left as it is)."""
    taken = tune_keys()
    for name in getattr(task, "metrics", None) or {}:
        if name in taken:
            raise rule_error(_RULE, _fix(name), task=task.name, metric=name)
    fn = getattr(task, "eval_fn", None)
    if fn is None:
        return task

    @functools.wraps(fn)
    def checked(model: Any) -> Any:
        got = fn(model)
        for key in got if isinstance(got, dict) else ():
            if key in taken:
                raise rule_error(_RULE, _fix(key), kind=EvaluationError, task=task.name,
                                 eval_fn=getattr(fn, "__name__", type(fn).__name__), key=key)
        return got

    task = copy.copy(task)
    task.eval_fn = checked
    return task
