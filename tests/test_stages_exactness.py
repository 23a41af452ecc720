"""Declared stages run what the model's forward runs, or the task is refused at submit (issue 13).

Declared stages are checked on the first batch against the model's own forward: the same output bit for bit, in
train and eval mode, each module forward calls declared in order. Topics elsewhere: nn.Sequential cut by position
(test_stages_sequential.py); state kept outside the carry and what the check leaves behind (test_stages_state.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, plain_train, trained

import hydra_tune as ht
from hydra_tune.stages import extract_stages

RULE = "the declared stages, run in order on the sample batch, reproduce the model's own forward output exactly"


def _data(n: int = 3, width: int = 16, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, width, generator=g), torch.randn(8, width, generator=g)) for _ in range(n)]


def _loss(out: torch.Tensor, batch: tuple) -> torch.Tensor:
    return F.mse_loss(out, batch[1])


def _task(model, name: str, **kw) -> ht.ModelTask:
    return ht.ModelTask(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), _data(), loss=_loss,
                        epochs=2, name=name, **kw)


def _train(task: ht.ModelTask, device_memory: int | None = None) -> tuple[nn.Module, list[list[str]]]:
    with ht.Runtime(devices=["cpu"], device_memory=device_memory) as rt:
        model = trained(rt.submit(task))
        return model, rt.stats()["tasks"][task.name]["shards"]


def _shard_of(shards: list[list[str]], stage: str) -> int:
    return next(i for i, names in enumerate(shards) if stage in names)


# -- declared stages checked against forward ------------------------------------------------------------------
class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Framed(TwoLayer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x.flip(-1)))


class Scaled(nn.Module):
    def forward(self, h: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return h * scale


class Called(TwoLayer):
    def __init__(self) -> None:
        super().__init__()
        self.scale = Scaled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.scale(self.fc1(x), 3.0))


class Once(TwoLayer):
    def __init__(self) -> None:
        super().__init__()
        self.mid = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.mid(self.fc1(x)))


@pytest.mark.parametrize("make, stages, where", [
    (TwoLayer, lambda m: [m.fc1, m.fc2], "between stage 0 (0:Linear) and stage 1 (1:Linear)"),
    (Framed, lambda m: [m.fc1, m.fc2], "between the batch and stage 0 (0:Linear)"),
    (Framed, lambda m: [nn.Sequential(nn.Identity()), m.fc1, m.fc2], "between stage 0 (0:Sequential) and stage 1"),
    (Called, lambda m: [m.fc1, m.scale, m.fc2],
     "stage 1 (1:Scaled) gets 1 input, forward calls it with 2 args, 0 kwargs"),
    (Once, lambda m: [m.fc1, m.mid, m.mid, m.fc2], "between stage 2 (2:Linear) and stage 3 (3:Linear)"),
    (lambda: Twice(), lambda m: [m.inp, m.block, m.drop, m.out], "between stage 2 (2:Dropout) and stage 3 (3:Linear)"),
])
def test_declared_stages_that_leave_out_forward_work_are_refused(make, stages, where):
    task = _task(make, "declared", stages=stages)
    with pytest.raises(ValueError, match=RULE) as err:
        _train(task)
    msg = str(err.value)
    assert f"first_difference='{where}" in msg and "Fix: declare every module forward calls, in order" in msg
    diff = float(msg.split("max_abs_diff=")[1].split(")")[0])
    assert diff > 0 or diff != diff  # a number, or nan where the stage is called with other arguments
    assert "hydra_stages()" in msg


class Tail(TwoLayer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc2(torch.relu(self.fc1(x))))


def test_forward_work_after_the_last_stage_is_named():
    task = _task(Tail, "tail", stages=lambda m: [nn.Sequential(m.fc1, nn.ReLU()), m.fc2])
    with pytest.raises(ValueError, match=RULE + r".*first_difference='after the last stage 1 \(1:Linear\): "
                                                r"output', max_abs_diff=\d"):
        _train(task)


def test_the_declaration_with_nothing_left_out_trains_like_the_plain_loop():
    task = _task(TwoLayer, "complete", stages=lambda m: [nn.Sequential(m.fc1, nn.ReLU()), m.fc2])
    model, shards = _train(task, 12_000)
    assert len(shards) == 2
    assert max_param_diff(plain_train(task)[0], model) == 0.0


class InPlace(TwoLayer):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("stages", [lambda m: [m.fc1, m.act, m.fc2], lambda m: [m.fc1, nn.ReLU(inplace=True), m.fc2]])
def test_a_declared_stage_working_in_place_joins_the_one_before(stages):
    task = _task(InPlace, "declared-inplace", stages=stages)
    model, shards = _train(task, 12_000)
    assert shards == [["0:Linear+1:ReLU"], ["2:Linear"]]
    assert max_param_diff(plain_train(task)[0], model) == 0.0


class EvalDropout(TwoLayer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.dropout(torch.relu(self.fc1(x)), 0.3, self.training))


class EvalClamp(TwoLayer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.training else out.clamp(-0.1, 0.1)


def _eval_loss(model: nn.Module, data: list) -> float:
    model.eval()
    with torch.no_grad():
        return sum(_loss(model(x), (x, y)).item() for x, y in data) / len(data)


def test_a_stages_own_dropout_follows_the_models_eval_mode():
    task = _task(EvalDropout, "eval-dropout", eval_data=_data(seed=1),
                 stages=lambda m: [nn.Sequential(m.fc1, nn.ReLU(), nn.Dropout(0.3)), m.fc2])
    with ht.Runtime(devices=["cpu"], device_memory=12_000) as rt:
        handle = rt.submit(task)
        metrics, model = list(handle.metrics()), trained(handle)
    plain, _ = plain_train(task)
    assert max_param_diff(plain, model) == 0.0
    assert metrics[-1]["eval_loss"] == _eval_loss(plain, _data(seed=1))


def test_stages_that_differ_from_forward_only_in_eval_mode_are_refused():
    task = _task(EvalClamp, "eval-clamp", eval_data=_data(seed=1),
                 stages=lambda m: [nn.Sequential(m.fc1, nn.ReLU()), m.fc2])
    with pytest.raises(ValueError, match=RULE + r" must hold, but got \(task='eval-clamp', first_difference='in eval "
                                                r"mode, after the last stage 1 \(1:Linear\): output', max_abs_diff="):
        _train(task)
    _train(_task(EvalClamp, "eval-clamp", stages=lambda m: [nn.Sequential(m.fc1, nn.ReLU()), m.fc2]))  # no eval


class Twice(nn.Module):
    """A block forward calls twice (weights shared): declared twice, in different shards."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(16, 32), nn.Sequential(nn.Linear(32, 32), nn.Tanh()), \
            nn.Linear(32, 16)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.drop(self.block(self.inp(x)))))


def test_a_module_forward_calls_twice_is_declared_twice_and_trains_like_the_plain_loop():
    task = _task(Twice, "twice", stages=lambda m: [m.inp, m.block, m.drop, m.block, m.out])
    model, shards = _train(task, 20_000)
    assert _shard_of(shards, "1:Sequential") != _shard_of(shards, "3:Sequential"), shards
    assert max_param_diff(plain_train(task)[0], model) == 0.0


def test_swapped_stages_name_the_stage_that_cannot_run():
    task = _task(TwoLayer, "swapped", stages=lambda m: [m.fc2, m.fc1])
    with pytest.raises(ValueError, match=r"each declared stage runs on the previous stage's output must hold, but "
                                         r"got \(task='swapped', stage='stage 0 \(0:Linear\)', error='RuntimeError"):
        _train(task)


def test_a_module_list_stage_is_refused():
    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x

    with pytest.raises(TypeError, match=r"each stage from `stages\(model\)` is a module with a forward must hold, "
                                        r"but got \(stage=0, type='ModuleList'\). Fix: list its items"):
        extract_stages(Blocks(), lambda m: [m.blocks])
    task = _task(Blocks, "listed", stages=lambda m: [*m.blocks])
    assert max_param_diff(plain_train(task)[0], _train(task, 12_000)[0]) == 0.0
