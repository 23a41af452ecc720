"""Metric names that Ray Tune writes into every result itself (``training_iteration``, ``timestamp``, ``done``...)
are refused for tasks trained under Tune: ``metrics=`` names when the trial submits its task, ``eval_fn``'s keys
when it returns them; names Tune only suggests (``mean_accuracy``) and every name outside Tune stay allowed."""
from __future__ import annotations

import sys

import pytest
import torch
from test_eval_metrics import EVAL, TRAIN, _ce, _mlp, accuracy

import hydra_tune as ht
from hydra_tune.errors import EvaluationError

pytest.importorskip("ray")
from hydra_tune.integrations._tune_names import tune_checked, tune_keys  # noqa: E402  (needs ray)


def _task(metrics=None, eval_fn=None, epochs=1, name=None) -> ht.ModelTask:
    return ht.ModelTask(_mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.3), TRAIN, loss=_ce, seed=3,
                        eval_data=EVAL, metrics=metrics, eval_fn=eval_fn, epochs=epochs, name=name)


def test_tunes_keys_come_from_the_installed_ray():
    from ray.tune import result

    keys = tune_keys()
    assert set(result.AUTO_RESULT_KEYS) <= keys and {result.DONE, result.TRIAL_ID, "should_checkpoint"} <= keys
    assert "mean_accuracy" not in keys and "accuracy" not in keys and "eval_loss" not in keys


@pytest.mark.parametrize("name", ["training_iteration", "timestamp", "done", "time_total_s", "trial_id", "config",
                                  "should_checkpoint", "node_ip", "date"])
def test_a_metric_named_as_a_tune_key_is_refused_at_submit_under_tune(name):
    task = _task(metrics={name: accuracy})
    with pytest.raises(ValueError) as info:
        tune_checked(task)
    assert "not one of Ray Tune's own result keys" in str(info.value) and repr(name) in str(info.value)
    assert "Fix: rename it" in str(info.value)


def test_allowed_names_pass_and_the_users_task_is_left_as_it_is():
    def my_eval(model):
        return {"mean_accuracy": 0.5}

    task = _task(metrics={"accuracy": accuracy, "mean_accuracy": accuracy}, eval_fn=my_eval)
    checked = tune_checked(task)
    assert task.eval_fn is my_eval and checked is not task and checked.eval_fn.__name__ == "my_eval"
    assert checked.eval_fn(None) == {"mean_accuracy": 0.5}
    plain = _task(metrics={"accuracy": accuracy})
    assert tune_checked(plain) is plain


def test_an_eval_fn_returning_a_tune_key_fails_its_task_naming_the_key():
    with ht.Runtime(devices=["cpu"]) as rt:
        h = rt.submit(tune_checked(_task(eval_fn=lambda m: {"done": 1.0})))
        with pytest.raises(EvaluationError) as info:
            h.result()
    assert "key='done'" in str(info.value) and "Ray Tune's own result keys" in str(info.value)


# -- through Tune ----------------------------------------------------------------------------------------------
def tune_fn(config: dict) -> None:
    from ray import tune

    if config["bad"] == "metric":
        task = _task(metrics={"timestamp": accuracy}, name=tune.get_context().get_trial_id())
    else:
        task = _task(eval_fn=lambda m: {"time_total_s": 1.0}, name=tune.get_context().get_trial_id())
    for metrics in ht.train(task):
        tune.report(metrics)


def test_under_tune_a_clashing_metric_or_eval_fn_key_fails_the_trial(local_ray, tmp_path):
    from ray import cloudpickle, tune

    cloudpickle.register_pickle_by_value(sys.modules[__name__])   # tune_fn travels to the runtime actor
    cloudpickle.register_pickle_by_value(sys.modules["test_eval_metrics"])
    ex = ht.HydraExecutor(devices=["cpu"])
    results = tune.Tuner(ex.wrap(tune_fn), param_space={"bad": tune.grid_search(["metric", "eval_fn"])},
                         run_config=tune.RunConfig(callbacks=[ex], storage_path=str(tmp_path), name="names",
                                                   verbose=0)).fit()
    errors = {r.config["bad"]: r.error for r in results}
    assert isinstance(errors["metric"], ValueError) and "metric='timestamp'" in str(errors["metric"])
    assert isinstance(errors["eval_fn"], EvaluationError) and "key='time_total_s'" in str(errors["eval_fn"])
