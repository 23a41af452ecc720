"""A hook on a container that the stages bypass (GPT-2's ``transformer``: the stages call its blocks directly)
would never run: such a model runs as one stage, with a warning, and trains as the plain loop does."""
from __future__ import annotations

import pytest
import torch
from conftest import lm_batches, make_gpt2
from reference import max_param_diff, plain_train, trained

import hydra_tune as ht
from hydra_tune.stages import extract_stages


def _hooked_gpt2():
    model = make_gpt2()
    model.transformer.register_forward_hook(
        lambda m, args, out: type(out)(**{**out, "last_hidden_state": out.last_hidden_state * 0.5}))
    return model


def test_a_hook_on_a_bypassed_container_makes_the_model_one_stage():
    with pytest.warns(UserWarning, match=r"as one stage: forward hooks or a replaced forward on \['transformer'\]"):
        assert extract_stages(_hooked_gpt2()).family == "whole"
    assert extract_stages(make_gpt2()).family == "gpt2"  # no hook: cut as before


def test_a_model_with_such_a_hook_trains_like_plain():
    task = ht.ModelTask(_hooked_gpt2, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), lm_batches(3),
                        epochs=2, seed=3, name="hooked")
    with pytest.warns(UserWarning, match="as one stage"), ht.Runtime(devices=["cpu"]) as rt:
        model = trained(rt.submit(task))
    assert max_param_diff(plain_train(task)[0], model) == 0.0
