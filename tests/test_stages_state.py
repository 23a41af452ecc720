"""Declared stages and state (issue 13): a stage reading what an earlier one kept, state forward changes outside
the stages and parameters changed in place are refused at submit; the check itself leaves the model and every
random stream as they were, and a model it cannot copy trains unchecked with a warning."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn as nn
from reference import max_param_diff, plain_train
from test_stages_exactness import RULE, TwoLayer, _data, _task, _train

from hydra_tune.device.dispatch import UnitMode
from hydra_tune.stages import extract_stages
from hydra_tune.stages.check import check_stages


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
