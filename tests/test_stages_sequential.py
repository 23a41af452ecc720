"""nn.Sequential is cut by position, repeats included (issue 13): a reused instance is a stage at each place, its
parameters tied between stages; modules working in place join the stage before; a Sequential computing more than
its children (its own forward, hooks on itself) is one stage. Each trains like the plain loop (max diff 0.0)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from reference import max_param_diff, plain_train
from test_stages_exactness import _shard_of, _task, _train

from hydra_tune.stages import extract_stages


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
