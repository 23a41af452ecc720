"""Small and short trials (issue 15): the fast paths keep every result exact.

Each test compares with the plain PyTorch loop (tests/reference.py): max abs parameter difference 0.0 on CPU fp32.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, plain_train, trained

import hydra_tune as ht


def _data(n: int, seed: int = 0, width: int = 8) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, width, generator=g), torch.randn(4, width, generator=g)) for _ in range(n)]


class _Reused(nn.Module):
    """One Linear applied twice (the same submodule under two names), dropout in between: a stage whose
    parameters appear twice in named_parameters(remove_duplicate=False)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.again = self.first
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.again(self.drop(torch.relu(self.first(x))))


def _task(model, name: str = "t", **kw) -> ht.ModelTask:
    return ht.ModelTask(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), _data(5),
                        loss=lambda out, b: F.mse_loss(out, b[1]), epochs=2, seed=3, name=name, **kw)


def test_a_submodule_used_under_two_names_trains_exactly_and_keeps_its_parameters():
    # torch.func.functional_call(tie_weights=False) swaps such a slot twice and puts the swapped-in tensor back
    # last: the model was left holding a unit's copy instead of its own Parameter
    ref, _ = plain_train(_task(_Reused))
    with ht.Runtime(devices=["cpu"]) as rt:
        model = trained(rt.submit(_task(_Reused)))
    assert isinstance(model.first.weight, nn.Parameter) and model.first.weight is model.again.weight
    assert max_param_diff(ref, model) == 0.0


def test_lrtf_affinity_band_prefers_a_task_whose_state_is_here_only_within_the_band():
    from hydra_tune.policy.schedule import Ready, lrtf

    ready = [Ready("there", 1, 1, remaining=10.0), Ready("here", 2, 0, remaining=8.0)]
    assert lrtf(ready, 0) == 0                       # no band (the simulator): the longest
    assert lrtf(ready, 0, affinity=0.3) == 1         # 8 >= 0.7 * 10: no state moves both ways
    assert lrtf(ready, 0, affinity=0.1) == 0         # 8 < 0.9 * 10: the longest still goes first
    three = [Ready("there", 1, 1, 10.0), Ready("there too", 2, 1, 9.5), Ready("here", 3, 0, 8.0)]
    assert lrtf(three, 0, idle=(2,), affinity=0.3) == 0  # another device idle: the window rule alone, as before
    fresh = [Ready("new", 1, None, remaining=10.0), Ready("here", 2, 0, remaining=9.0)]
    assert lrtf(fresh, 0, affinity=0.3) == 0         # the longest never ran: nothing to move, it goes first


def test_many_small_trials_on_two_devices_stay_exact():
    # Many equal tasks on two devices: the affinity band and running a local ready task instead of waiting for a
    # kept one's host thread change only the order; every task ends with exactly the plain loop's weights.
    tasks = [_task(lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 8)),
                   name=f"s{i}") for i in range(6)]
    refs = [plain_train(t)[0] for t in tasks]
    with ht.Runtime(devices=["cpu", "cpu"]) as rt:
        handles = [rt.submit(t) for t in tasks]
        models = [trained(h) for h in handles]
    assert [max_param_diff(r, m) for r, m in zip(refs, models)] == [0.0] * len(tasks)


def _lm_task(seed: int, data: list) -> ht.ModelTask:
    from conftest import make_gpt2

    return ht.ModelTask(make_gpt2, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), data, epochs=1, seed=seed,
                        name=f"lm{seed}")


def _ids(lo: int, hi: int, seed: int) -> list:
    from conftest import lm_batches

    batches = lm_batches(2, seed=seed)
    for b in batches:  # token ids spread over [lo, hi], both ends present
        ids = b["input_ids"]
        ids.copy_(torch.randint(lo, hi + 1, ids.shape, generator=torch.Generator().manual_seed(seed)))
        ids[0, 0], ids[0, 1] = lo, hi
        b["labels"] = ids.clone()
    return batches


def test_trials_whose_token_ranges_differ_reuse_the_profile_after_a_check():
    # Trials over their own data (seeds, shuffles) have token ranges that differ a little each: a trial whose range
    # stuck out of every kept one was profiled again (~0.25 s of a short GPT-2 trial's submit). It now takes the
    # equal architecture's costs (they depend on shapes alone) once its batch ran every stage's forward and the
    # loss without autograd, so an id past the vocabulary still raises at submit.
    from conftest import make_gpt2

    from hydra_tune.stages import extract_stages
    from hydra_tune.training.profile import measure_costs
    from hydra_tune.training.profile_cache import PROFILES
    from hydra_tune.training.state import TaskState

    def fresh(batch: dict) -> list:
        PROFILES.clear()
        return measure_costs(extract_stages(make_gpt2()), batch)

    def by_stage(costs: list) -> list:
        return [(c.name, [(n, g) for _, n, g in c.params], c.fwd_peak, c.bwd_peak) for c in costs]

    other = _ids(20, 127, 1)
    try:
        expected = by_stage(fresh(other[0]))  # what a profile of that batch measures
        PROFILES.clear()
        TaskState.build(_lm_task(0, _ids(0, 100, 0)), None)                      # profiled
        checked = measure_costs(extract_stages(make_gpt2()), other[0])           # ids past 100: checked
        assert PROFILES.info() | {"entries": 0} == {"hits": 0, "checked": 1, "misses": 1, "unkeyable": 0,
                                                      "entries": 0}
        assert by_stage(checked) == expected
        TaskState.build(_lm_task(1, other), None)                # its ranges joined the key's: reused as it is
        TaskState.build(_lm_task(2, _ids(1, 126, 2)), None)      # within the union [0, 127]: no check
        assert PROFILES.info() | {"entries": 0} == {"hits": 2, "checked": 1, "misses": 1, "unkeyable": 0,
                                                      "entries": 0}
        bad = _ids(0, 127, 3)
        bad[0]["input_ids"][0, 2] = 500  # past the vocabulary (128): checked, so it raises at submit
        with ht.Runtime(devices=["cpu"]) as rt, pytest.raises(IndexError):
            rt.submit(_lm_task(3, bad))
        assert PROFILES.info()["checked"] == 2
        with ht.Runtime(devices=["cpu"]) as rt:  # its ranges were not kept: raised again
            with pytest.raises(IndexError):
                rt.submit(_lm_task(3, bad))
            h = rt.submit(_lm_task(4, _ids(0, 127, 4)))  # a checked trial trains as the plain loop does
            ref, _ = plain_train(_lm_task(4, _ids(0, 127, 4)))
            assert max_param_diff(ref, trained(h)) == 0.0
    finally:
        PROFILES.clear()
