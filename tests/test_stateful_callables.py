"""A task's loss and metrics with state of their own (a call counter warming a loss weight up, a history of the
losses, a closure's ``nonlocal`` counter): hydra_tune calls them in its cost profile and its metric check at
submit too, where the plain loop does not; those calls leave their state as it was, so the task trains and
reports as the plain loop that evaluates with the same loss and metrics."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff

import hydra_tune as ht
from hydra_tune.training.profile_cache import PROFILES

X = torch.randn(48, 16, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 4, (48,), generator=torch.Generator().manual_seed(2))
TRAIN = [(X[i:i + 8], Y[i:i + 8]) for i in range(0, 48, 8)]
EVAL = [(X[:16], Y[:16])]


class WarmedLoss:
    """Cross-entropy weighted up over its first four calls; every value kept in ``history``."""

    def __init__(self) -> None:
        self.calls, self.history = 0, []

    def __call__(self, out: torch.Tensor, batch: tuple) -> torch.Tensor:
        self.calls += 1
        loss = F.cross_entropy(out, batch[1]) * min(1.0, self.calls / 4)
        self.history.append(round(loss.item(), 6))
        return loss


def closure_loss():
    calls = 0

    def loss(out: torch.Tensor, batch: tuple) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return F.cross_entropy(out, batch[1]) * min(1.0, calls / 4)
    return loss


class CountedAccuracy:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, out: torch.Tensor, batch: tuple) -> tuple:
        self.calls += 1
        return (out.argmax(-1) == batch[1]).sum(), batch[1].numel()


class RunningMeanLoss(nn.Module):
    """Cross-entropy over a running mean of the losses so far, kept in a buffer updated in place."""

    def __init__(self) -> None:
        super().__init__()
        self.ce = nn.CrossEntropyLoss()
        self.register_buffer("mean", torch.ones(()))

    def forward(self, out: torch.Tensor, batch: tuple) -> torch.Tensor:
        loss = self.ce(out, batch[1])
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * loss)
        return loss / self.mean


class TensorCountedAccuracy(CountedAccuracy):
    def __init__(self) -> None:
        super().__init__()
        self.seen = torch.zeros((), dtype=torch.long)

    def __call__(self, out: torch.Tensor, batch: tuple) -> tuple:
        self.seen += batch[1].numel()
        return super().__call__(out, batch)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 4))


def _task(loss, metric) -> ht.ModelTask:
    return ht.ModelTask(_model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), TRAIN, eval_data=EVAL, loss=loss,
                        metrics={"acc": metric}, epochs=2, seed=0, name="stateful")


def plain(loss, metric) -> nn.Module:
    """The user's loop: train an epoch, then evaluate with the same loss and metric (as the task reports them)."""
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model.train()
        for batch in TRAIN:
            value = loss(model(batch[0]), batch)
            opt.zero_grad()
            value.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            for batch in EVAL:
                out = model(batch[0])
                loss(out, batch)
                metric(out, batch)
    return model


@pytest.mark.parametrize("budget", ["64MiB", "20KiB"])
@pytest.mark.parametrize("kind", ["object", "closure", "module"])
def test_a_loss_and_a_metric_with_state_train_and_count_as_in_the_plain_loop(kind, budget):
    # before: the cost profile's loss call and the submit's metric check counted too: the warm-up ran a call
    # ahead (weights 0.008 apart) and the history and counts held one entry more than the plain loop's; a loss
    # module's buffer kept the profile's update (0.003 apart)
    def make():
        if kind == "module":
            return RunningMeanLoss(), TensorCountedAccuracy()
        return (WarmedLoss() if kind == "object" else closure_loss()), CountedAccuracy()

    loss, metric = make()
    want = plain(loss, metric)
    PROFILES.clear()  # (the cost profile runs for an architecture the process has not measured yet)
    got_loss, got_metric = make()
    with ht.Runtime(devices=["cpu"], device_memory=budget) as rt:
        handle = rt.submit(_task(got_loss, got_metric))
        handle.result()
        got = handle.model()
    assert max_param_diff(want, got) == 0.0
    assert got_metric.calls == metric.calls == 2
    if kind == "object":
        assert got_loss.calls == loss.calls and got_loss.history == loss.history
    if kind == "module":
        assert torch.equal(got_loss.mean, loss.mean) and torch.equal(got_metric.seen, metric.seen)


class DistillationLoss(nn.Module):
    """Cross-entropy plus a KL term towards a teacher whose parameters were left trainable (its gradients add up
    over the plain loop's backwards)."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, out: torch.Tensor, batch: tuple) -> torch.Tensor:
        soft = F.softmax(self.teacher(batch[0]), -1)
        return F.cross_entropy(out, batch[1]) + F.kl_div(F.log_softmax(out, -1), soft, reduction="batchmean")


def _teacher_run(loss: DistillationLoss, rt=None) -> nn.Module:
    task = ht.ModelTask(_model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), TRAIN, loss=loss, epochs=2,
                        seed=0, name="distilled")
    if rt is None:
        torch.manual_seed(0)
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            for batch in TRAIN:
                opt.zero_grad()
                loss(model(batch[0]), batch).backward()
                opt.step()
        return model
    handle = rt.submit(task)
    handle.result()
    return handle.model()


def test_a_distillation_losss_teacher_gets_the_plain_loops_gradients():
    # before: the cost profile's backward through the loss added to the teacher's gradients (0.058 apart)
    torch.manual_seed(4)
    plain_loss = DistillationLoss()
    ours = DistillationLoss()
    ours.load_state_dict(plain_loss.state_dict())
    want = _teacher_run(plain_loss)
    PROFILES.clear()
    with ht.Runtime(devices=["cpu"]) as rt:
        got = _teacher_run(ours, rt)
    assert max_param_diff(want, got) == 0.0
    for a, b in zip(plain_loss.teacher.parameters(), ours.teacher.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_a_tensor_too_large_to_copy_that_the_loss_changes_is_named(monkeypatch):
    from hydra_tune.training import pystate_values

    monkeypatch.setattr(pystate_values, "COPY_LIMIT", 0)   # every tensor is "too large" here
    PROFILES.clear()
    with ht.Runtime(devices=["cpu"]) as rt, pytest.warns(RuntimeWarning, match=r"\['loss\.mean'\]"):
        rt.submit(_task(RunningMeanLoss(), CountedAccuracy())).result()
