"""``ModelTask(eval_fn=fn)``: the user's own whole-model evaluation at each evaluation point, against the plain
loop that runs the same function at the same points (values equal exactly, parameters bit-identical, random draws
from the same stream); what fails a task (a raising eval_fn or metric, a bad result), naming it and the step, while
other tasks train on."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, trained
from test_eval_metrics import EVAL, TRAIN, _ce, _mlp, accuracy

import hydra_tune as ht
from hydra_tune.errors import EvaluationError


def my_accuracy(model: nn.Module) -> dict:
    """The user's own evaluation loop over the whole model."""
    correct = total = 0
    for x, y in EVAL:
        correct += (model(x).argmax(-1) == y).sum().item()
        total += y.numel()
    return {"my_accuracy": correct / total}


def noisy_eval(model: nn.Module) -> dict:
    """An evaluation that draws random numbers (noise on the inputs) and reads the mode and autograd state."""
    assert not model.training and not torch.is_grad_enabled()
    x, y = EVAL[0]
    out = model(x + 0.1 * torch.randn_like(x))
    return {"noisy_loss": F.cross_entropy(out, y).item(), "mode_ok": int(not model.training)}


def _task(**kw) -> ht.ModelTask:
    kw.setdefault("epochs", 2)
    kw.setdefault("eval_fn", my_accuracy)
    return ht.ModelTask(_mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.3), TRAIN, loss=_ce, seed=3, **kw)


def plain(task: ht.ModelTask, every: int | None = None) -> tuple[nn.Module, list[dict]]:
    """The plain loop: train, and at each evaluation point run ``task.eval_fn`` under eval() and no_grad()."""
    torch.manual_seed(task.seed)
    model = task.model()
    opt = task.optimizer(model)
    steps, reports = 0, []

    def evaluate(epoch: int) -> None:
        model.eval()
        with torch.no_grad():
            got = task.eval_fn(model)
        model.train()
        reports.append(dict(got, epoch=epoch, steps=steps))

    for epoch in range(1, task.epochs + 1):
        for x, y in TRAIN:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            steps += 1
            if every is not None and steps % every == 0:
                evaluate(epoch)
        if every is None or (epoch == task.epochs and reports[-1]["steps"] != steps):
            evaluate(epoch)
    return model, reports


def _run(task: ht.ModelTask, **runtime) -> tuple[list[dict], nn.Module, dict]:
    runtime.setdefault("device_memory", "20KiB")      # three shards
    with ht.Runtime(devices=["cpu", "cpu"], **runtime) as rt:
        h = rt.submit(task)
        metrics, model = list(h.metrics()), trained(h)
        return metrics, model, rt.stats()["tasks"][task.name]


def _keys(reports: list[dict], names: tuple[str, ...]) -> list[dict]:
    return [{k: m[k] for k in names} for m in reports]


@pytest.mark.parametrize("every", [None, 3])
def test_eval_fn_accuracy_equals_the_plain_loops_own_evaluation(every):
    task = _task(eval_every=every, eval_data=EVAL, metrics={"accuracy": accuracy})
    got, model, stats = _run(task)
    ref_model, ref = plain(task, every)
    names = ("epoch", "steps", "my_accuracy")
    assert _keys(got, names) == _keys(ref, names) and len(got) == (2 if every is None else 4)
    # the sharded metric and the whole-model function agree on the same weights
    assert [m["accuracy"] for m in got] == [m["my_accuracy"] for m in got]
    assert len(stats["shards"]) == 3 and max_param_diff(model, ref_model) == 0.0


def test_eval_fn_sees_a_device_resident_state_as_its_current_weights():
    task = _task(epochs=3)
    got, model, stats = _run(task, device_memory=None)   # one shard: its state stays on the device
    ref_model, ref = plain(task)
    assert stats["residency"]["steps_on_device"] == 15, stats["residency"]   # every step on the device
    assert _keys(got, ("steps", "my_accuracy")) == _keys(ref, ("steps", "my_accuracy"))
    assert max_param_diff(model, ref_model) == 0.0


def test_eval_fn_random_draws_come_from_the_tasks_stream_as_in_the_plain_loop():
    def make():   # dropout in training: the eval's draws shift every later mask, as in the plain loop
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4))

    task = ht.ModelTask(make, lambda m: torch.optim.SGD(m.parameters(), lr=0.3), TRAIN, loss=_ce, seed=5,
                        epochs=2, eval_every=2, eval_fn=noisy_eval)
    got, model, _ = _run(task)
    ref_model, ref = plain(task, every=2)
    assert _keys(got, ("steps", "noisy_loss", "mode_ok")) == _keys(ref, ("steps", "noisy_loss", "mode_ok"))
    assert max_param_diff(model, ref_model) == 0.0


def test_an_eval_fn_that_raises_fails_its_task_naming_it_and_the_step_and_others_train_on():
    def broken_eval(model):
        if calls.append(1) or len(calls) == 2:
            raise KeyError("no such split")
        return my_accuracy(model)

    calls: list[int] = []
    bad, good = _task(eval_fn=broken_eval, eval_every=3, name="bad"), _task(name="good")
    with ht.Runtime(devices=["cpu", "cpu"], device_memory="20KiB") as rt:
        hb, hg = rt.submit(bad), rt.submit(good)
        with pytest.raises(EvaluationError) as info:
            hb.result()
        model = trained(hg)
        assert hg.status == "done"
    text = str(info.value)
    assert "broken_eval" in text and "step=6" in text and "'bad'" in text and "KeyError" in text
    assert isinstance(info.value.__cause__, KeyError)
    assert max_param_diff(model, plain(good)[0]) == 0.0


@pytest.mark.parametrize("fn, what", [
    (lambda m: {"acc": float("nan")}, "value=nan"),
    (lambda m: {"acc": torch.tensor(float("inf"))}, "value=inf"),
    (lambda m: {"acc": "high"}, "value='str'"),
    (lambda m: {"acc": torch.ones(3)}, "value='Tensor'"),
    (lambda m: [0.5], "returned='list'"),
    (lambda m: {"eval_loss": 0.1}, "key='eval_loss'"),       # the sharded evaluation reports it
    (lambda m: {"steps": 1}, "key='steps'"),                  # hydra_tune's own key
    (lambda m: {"accuracy": 0.5}, "key='accuracy'"),          # the task's metric
    (lambda m: {3: 0.5}, "key=3"),
])
def test_a_bad_eval_fn_result_fails_the_task_with_a_clear_error(fn, what):
    task = _task(eval_fn=fn, eval_data=EVAL, metrics={"accuracy": accuracy}, epochs=1)
    with ht.Runtime(devices=["cpu"]) as rt:
        with pytest.raises(EvaluationError) as info:
            rt.submit(task).result()
    assert "`eval_fn(model)` runs and returns a dict" in str(info.value) and what in str(info.value)
    assert "step=5" in str(info.value) and "Fix:" in str(info.value)


@pytest.mark.parametrize("fn, rule", [
    (3, "`eval_fn` is None or callable(model)"),
    (lambda: {}, "`eval_fn` is None or callable(model)"),
    (lambda model, data: {}, "`eval_fn` is None or callable(model)"),
])
def test_a_bad_eval_fn_is_refused_at_construction(fn, rule):
    with pytest.raises(TypeError) as info:
        _task(eval_fn=fn)
    assert rule in str(info.value) and "Fix:" in str(info.value)


def test_a_metric_that_raises_at_run_time_fails_its_task_naming_it_and_the_step():
    def flaky(out, batch):   # raises in the third evaluation's second batch (the check at submit: `seen` put back)
        seen.append(1)
        if len(seen) == 2 * len(EVAL) + 2:
            raise ZeroDivisionError("empty class")
        return accuracy(out, batch)

    seen: list[int] = []
    bad = _task(eval_fn=None, eval_data=EVAL, metrics={"flaky": flaky}, eval_every=2, name="bad")
    good = _task(eval_fn=None, eval_data=EVAL, metrics={"accuracy": accuracy}, name="good")
    with ht.Runtime(devices=["cpu", "cpu"], device_memory="20KiB") as rt:
        hb, hg = rt.submit(bad), rt.submit(good)
        with pytest.raises(EvaluationError) as info:
            hb.result()
        assert hg.result()["accuracy"] > 0 and hg.status == "done"
    text = str(info.value)
    assert "metric='flaky'" in text and "step=6" in text and "eval_batch=2" in text and "ZeroDivisionError" in text
