"""A metric-driven LR scheduler (ReduceLROnPlateau): stepped once per epoch with a named reported loss, exactly
as the plain loop's ``scheduler.step(val_loss)`` after its evaluation; refused early without a valid name."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, trained

import hydra_tune as ht


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _batches(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def _loss(out: torch.Tensor, batch: tuple) -> torch.Tensor:
    return F.mse_loss(out, batch[1])


def _plateau(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.ReduceLROnPlateau:
    # threshold=0.3: an epoch must improve by 30% to count, so the learning rate drops during the run
    return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5, threshold=0.3)


def _task(metric: str | None, eval_data: bool = True, **kw) -> ht.ModelTask:
    return ht.ModelTask(_mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9), _batches(5, 1),
                        eval_data=_batches(3, 2) if eval_data else None, loss=_loss, epochs=6, seed=4,
                        lr_scheduler=kw.pop("lr_scheduler", _plateau), lr_scheduler_metric=metric, **kw)


def _plain_plateau(task: ht.ModelTask) -> tuple[nn.Module, list[float]]:
    """The plain loop: train an epoch, evaluate, ``scheduler.step(metrics[name])``; returns the model and the
    learning rate after each epoch."""
    torch.manual_seed(task.seed)
    model = task.model()
    model.train()
    opt = task.optimizer(model)
    sched = task.lr_scheduler(opt)
    lrs = []
    for _ in range(task.epochs):
        losses = []
        for batch in task.train_data:
            loss = task.loss(model(batch[0]), batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        metrics = {"train_loss": sum(losses) / len(losses)}
        if task.eval_data is not None:
            model.eval()
            with torch.no_grad():
                ev = [task.loss(model(b[0]), b).item() for b in task.eval_data]
            model.train()
            metrics["eval_loss"] = sum(ev) / len(ev)
        sched.step(metrics[task.lr_scheduler_metric])
        lrs.append(opt.param_groups[0]["lr"])
    return model, lrs


@pytest.mark.parametrize("metric,eval_data", [("eval_loss", True), ("train_loss", False)])
def test_plateau_matches_plain_loop(metric: str, eval_data: bool) -> None:
    task = _task(metric, eval_data)
    with ht.Runtime(devices=["cpu", "cpu"], device_memory="64KiB") as rt:
        handle = rt.submit(task)
        reported = list(handle.metrics())
        model = trained(handle)
    ref, lrs = _plain_plateau(_task(metric, eval_data))
    assert [m["lr"] for m in reported] == lrs
    assert len(set(lrs)) > 2   # the scheduler did lower the rate, more than once
    assert max_param_diff(model, ref) == 0.0


def _submit_error(task: ht.ModelTask) -> BaseException:
    with ht.Runtime(devices=["cpu"]) as rt:
        with pytest.raises(Exception) as info:
            rt.submit(task)
    return info.value


def test_plateau_without_metric_refused_at_submit() -> None:
    err = _submit_error(_task(None, name="plateau"))
    assert isinstance(err, ValueError)
    assert str(err) == (
        "a scheduler whose `step` takes a metric (ReduceLROnPlateau) is given `lr_scheduler_metric` must hold, but "
        "got (task='plateau', scheduler='ReduceLROnPlateau', lr_scheduler_metric=None). "
        "Fix: name the reported loss it follows, e.g. ModelTask(..., lr_scheduler_metric='eval_loss') (with "
        "eval_data) or 'train_loss': it is then stepped once per epoch, after the evaluation, with that value.")


def test_metric_with_per_step_scheduler_refused_at_submit() -> None:
    err = _submit_error(_task("eval_loss", lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2)))
    assert isinstance(err, ValueError)
    assert "`lr_scheduler_metric` is given only for a scheduler whose `step` takes a metric" in str(err)
    assert "scheduler='StepLR', lr_scheduler_metric='eval_loss'" in str(err)
    assert "Fix: drop lr_scheduler_metric: this scheduler is stepped after every optimizer step." in str(err)


def test_scheduler_without_step_refused_at_submit() -> None:
    err = _submit_error(_task(None, lr_scheduler=lambda o: {"lr": 0.1}))
    assert isinstance(err, TypeError)
    assert "`lr_scheduler(optimizer)` returns a scheduler with a `step` method must hold" in str(err)
    assert "returned='dict'" in str(err)


def test_metric_not_reported_refused_at_construction() -> None:
    with pytest.raises(ValueError) as info:
        _task("accuracy")
    assert str(info.value) == (
        "`lr_scheduler_metric` is None or a loss the task reports after every epoch must hold, but got "
        "(lr_scheduler_metric='accuracy', reported=['train_loss', 'eval_loss']). Fix: name one of "
        "['train_loss', 'eval_loss'].")
    with pytest.raises(ValueError, match=r"reported=\['train_loss'\]\). Fix: pass eval_data"):
        _task("eval_loss", eval_data=False)
    with pytest.raises(ValueError, match="`lr_scheduler_metric` is given only with an `lr_scheduler`"):
        _task("train_loss", lr_scheduler=None)


def test_plateau_state_survives_a_checkpoint(tmp_path) -> None:
    """Checkpointed after epochs in which the scheduler counted bad epochs and lowered the rate, the resumed task
    ends as the uninterrupted one (the scheduler's state travels in the checkpoint)."""
    def task(**kw) -> ht.ModelTask:   # accumulation beyond the epoch: one step per epoch, at its end
        return _task("eval_loss", grad_accumulation=8, **kw)

    with ht.Runtime(devices=["cpu"]) as rt:
        whole = rt.submit(task())
        expected, expected_lrs = trained(whole), [m["lr"] for m in whole.metrics()]
        first = rt.submit(task())
        for m in first.metrics():
            if m["epoch"] == 3:
                path = first.checkpoint(tmp_path / "c.pt", timeout=60)
                break
        first.cancel()
        resumed = rt.submit(task(resume_from=path))
        model, lrs = trained(resumed), [m["lr"] for m in resumed.metrics()]
    assert len(set(expected_lrs[:3])) > 1   # the rate had dropped before the checkpoint
    assert lrs == expected_lrs[-len(lrs):]
    assert max_param_diff(model, expected) == 0.0
