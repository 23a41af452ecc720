"""A resumed task continues exactly as the uninterrupted one and the plain loop: the Python state a forward changes
travels in the checkpoint (or the checkpoint is refused, naming it); ReduceLROnPlateau's reductions survive
``resume_hparams="task"``; an eval loader's own generator continues its order.
Found in the hunt: a custom optimizer's attributes; parametrizations and hooks kept as regression cases. The train
data's state across a resume: test_resume_data.py."""
from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, plain_train
from test_state_exactness import (
    MIDDLES,
    Annealed,
    EmaCount,
    TensorAttr,
    _around,
    _data,
    _hook_object,
    _hooked_linear,
    _loss,
    assert_same_state,
    plain,
)
from test_state_exactness import _task as _state_task
from torch.utils.data import (
    DataLoader,
    TensorDataset,
)

import hydra_tune as ht
from hydra_tune.device.devices import CpuDevice
from hydra_tune.training import checkpoint
from hydra_tune.training.residency import ShardCache
from hydra_tune.training.state import TaskState


def _run(task: ht.ModelTask, ask_after: tuple[int, ...] = (), path: Any = None, budget: int | None = None
         ) -> tuple[TaskState, list[dict], list[Any]]:
    """Build ``task`` for ``budget`` and run all its segments on one CPU device in this thread. After the training
    segments numbered in ``ask_after`` (1-based) a checkpoint to ``path / f"c{n}.pt"`` is asked: it is served at the
    step boundary that follows. Returns the state, the epochs' metrics and the requests."""
    state = TaskState.build(task, budget)
    device = CpuDevice("cpu:0", None)
    device.resident = ShardCache()
    metrics: list[dict] = []
    requests, trained = [], 0
    for seg in state.segments(metrics.append):
        for unit in seg.units:
            unit.run(device)
        trained += seg.train
        if seg.train and trained in ask_after:
            requests.append(state.request_checkpoint(str(path / f"c{trained}.pt")))
    device.resident.clear()
    return state, metrics, requests


def _same(metrics: list[dict], expected: list[dict]) -> bool:
    keys = ("epoch", "train_loss", "eval_loss", "steps", "lr")
    return [[m.get(k) for k in keys] for m in metrics] == [[m.get(k) for k in keys] for m in expected]


# -- 1. Python state a forward changes ------------------------------------------------------------------------
class _Schedule:
    step = 0


class Annealing(nn.Module):
    """Python state of every kind a forward changes: a call counter annealing a temperature (rebound int, float),
    a deque of recent input means, a dict of counts (training and eval), an attribute the first forward adds, a
    plain object stepped one level down. ``act``, a function attribute, never changes (not carried, not refused)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.calls = 0
        self.temp = 1.0
        self.recent: collections.deque[float] = collections.deque(maxlen=3)
        self.counts = {"train": 0, "eval": 0}
        self.schedule = _Schedule()
        self.act = torch.tanh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.counts["train" if self.training else "eval"] += 1
        if self.training:
            self.calls += 1
            self.temp = 1.0 / (1.0 + 0.05 * self.calls)
            self.recent.append(float(x.detach().mean()))
            self.schedule.step += 1
            if not hasattr(self, "first_shape"):
                self.first_shape = tuple(x.shape)
        bias = sum(self.recent) / max(len(self.recent), 1)
        return self.act(self.lin(x) * self.temp + 0.01 * bias + 0.001 * self.schedule.step)


def _stateful() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), EmaCount(32), nn.ReLU(), Annealed(32), Annealing(32), _hooked_linear(32),
                         TensorAttr(32, "rebind"), _hook_object(), nn.Linear(32, 4))


def _python_state(model: nn.Module) -> dict[str, Any]:
    """The Python state of ``_stateful``'s modules, read directly."""
    ann, anneal, hooked, attr, obj = model[3], model[4], model[5], model[6], model[7]
    return {"annealed": (ann.calls, list(ann.seen)),
            "annealing": (anneal.calls, anneal.temp, list(anneal.recent), anneal.recent.maxlen, dict(anneal.counts),
                          anneal.schedule.step, getattr(anneal, "first_shape", None), anneal.act is torch.tanh),
            "hook closure": hooked.hook_calls(), "tensor attribute": (attr.t.tolist(), attr.schedule.step),
            "hook object": [h.n for h in obj._forward_pre_hooks.values()]}


def _stateful_task(**kw: Any) -> ht.ModelTask:
    return ht.ModelTask(_stateful, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), _data(4, 1),
                        loss=_loss, eval_data=_data(2, 9), epochs=3, seed=3, name="py", **kw)


@pytest.mark.parametrize("budget,resumed_budget", [(None, 20_000), (20_000, None)])
def test_python_state_a_forward_changes_survives_a_checkpoint(tmp_path, budget, resumed_budget):
    """Checkpointed mid-epoch 1 and mid-epoch 2 (after an evaluation), resumed on another plan: the parameters,
    buffers and Python state end as the uninterrupted task's and the plain loop's."""
    whole, metrics, requests = _run(_stateful_task(), ask_after=(3, 6), path=tmp_path, budget=budget)
    expected = plain(_stateful_task())
    assert max_param_diff(expected, whole.model) == 0.0
    assert _python_state(whole.model) == _python_state(expected)
    assert _python_state(expected)["annealing"][0] == 12   # 4 batches x 3 epochs
    for req in requests:
        path = req.wait(0)
        pos = checkpoint.load(path)["position"]
        resumed, resumed_metrics, _ = _run(_stateful_task(resume_from=path), budget=resumed_budget)
        assert max_param_diff(whole.model, resumed.model) == 0.0, pos
        assert max_param_diff(expected, resumed.model) == 0.0, pos
        assert all(torch.equal(v, resumed.model.state_dict()[k]) for k, v in whole.model.state_dict().items())
        assert _python_state(resumed.model) == _python_state(whole.model), pos   # before: counters from 0
        assert _same(resumed_metrics, [m for m in metrics if m["epoch"] >= pos["epoch"]]), pos


class _Gate:
    """A plain object (not storable by ``torch.load(weights_only=True)``)."""

    def __init__(self, p: float) -> None:
        self.p = p


class LazyGate(nn.Module):
    """Adds a plain object as an attribute at its first forward."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "gate"):
            self.gate = _Gate(0.5)
        return self.lin(x) * self.gate.p


class SelfHooking(nn.Module):
    """Registers a forward hook on itself at its first forward (the flag it sets is storable, the hook is not)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.hooked = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.hooked:
            self.hooked = True
            self.lin.register_forward_hook(lambda m, args, out: out * 0.5)
        return self.lin(x)


def _gated_task(middle: type, **kw: Any) -> ht.ModelTask:
    return ht.ModelTask(lambda: nn.Sequential(nn.Linear(16, 32), middle(32), nn.ReLU(), nn.Linear(32, 4)),
                        lambda m: torch.optim.SGD(m.parameters(), lr=0.05), _data(4, 1), loss=_loss, epochs=2,
                        seed=3, name="gated", **kw)


def test_python_state_a_checkpoint_cannot_store_refuses_the_checkpoint(tmp_path):
    """The request fails naming the module, the attribute, its type and the fix; the task goes on and ends as the
    plain loop does."""
    state, _, requests = _run(_gated_task(LazyGate), ask_after=(2,), path=tmp_path)
    with pytest.raises(TypeError) as info:
        requests[0].wait(0)
    assert str(info.value).startswith(
        "the Python state a forward changes can be stored in a checkpoint (read with torch.load(weights_only=True)"
        ": None, bool, int, float, complex, str, bytes, tensors, torch.dtype/device/Size and tuples, lists, dicts "
        "and sets of them) must hold, but got (task='gated', module='1', attribute='gate', type='_Gate'). Fix: ")
    assert "keep such state as numbers, strings or tensors" in str(info.value)
    assert not (tmp_path / "c2.pt").exists()
    assert max_param_diff(plain(_gated_task(LazyGate)), state.model) == 0.0


def test_a_hook_registered_during_training_refuses_the_checkpoint(tmp_path):
    state, _, requests = _run(_gated_task(SelfHooking), ask_after=(2,), path=tmp_path)
    with pytest.raises(TypeError, match=r"no hook is registered or removed on the model while it trains .* but got "
                                        r"\(task='gated', module='1.lin', hooks='_forward_hooks', built=0, now=1\)"):
        requests[0].wait(0)
    assert max_param_diff(plain(_gated_task(SelfHooking)), state.model) == 0.0


# -- 2. ReduceLROnPlateau with resume_hparams="task" ------------------------------------------------------------
def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _xy(n: int, seed: int, rows: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)) for _ in range(n)]


def _mse(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.mse_loss(out, batch[1])


def _plateau(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.ReduceLROnPlateau:
    return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5, threshold=0.3)


def _plateau_task(lr: float = 0.2, **kw: Any) -> ht.ModelTask:
    return ht.ModelTask(_mlp, lambda m: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9), _xy(5, 1),
                        eval_data=kw.pop("eval_data", _xy(3, 2)), loss=_mse, epochs=6, seed=4, lr_scheduler=_plateau,
                        lr_scheduler_metric="eval_loss", name="plateau", **kw)


def _plain_plateau(task: ht.ModelTask) -> tuple[nn.Module, list[float], list[float]]:
    """The plain loop: train an epoch, evaluate, ``scheduler.step(eval_loss)``; the model, the learning rates and
    the eval losses after each epoch."""
    torch.manual_seed(task.seed)
    model = task.model()
    opt = task.optimizer(model)
    sched = task.lr_scheduler(opt)
    lrs, evals = [], []
    for _ in range(task.epochs):
        for batch in task.train_data:
            task.loss(model(batch[0]), batch).backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            ev = [task.loss(model(b[0]), b).item() for b in task.eval_data]
        model.train()
        evals.append(sum(ev) / len(ev))
        sched.step(evals[-1])
        lrs.append(opt.param_groups[0]["lr"])
    return model, lrs, evals


def test_plateau_reductions_survive_resume_hparams_task(tmp_path):
    """Checkpointed after epoch 3 (the rate lowered before): resumed with the same hyper-parameters as "task",
    the run ends as the uninterrupted one; with a doubled base rate, the reduced rate doubles."""
    whole, metrics, requests = _run(_plateau_task(), ask_after=(16,), path=tmp_path)   # served after epoch 4's first
    expected, lrs, _ = _plain_plateau(_plateau_task())
    assert [m["lr"] for m in metrics] == lrs and max_param_diff(expected, whole.model) == 0.0
    path = requests[0].wait(0)
    pos = checkpoint.load(path)["position"]
    assert (pos["epoch"], pos["batch_in_epoch"]) == (4, 1) and lrs[2] < 0.2, (pos, lrs)   # lowered before
    resumed, resumed_metrics, _ = _run(_plateau_task(resume_from=path, resume_hparams="task"))
    assert [m["lr"] for m in resumed_metrics] == lrs[3:]   # before: back at 0.2
    assert max_param_diff(whole.model, resumed.model) == 0.0
    explored = TaskState.build(_plateau_task(0.4, resume_from=path, resume_hparams="task"), None)
    assert explored.optimizer.param_groups[0]["lr"] == 2 * lrs[2]   # the same position, doubled base


def test_plateau_base_of_a_task_resumed_with_new_hparams_is_its_own(tmp_path):
    """A task resumed with a new base rate and checkpointed again: a further "task" resume scales from the new
    base; one keeping the checkpoint's hyper-parameters continues exactly."""
    _, _, first = _run(_plateau_task(), ask_after=(11,), path=tmp_path)   # after epoch 3's first step
    second_dir = tmp_path / "second"
    explored, metrics, again = _run(_plateau_task(0.4, resume_from=first[0].wait(0), resume_hparams="task"),
                                    ask_after=(5,), path=second_dir)   # 5 trained since: after epoch 4's first
    path = again[0].wait(0)
    lr_at = checkpoint.load(path)["optimizer"]["param_groups"][0]["lr"]
    same = TaskState.build(_plateau_task(0.4, resume_from=path, resume_hparams="task"), None)
    assert same.optimizer.param_groups[0]["lr"] == lr_at
    halved = TaskState.build(_plateau_task(0.2, resume_from=path, resume_hparams="task"), None)
    assert halved.optimizer.param_groups[0]["lr"] == lr_at / 2
    kept, kept_metrics, _ = _run(_plateau_task(0.2, resume_from=path))   # "checkpoint": the explored run goes on
    assert max_param_diff(explored.model, kept.model) == 0.0
    assert _same(kept_metrics, [m for m in metrics if m["epoch"] >= 4])


# -- 3. an eval loader with its own generator -------------------------------------------------------------------
def _shuffled_eval() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(10, 8, generator=g), torch.randn(10, 4, generator=g))
    # drop_last: each evaluation leaves out the two samples its shuffle puts last, so the order shows in eval_loss
    return DataLoader(data, batch_size=4, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(11))


def test_eval_loader_generator_continues_after_resume(tmp_path):
    whole, metrics, requests = _run(_plateau_task(eval_data=_shuffled_eval()), ask_after=(12,), path=tmp_path)
    expected, lrs, evals = _plain_plateau(_plateau_task(eval_data=_shuffled_eval()))
    assert [m["eval_loss"] for m in metrics] == evals and max_param_diff(expected, whole.model) == 0.0
    path = requests[0].wait(0)
    assert checkpoint.load(path)["position"]["epoch"] == 3   # two evaluations before it
    resumed, resumed_metrics, _ = _run(_plateau_task(eval_data=_shuffled_eval(), resume_from=path))
    assert [m["eval_loss"] for m in resumed_metrics] == evals[2:]   # before: the order restarted
    assert _same(resumed_metrics, metrics[2:])
    assert max_param_diff(whole.model, resumed.model) == 0.0 and max_param_diff(expected, resumed.model) == 0.0


def test_resume_with_other_eval_generators_is_refused(tmp_path):
    _, _, requests = _run(_plateau_task(eval_data=_shuffled_eval()), ask_after=(7,), path=tmp_path)
    with pytest.raises(ValueError, match=r"the resumed task's eval data has as many generators of its own as the "
                                         r"checkpointed task's .* but got \(task='plateau', checkpoint=1, data=0\)"):
        TaskState.build(_plateau_task(resume_from=requests[0].wait(0)), None)


@pytest.mark.parametrize("middle", sorted(MIDDLES))
def test_hooks_and_parametrizations_resume_exactly(tmp_path, middle):
    """Parametrizations, the old norm hooks, a hook object with a counter, a tensor attribute: checkpointed
    mid-epoch 2 (after an evaluation), resumed on another plan."""
    def task(**kw: Any) -> ht.ModelTask:
        return _state_task(_around(MIDDLES[middle]), eval_data=_data(1, 9), **kw)

    whole, _, requests = _run(task(), ask_after=(5,), path=tmp_path)
    resumed, _, _ = _run(task(resume_from=requests[0].wait(0)), budget=40_000)
    assert_same_state(whole.model, resumed.model)
    assert_same_state(plain(task()), resumed.model)


class _CountingSGD(torch.optim.SGD):
    """A custom optimizer keeping a step counter as an attribute (not in its state_dict) that damps its steps."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr=lr, momentum=0.9)
        self.calls = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self.calls += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(1.0 / (1.0 + 0.2 * self.calls))
        return super().step(closure)


def test_a_custom_optimizers_attributes_survive_a_checkpoint(tmp_path):
    def task(**kw: Any) -> ht.ModelTask:
        return ht.ModelTask(_mlp, lambda m: _CountingSGD(m.parameters(), lr=0.1), _xy(5, 1), loss=_mse, epochs=3,
                            seed=2, name="opt", **kw)

    whole, _, requests = _run(task(), ask_after=(7,), path=tmp_path)
    assert max_param_diff(plain_train(task())[0], whole.model) == 0.0
    resumed, _, _ = _run(task(resume_from=requests[0].wait(0)))
    assert resumed.optimizer.calls == whole.optimizer.calls == 15
    assert max_param_diff(whole.model, resumed.model) == 0.0   # before: the counter restarted at 7
