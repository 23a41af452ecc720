"""Evaluation metrics (``metrics=``), ``eval_every=`` and ``epochs=None`` against a plain PyTorch loop that
evaluates the same model on the same eval data at the same points: every reported value equal exactly, the trained
parameters bit-identical; and the refusals at construction and at submit."""
from __future__ import annotations

import math
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, trained

import hydra_tune as ht


def _data(n: int, size: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 16, generator=g), torch.randint(0, 4, (size,), generator=g)) for _ in range(n)]


TRAIN, EVAL = _data(5, 8, 0), _data(3, 7, 1)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _ce(out, batch):
    return F.cross_entropy(out, batch[1])


def accuracy(out, batch):
    return (out.argmax(-1) == batch[1]).sum(), batch[1].numel()


def wrong(out, batch):
    return (out.argmax(-1) != batch[1]).sum()


def _task(**kw) -> ht.ModelTask:
    kw.setdefault("eval_data", EVAL)
    kw.setdefault("metrics", {"accuracy": accuracy, "wrong": wrong})
    kw.setdefault("epochs", 2)
    return ht.ModelTask(_mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.3), TRAIN, loss=_ce, seed=3, **kw)


def plain(task: ht.ModelTask, every: int | None = None) -> tuple[nn.Module, list[dict]]:
    """The user's own loop: evaluate after every epoch (or every ``every`` steps and after the last), reporting
    eval_loss (mean of batch losses), accuracy = correct / total and the summed number wrong."""
    torch.manual_seed(task.seed)
    model = task.model()
    opt = task.optimizer(model)
    steps, reports = 0, []

    def evaluate(epoch: int) -> None:
        model.eval()
        losses, correct, total, n_wrong = [], 0, 0, 0
        with torch.no_grad():
            for x, y in task.eval_data:
                out = model(x)
                losses.append(F.cross_entropy(out, y).item())
                correct += (out.argmax(-1) == y).sum().item()
                total += y.numel()
                n_wrong += (out.argmax(-1) != y).sum().item()
        model.train()
        reports.append({"epoch": epoch, "steps": steps, "eval_loss": sum(losses) / len(losses),
                        "accuracy": correct / total, "wrong": n_wrong})

    epoch = 0
    while task.epochs is None or epoch < task.epochs:
        epoch += 1
        for x, y in task.train_data:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            steps += 1
            if every is not None and steps % every == 0:
                evaluate(epoch)
            if task.max_steps is not None and steps >= task.max_steps:
                break
        last = epoch == task.epochs or (task.max_steps is not None and steps >= task.max_steps)
        if every is None or (last and reports[-1]["steps"] != steps):
            evaluate(epoch)
        if last:
            break
    return model, reports


def _run(task: ht.ModelTask) -> tuple[list[dict], nn.Module]:
    with ht.Runtime(devices=["cpu", "cpu"], device_memory="20KiB") as rt:
        h = rt.submit(task)
        metrics, model = list(h.metrics()), trained(h)
        assert len(rt.stats()["tasks"][task.name]["shards"]) == 3   # eval units E, E, E: the last one measures
        return metrics, model


KEYS = ("epoch", "steps", "eval_loss", "accuracy", "wrong")


def test_accuracy_per_epoch_equals_the_plain_loops_correct_over_total():
    task = _task()
    got, model = _run(task)
    ref_model, ref = plain(task)
    assert [{k: m[k] for k in KEYS} for m in got] == ref
    assert isinstance(got[0]["wrong"], int) and 0 < got[-1]["accuracy"] < 1
    assert max_param_diff(model, ref_model) == 0.0


def test_eval_every_n_steps_reports_after_every_nth_step_and_the_last():
    task = _task(eval_every=3)                      # 5 batches x 2 epochs: steps 3, 6, 9 and the last, 10
    got, model = _run(task)
    ref_model, ref = plain(task, every=3)
    assert [m["steps"] for m in got] == [3, 6, 9, 10] and [m["epoch"] for m in got] == [1, 2, 2, 2]
    assert [{k: m[k] for k in KEYS} for m in got] == ref
    assert max_param_diff(model, ref_model) == 0.0


def test_epochs_none_trains_until_max_steps():
    task = _task(epochs=None, max_steps=12, eval_every=4)
    got, model = _run(task)
    ref_model, ref = plain(task, every=4)
    assert [m["steps"] for m in got] == [4, 8, 12] and got[-1]["epoch"] == 3
    assert [{k: m[k] for k in KEYS} for m in got] == ref
    assert max_param_diff(model, ref_model) == 0.0


def test_epochs_none_trains_until_the_consumer_stops():
    task = _task(epochs=None, eval_every=5)
    seen = []
    with ht.Runtime(devices=["cpu"]) as rt:
        for m in ht.train(task, rt):
            seen.append(m)
            if m["accuracy"] >= 1.0 or len(seen) == 6:   # a stop rule on accuracy, as Tune's stop= applies it
                break
        handle = ht.current_handle()
        assert handle.wait(timeout=30) and handle.status == "cancelled", handle.status
    _, ref = plain(_task(epochs=len(seen), eval_every=5), every=5)
    assert [{k: m[k] for k in KEYS} for m in seen] == ref[: len(seen)]


@pytest.mark.parametrize("kw, rule", [
    ({"metrics": [accuracy]}, "`metrics` is None or a non-empty dict"),
    ({"metrics": {}}, "`metrics` is None or a non-empty dict"),
    ({"metrics": {"eval_loss": accuracy}}, "not already reported"),
    ({"metrics": {"task": accuracy}}, "not already reported"),      # the handle labels every report with it
    ({"metrics": {"acc": 3}}, "each metric is callable(outputs, batch)"),
    ({"metrics": {"acc": lambda out: out}}, "each metric is callable(outputs, batch)"),
    ({"metrics": {"acc": accuracy}, "eval_data": None}, "`metrics` are given with `eval_data`"),
    ({"eval_every": 0}, "`eval_every >= 1`"),
    ({"eval_every": 2.0}, "`eval_every >= 1`"),
    ({"epochs": 0}, "`epochs >= 1`"),
    ({"eval_every": 2, "lr_scheduler": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o),
      "lr_scheduler_metric": "eval_loss"}, "not combined with `eval_every`"),
])
def test_bad_metric_settings_are_refused_at_construction(kw, rule):
    with pytest.raises((ValueError, TypeError)) as info:
        _task(**kw)
    assert rule in str(info.value) and "Fix:" in str(info.value)


@pytest.mark.parametrize("fn, rule", [
    (lambda out, b: out.argmax(-1) == b[1], "a metric returns (sum, count) or one value"),        # a vector
    (lambda out, b: (1, 2, 3), "a metric returns (sum, count) or one value"),
    (lambda out, b: "high", "a metric returns (sum, count) or one value"),
    (lambda out, b: out.logits.sum(), "each metric runs on the task's outputs and a batch"),  # raises
])
def test_a_metric_that_breaks_its_contract_fails_at_submit_naming_it(fn, rule):
    task = _task(metrics={"acc": fn})
    with ht.Runtime(devices=["cpu"]) as rt:
        with pytest.raises((ValueError, TypeError)) as info:
            rt.submit(task)
    assert rule in str(info.value) and "acc" in str(info.value)


def test_a_metric_whose_counts_sum_to_zero_is_nan_and_other_tasks_train_on():
    task = _task(metrics={"none": lambda out, b: (0, 0)}, epochs=1)
    other = _task(epochs=1)
    with ht.Runtime(devices=["cpu"]) as rt:
        h, h2 = rt.submit(task), rt.submit(other)
        assert math.isnan(h.result()["none"]) and h2.result()["accuracy"] == plain(other)[1][-1]["accuracy"]


def test_metrics_run_in_the_device_unit_not_in_the_caller():
    threads = []

    def spy(out, batch):
        threads.append(threading.current_thread().name)
        return accuracy(out, batch)

    with ht.Runtime(devices=["cpu"]) as rt:
        rt.submit(_task(metrics={"accuracy": spy}, epochs=1)).result()
    caller = threading.current_thread().name
    # (the check at submit ran it in the caller too, and put `threads` back as it found it)
    assert len(threads) == len(EVAL) and all(t != caller for t in threads), threads


@pytest.mark.parametrize("after", [3, 4, 10])   # at a reporting step, between two, at the last (report follows)
def test_a_task_resumed_with_eval_every_reports_what_the_uninterrupted_one_does(tmp_path, after):
    from test_resume_exactness import _run as run_here

    keys = ("epoch", "steps", "train_loss", "eval_loss", "accuracy", "wrong")
    whole, metrics, requests = run_here(_task(eval_every=3), ask_after=(after,), path=tmp_path)
    path = requests[0].wait(0)
    resumed, resumed_metrics, _ = run_here(_task(eval_every=3, resume_from=path))
    # served at the boundary of step `after`: after that step's eval_every report, before the last one
    due = [m for m in metrics if m["steps"] > after or (m["steps"] == after and after % 3)]
    assert due and [[m[k] for k in keys] for m in resumed_metrics] == [[m[k] for k in keys] for m in due]
    assert max_param_diff(whole.model, resumed.model) == 0.0


def test_reduce_lr_on_plateau_follows_accuracy_as_the_plain_loop_does():
    def sched(opt):
        return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=0)

    task = _task(epochs=4, lr_scheduler=sched, lr_scheduler_metric="accuracy")
    got, model = _run(task)
    torch.manual_seed(task.seed)   # the plain loop: scheduler.step(accuracy) after each epoch's evaluation
    ref = task.model()
    opt = task.optimizer(ref)
    plateau, lrs, accs = sched(opt), [], []
    for _ in range(task.epochs):
        for x, y in TRAIN:
            F.cross_entropy(ref(x), y).backward()
            opt.step()
            opt.zero_grad()
        ref.eval()
        with torch.no_grad():
            correct = sum((ref(x).argmax(-1) == y).sum().item() for x, y in EVAL)
        ref.train()
        accs.append(correct / sum(y.numel() for _, y in EVAL))
        plateau.step(accs[-1])
        lrs.append(opt.param_groups[0]["lr"])
    assert [m["accuracy"] for m in got] == accs and [m["lr"] for m in got] == lrs and len(set(lrs)) > 1
    assert max_param_diff(model, ref) == 0.0


def test_a_model_that_cannot_be_copied_warns_and_its_metrics_are_checked_as_they_run():
    class NoCopy(nn.Sequential):
        def __deepcopy__(self, memo):
            raise TypeError("holds a handle")

    task = ht.ModelTask(lambda: NoCopy(nn.Linear(16, 4)), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), TRAIN,
                        eval_data=EVAL, loss=_ce, metrics={"acc": lambda out, b: out.argmax(-1) == b[1]})
    with ht.Runtime(devices=["cpu"]) as rt:
        with pytest.warns(UserWarning, match="could not try the metrics"):
            h = rt.submit(task)
        with pytest.raises(TypeError, match="a metric returns"):
            h.result()


def test_eval_every_without_eval_data_reports_training_every_n_steps():
    task = _task(eval_data=None, metrics=None, eval_every=2, grad_accumulation=2)   # 5 batches: 3 steps an epoch
    got, model = _run(task)
    torch.manual_seed(task.seed)
    ref = task.model()
    opt = task.optimizer(ref)
    steps, reports = 0, []
    for epoch in (1, 2):
        losses = []
        for i, (x, y) in enumerate(TRAIN):
            loss = F.cross_entropy(ref(x), y)
            (loss / 2).backward()
            losses.append(loss.item())
            if i % 2 == 1 or i == len(TRAIN) - 1:
                opt.step()
                opt.zero_grad()
                steps += 1
                if steps % 2 == 0 or (epoch == 2 and i == len(TRAIN) - 1):
                    reports.append((epoch, steps, sum(losses) / len(losses)))
    assert [(m["epoch"], m["steps"], m["train_loss"]) for m in got] == reports
    assert [m["steps"] for m in got] == [2, 4, 6] and "eval_loss" not in got[0]
    assert max_param_diff(model, ref) == 0.0


@pytest.mark.parametrize("kw, evals", [
    ({"eval_every": 3}, 4),                                   # reports at steps 3, 6, 9 and the last, 10
    ({"epochs": None, "max_steps": 12, "eval_every": 4}, 3),  # 4, 8, 12
    ({"epochs": 3}, 3),                                       # one per epoch
])
def test_the_units_left_count_every_evaluation_the_task_will_run(kw, evals):
    from hydra_tune.training.state import TaskState

    task = _task(**kw)
    state = TaskState.build(task, None)
    left = state.remaining()
    assert left["E"] == evals * len(EVAL) * len(state.execs)
    assert left["L"] == (task.max_steps or len(TRAIN) * task.epochs)
