"""Stages run what the model's forward runs, or the task is refused at submit (issue 13).

nn.Sequential is cut by position, repeats included (a reused instance is a stage at each place, its parameters
tied between stages); declared stages are checked on the first batch against the model's own forward: the same
output bit for bit, each stage from its input alone, the same state changes, no parameter changed in place.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, plain_train, trained

import hydra_tune as ht
from hydra_tune.device.dispatch import UnitMode
from hydra_tune.stages import extract_stages
from hydra_tune.stages.check import check_stages

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


# -- nn.Sequential reusing one instance ------------------------------------------------------------------------
def _shared_activation() -> nn.Module:
    act = nn.ReLU()
    return nn.Sequential(nn.Linear(16, 32), act, nn.Linear(32, 32), act, nn.Linear(32, 16))


def _shared_linear() -> nn.Module:
    shared = nn.Linear(16, 16)   # one weight used three times: a tied parameter of three stages
    return nn.Sequential(shared, nn.Tanh(), nn.Linear(16, 16), nn.Dropout(0.1), nn.Linear(16, 16), nn.Tanh(),
                         shared, nn.Tanh(), nn.Linear(16, 16), shared)


def _nested_reuse() -> nn.Module:
    act = nn.Tanh()
    inner = nn.Sequential(nn.Linear(16, 16), act, nn.Linear(16, 16), act)   # a repeat inside
    return nn.Sequential(inner, nn.Dropout(0.1), inner, nn.Linear(16, 16))  # and the block itself twice


@pytest.mark.parametrize("memory", [None, 20_000])
def test_sequential_reusing_an_activation_trains_like_the_plain_loop(memory):
    task = _task(_shared_activation, f"act-{memory}")
    assert [s.name for s in extract_stages(_shared_activation()).stages] == [
        "0:Linear", "1:ReLU", "2:Linear", "3:ReLU", "4:Linear"]
    model, shards = _train(task, memory)
    assert (len(shards) > 1) == (memory is not None)
    assert max_param_diff(plain_train(task)[0], model) == 0.0


def test_sequential_reusing_a_linear_in_different_shards_trains_like_the_plain_loop():
    task = _task(_shared_linear, "tied-linear")
    model, shards = _train(task, 12_000)
    assert len({_shard_of(shards, s) for s in ("0:Linear", "6:Linear", "9:Linear")}) == 3, shards
    plain = plain_train(task)[0]
    assert model[0] is model[6] is model[9] and len(list(model.parameters())) == len(list(plain.parameters()))
    assert max_param_diff(plain, model) == 0.0


def test_nested_sequential_reused_trains_like_the_plain_loop():
    task = _task(_nested_reuse, "nested")
    model, shards = _train(task, 12_000)
    assert _shard_of(shards, "0:Sequential") != _shard_of(shards, "2:Sequential"), shards
    assert max_param_diff(plain_train(task)[0], model) == 0.0


def _inplace() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.2, inplace=True), nn.ReLU(inplace=True), nn.Linear(32, 32),
                         nn.Tanh(), nn.Linear(32, 16), nn.LeakyReLU(inplace=True))


def test_modules_working_in_place_join_the_stage_before_and_train_like_the_plain_loop():
    task = _task(_inplace, "inplace")
    model, shards = _train(task, 20_000)
    assert len(shards) > 1 and [n for names in shards for n in names] == [
        "0:Linear+1:Dropout+2:ReLU", "3:Linear", "4:Tanh", "5:Linear+6:LeakyReLU"]
    assert max_param_diff(plain_train(task)[0], model) == 0.0


class _Scaled(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * 0.5)


def _scaled() -> nn.Module:
    return _Scaled(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))


def _hooked() -> nn.Module:
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    model.register_forward_hook(lambda m, args, out: out * 2)
    return model


def _replaced() -> nn.Module:
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    model.forward = lambda x: nn.Sequential.forward(model, x.flip(-1))
    return model


@pytest.mark.parametrize("make, why", [(_scaled, "it subclasses nn.Sequential with its own forward"),
                                       (_hooked, "it has forward hooks on itself"),
                                       (_replaced, "its forward is replaced on the instance")])
def test_sequential_computing_more_than_its_children_is_one_stage(make, why):
    with pytest.warns(UserWarning, match=f"hydra_tune runs .* as one stage: {why}, which its parts alone"):
        assert extract_stages(make()).family == "whole"
    task = _task(make, f"more-{make.__name__}")
    with pytest.warns(UserWarning, match="Declare its stages"):
        model, _ = _train(task)
    assert max_param_diff(plain_train(task)[0], model) == 0.0


def test_a_transformers_model_with_a_hook_on_itself_is_one_stage():
    from conftest import make_gpt2

    model = make_gpt2()
    assert extract_stages(model).family == "gpt2"
    model.register_forward_pre_hook(lambda m, args, kwargs: (args, {**kwargs, "input_ids": kwargs["input_ids"] % 7}),
                                    with_kwargs=True)
    with pytest.warns(UserWarning, match="runs GPT2LMHeadModel as one stage: it has forward hooks on itself"):
        assert extract_stages(model).family == "whole"


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
    (Called, lambda m: [m.fc1, m.scale, m.fc2], "stage 1 (1:Scaled) gets 1 input, forward calls it with 2 args, 0 kwargs"),
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


# -- state outside the carry -----------------------------------------------------------------------------------
class Enc(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.saved = torch.tanh(self.lin(x))  # kept for the decoder's skip connection: not in the carry
        return self.saved


class Dec(nn.Module):
    def __init__(self, enc: Enc) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.__dict__["enc"] = enc  # a plain reference: the encoder's parameters stay in its own stage

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h + self.enc.saved)


class Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.mid = Enc(), nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.dec = Dec(self.enc)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.mid(self.enc(x)))


def test_a_stage_reading_what_an_earlier_stage_kept_is_refused():
    task = _task(Skip, "skip", stages=lambda m: [m.enc, m.mid, m.dec])
    with pytest.raises(ValueError, match=r"each declared stage computes from its input alone .* must hold, but got "
                                         r"\(task='skip', stage='stage 2 \(2:Dec\)', alone=\"AttributeError"):
        _train(task, 12_000)


class Counting(TwoLayer):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]  # the model's own code: no stage runs it
        return super().forward(x)


def test_state_forward_changes_outside_the_stages_is_refused():
    task = _task(Counting, "counting", stages=lambda m: [nn.Sequential(m.fc1, nn.ReLU()), m.fc2])
    with pytest.raises(ValueError, match=r"the declared stages change the model's buffers and attributes as its "
                                         r"forward does must hold, but got \(task='counting', state='seen', "
                                         r"max_abs_diff=8.0\)"):
        _train(task)


class ClampedLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.weight.clamp_(-0.05, 0.05)
        return super().forward(x)


class Clamped(TwoLayer):
    def __init__(self) -> None:
        super().__init__()
        self.fc2 = ClampedLinear(32, 16)


def test_forward_changing_a_parameter_in_place_is_refused_and_the_model_untouched():
    model = Clamped()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    task = _task(model, "clamped", stages=lambda m: [nn.Sequential(m.fc1, nn.ReLU()), m.fc2])
    with pytest.raises(ValueError, match=r"the model's forward changes no parameter in place must hold, but got "
                                         r"\(task='clamped', parameter='fc2.weight'\)"):
        _train(task)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# -- the check itself leaves nothing behind --------------------------------------------------------------------
class Busy(nn.Module):
    """Random ops (torch's, Python's and numpy's, in two stages), BatchNorm statistics and a call counter, all
    inside stage modules."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.3), Jitter())
        self.gate = Gate()
        self.out = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gate(self.inp(x)))


class Jitter(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + random.gauss(0.0, 1.0) + float(np.random.rand())


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return h * random.random() + torch.rand_like(h)


def test_the_check_leaves_the_model_and_every_random_stream_as_they_were():
    model = Busy().train()
    stages = lambda m: [m.inp, m.gate, m.out]  # noqa: E731
    cut = extract_stages(model, stages)
    batch = _data(1)[0]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    streams = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    check_stages(model, cut, batch, UnitMode, seed=7, task="busy")
    assert model.training and model.gate.calls == 0
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), streams[0]) and random.getstate() == streams[1]
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), streams[2]))
    # and it does check: the same stages less the gate are refused
    with pytest.raises(ValueError, match=RULE):
        check_stages(model, extract_stages(model, lambda m: [m.inp, nn.Identity(), m.out]), batch, UnitMode, 7)


class Locked(TwoLayer):
    def __init__(self) -> None:
        super().__init__()
        import threading

        self.lock = threading.Lock()  # deepcopy cannot copy it


def test_a_model_that_cannot_be_copied_trains_unchecked_with_a_warning():
    task = _task(Locked, "locked", stages=lambda m: [nn.Sequential(m.fc1, nn.ReLU()), m.fc2])
    with pytest.warns(UserWarning, match=r"could not check the declared stages of task 'locked' against the "
                                         r"model's forward: the model cannot be deep-copied \(TypeError"):
        model, _ = _train(task)
    assert max_param_diff(plain_train(task)[0], model) == 0.0
