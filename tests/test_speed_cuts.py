"""The per-trial costs cut for many-trial speed stay exact: equal architectures are profiled once (and different
ones never share a profile), optimizer state is measured once per equal optimizer, the CPU copy rate once per
process, and gradients leave a shard behind one wait."""
from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import lm_batches, make_gpt2
from reference import max_param_diff, plain_train, trained

import hydra_tune as ht
import hydra_tune.training.profile as profile
from hydra_tune.device.devices import CpuDevice
from hydra_tune.device.streams import HostCopier
from hydra_tune.training.footprint import OPTIMIZER_BYTES, state_footprint
from hydra_tune.training.profile_cache import PROFILES
from hydra_tune.training.residency import ShardCache
from hydra_tune.training.state import TaskState


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _gpt2_task(seed: int = 0, data: list | None = None, precision: str = "fp32", **config) -> ht.ModelTask:
    return ht.ModelTask(lambda: make_gpt2(**config), _adamw, data or lm_batches(3, seed=5), epochs=2, seed=seed,
                        precision=precision, name=f"gpt2-{seed}")


@pytest.fixture
def profiles(monkeypatch):
    """A clear profile cache; ``runs()`` counts the stages actually measured since."""
    PROFILES.clear()
    measured = [0]
    real = profile._stage_cost

    def counting(*args, **kwargs):
        measured[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(profile, "_stage_cost", counting)
    yield lambda: measured[0]
    PROFILES.clear()


def _param_ids(state: TaskState) -> set[int]:
    return {k for c in state.costs for k, _, _ in c.params}


def test_equal_architectures_are_profiled_once_and_each_plan_names_its_own_parameters(profiles):
    first = TaskState.build(_gpt2_task(seed=0), None)
    stages = profiles()
    assert stages == 6  # embed, 4 blocks, head
    second = TaskState.build(_gpt2_task(seed=1), None)
    assert profiles() == stages, "the equal architecture was profiled again"
    assert PROFILES.info()["hits"] == 1
    assert _param_ids(second) == {id(p) for p in second.model.parameters()}
    assert _param_ids(first) == {id(p) for p in first.model.parameters()}
    assert [_by_place(c) for c in first.costs] == [_by_place(c) for c in second.costs]


def _by_place(cost):
    return dataclasses.replace(cost, params=tuple((n, g) for _, n, g in cost.params))


@pytest.mark.parametrize("variant", [
    dict(n_embd=48),              # one width
    dict(resid_pdrop=0.2),        # one dropout rate
    dict(precision="bf16"),       # precision
    dict(n_layer=3),              # depth
    dict(tie_word_embeddings=False),
    dict(data=lm_batches(3, seq=12, seed=5)),  # the batch's shapes
])
def test_a_model_that_differs_in_one_thing_gets_its_own_profile(profiles, variant):
    TaskState.build(_gpt2_task(seed=0), None)
    before = profiles()
    state = TaskState.build(_gpt2_task(seed=1, **variant), None)
    assert profiles() > before, f"{variant} reused another model's profile"
    PROFILES.clear()
    fresh = TaskState.build(_gpt2_task(seed=1, **variant), None)
    assert [(c.saved_bytes, c.bwd_peak, c.fwd_peak, len(c.params)) for c in state.costs] == \
        [(c.saved_bytes, c.bwd_peak, c.fwd_peak, len(c.params)) for c in fresh.costs]


def _mlp(width: int = 16, p: float = 0.1, act: type = nn.ReLU) -> nn.Module:
    return nn.Sequential(nn.Linear(8, width), act(), nn.Dropout(p), nn.Linear(width, 2))


def _mse(out: torch.Tensor, batch: tuple) -> torch.Tensor:
    return F.mse_loss(out, batch[1])


def _mlp_task(model=_mlp, loss=_mse, seed: int = 0, **kw) -> ht.ModelTask:
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(4)]
    return ht.ModelTask(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), data, loss=loss, epochs=2,
                        seed=seed, name=f"mlp-{seed}", **kw)


def _frozen_first() -> nn.Module:
    m = _mlp()
    m[0].weight.requires_grad_(False)
    return m


def _hooked() -> nn.Module:
    m = _mlp()
    m[1].register_forward_hook(lambda mod, inp, out: out * 2)
    return m


@pytest.mark.parametrize("other", [
    dict(model=lambda: _mlp(p=0.2)),                  # dropout p
    dict(model=lambda: _mlp(width=17)),               # one layer's width
    dict(model=lambda: _mlp(act=nn.GELU)),            # one module's class
    dict(model=_frozen_first),                        # a frozen parameter
    dict(model=_hooked),                              # a forward hook
    dict(loss=lambda out, b: F.l1_loss(out, b[1])),   # the loss
])
def test_sequential_models_that_differ_get_their_own_profile(profiles, other):
    TaskState.build(_mlp_task(), None)
    TaskState.build(_mlp_task(seed=1), None)
    assert PROFILES.info()["hits"] == 1  # the equal one reused it
    before = profiles()
    TaskState.build(_mlp_task(seed=2, **other), None)
    assert profiles() > before


def test_a_batch_past_the_profiled_values_is_checked_so_its_error_still_comes_at_submit(profiles):
    TaskState.build(_gpt2_task(seed=0), None)
    bad = lm_batches(2, seed=5)
    bad[0]["input_ids"][0, 0] = 500  # past the vocabulary (128): the embedding raises
    with ht.Runtime(devices=["cpu"]) as rt:
        with pytest.raises(IndexError):
            rt.submit(_gpt2_task(seed=1, data=bad))
    assert (PROFILES.info()["hits"], PROFILES.info()["checked"]) == (0, 1)


def test_a_checked_batch_leaves_the_model_and_the_generators_as_they_were(profiles):
    # Labels past the profiled ones: the equal architecture's costs are reused once this batch ran every stage's
    # forward and the loss without autograd (profile.py _stage_check), on the profile's scratch copies: no stage is
    # measured again, and no buffer, gradient or generator of the model's process changes.
    from hydra_tune.stages import extract_stages

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 12))

    def batch(labels: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(len(labels), 8, generator=torch.Generator().manual_seed(0)), torch.tensor(labels)

    def loss(out, b):
        return F.cross_entropy(out, b[1])

    profile.measure_costs(extract_stages(make()), batch([0, 1, 2, 3, 0, 1]), loss)
    measured = profiles()
    model = make()
    bn = model[1]
    kept = [t.clone() for t in (bn.running_mean, bn.running_var, bn.num_batches_tracked)]
    torch.manual_seed(7)
    generator = torch.get_rng_state()
    profile.measure_costs(extract_stages(model), batch([0, 5, 9, 11, 2, 3]), loss)
    assert (PROFILES.info()["checked"], profiles()) == (1, measured)
    assert torch.equal(torch.get_rng_state(), generator)
    assert all(torch.equal(a, b) for a, b in zip(kept, (bn.running_mean, bn.running_var, bn.num_batches_tracked)))
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(IndexError):  # a label past the 12 classes: the check's loss raises, as a profile's did
        profile.measure_costs(extract_stages(make()), batch([0, 1, 2, 12, 0, 1]), loss)


def test_a_model_that_cannot_be_keyed_is_profiled_every_time(profiles):
    class Locked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 2)
            self.lock = threading.Lock()  # no value to compare: the key is given up

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    with pytest.warns(RuntimeWarning):  # Locked cannot be deep-copied either (profile.py warns)
        TaskState.build(_mlp_task(model=Locked), None)
        first = profiles()
        TaskState.build(_mlp_task(model=Locked, seed=1), None)
    assert profiles() == 2 * first
    assert PROFILES.info()["unkeyable"] == 2


def test_the_profile_cache_keeps_nothing_of_a_task_alive(profiles):
    import gc
    import weakref

    def factory():
        table = torch.zeros(1000)  # reached only through the class's own method (a closure)

        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = nn.Linear(8, 2)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.lin(x) + table[:2]

        return Net(), weakref.ref(table)

    made = []

    def build():
        model, ref = factory()
        made.append(ref)
        return model

    state = TaskState.build(_mlp_task(model=build), None)
    assert PROFILES.info()["entries"] == 1
    del state
    gc.collect()
    assert made[0]() is None, "the cache keeps the task's class (and what its methods hold) alive"


def test_a_module_holding_much_data_is_profiled_every_time_not_walked(profiles):
    def holding() -> nn.Module:
        m = _mlp()
        m[0].table = list(range(100_000))  # past the keyer's LIMIT: walking it would cost more than it saves
        return m

    TaskState.build(_mlp_task(model=holding), None)
    TaskState.build(_mlp_task(model=holding, seed=1), None)
    assert PROFILES.info()["unkeyable"] == 2 and PROFILES.info()["hits"] == 0


def test_trials_of_one_architecture_in_one_runtime_profile_once_and_train_exactly(profiles):
    tasks = [_gpt2_task(seed=s) for s in (0, 1, 2)]
    with ht.Runtime(devices=["cpu"]) as rt:
        handles = [rt.submit(t) for t in tasks]
        models = [trained(h) for h in handles]
    assert profiles() == 6
    for task, model in zip(tasks, models):
        assert max_param_diff(plain_train(task)[0], model) == 0.0


def test_the_optimizer_state_of_an_equal_optimizer_is_measured_once():
    OPTIMIZER_BYTES.clear()
    base = state_footprint(_gpt2_task(seed=0))
    other_lr = ht.ModelTask(lambda: make_gpt2(), lambda m: torch.optim.AdamW(m.parameters(), lr=0.5),
                            lm_batches(1), name="lr")
    assert state_footprint(other_lr).optimizer == base.optimizer
    assert (OPTIMIZER_BYTES.hits, OPTIMIZER_BYTES.misses) == (1, 1)  # a learning rate makes no other state
    for opt, expect in ((lambda m: torch.optim.SGD(m.parameters(), lr=0.1), 0),
                        (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), base.optimizer // 2),
                        (lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True), None)):
        got = state_footprint(ht.ModelTask(lambda: make_gpt2(), opt, lm_batches(1), name="o")).optimizer
        if expect is not None:
            assert abs(got - expect) < 1024, (got, expect)  # Adam's step counters aside
        else:
            assert got > base.optimizer
    assert OPTIMIZER_BYTES.misses == 4


def test_cpu_devices_measure_their_copy_rate_once_per_process(monkeypatch):
    calls = [0]
    real = CpuDevice._measure_bandwidth

    def counting(self, *args):
        calls[0] += 1
        return real(self, *args)

    monkeypatch.setattr(CpuDevice, "_measure_bandwidth", counting)
    rates = []
    for _ in range(2):
        with ht.Runtime(devices=["cpu", "cpu"]) as rt:
            rates += [d.copy_bandwidth for d in rt.devices]
    assert calls[0] <= 1 and len(set(rates)) == 1 and rates[0] > 0


class _CountingCopier(HostCopier):
    """Counts the host's waits for copies out: a waiting ``to_host`` or a ``wait_copies_out``."""

    def __init__(self, device: CpuDevice) -> None:
        super().__init__(device.torch_device, device.account)
        self.waits = 0

    def to_host(self, t: torch.Tensor, wait: bool = True, what: str = "activations") -> torch.Tensor:
        self.waits += wait
        return super().to_host(t, wait, what)

    def wait_copies_out(self) -> None:
        self.waits += 1
        super().wait_copies_out()


def _deep_mlp() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)], nn.Linear(8, 2))


@pytest.mark.parametrize("budget", [None, 3000])
def test_gradients_leave_each_shard_behind_one_wait_and_train_exactly(budget):
    task = _mlp_task(model=_deep_mlp)
    state = TaskState.build(task, budget)
    assert (len(state.execs) == 1) == (budget is None)
    device = CpuDevice("cpu:0", None)
    device.resident = ShardCache()
    device.copier = copier = _CountingCopier(device)
    waits: dict[str, list[int]] = {}
    for seg in state.segments(lambda m: None):
        for unit in seg.units:
            before = copier.waits
            unit.run(device)
            waits.setdefault(unit.kind, []).append(copier.waits - before)
    # 14 parameters: a wait per parameter would be 14 (or its shard's share) per L/B unit
    assert set(waits["L"]) == {1} and set(waits.get("B", [1])) == {1}, waits
    assert max_param_diff(plain_train(task)[0], state.model) == 0.0


def test_the_random_router_intercepts_random_functions_on_the_cpu_only(monkeypatch):
    import hydra_tune.device.dispatch as dispatch
    import hydra_tune.device.dropout as dropout

    pushed = []

    class Spy(dispatch.UnitMode):
        def __enter__(self):
            pushed.append(self)
            return super().__enter__()

    monkeypatch.setattr(dispatch, "UnitMode", Spy)
    # dropout's short form as this torch's verdict allows it (checked in test_dropout_route.py; pinned here so that
    # what ran earlier in this process cannot change which path this test sees)
    monkeypatch.setattr(dropout, "_verdict", [True])
    g = torch.Generator().manual_seed(0)
    with dispatch.RandomRouter(g):
        F.dropout(torch.ones(8, device="meta"), 0.5)  # a tensor off the CPU (CUDA's stand-in here)
        torch.bernoulli(torch.full((8,), 0.5, device="meta"))
        assert pushed == []
        torch.bernoulli(torch.full((8,), 0.5))
        F.dropout(torch.ones(8), 0.5)  # (its common case: four calls with ``g``, no mode: device/dropout.py)
    assert len(pushed) == 1, (len(pushed), F.dropout is dropout.DROPOUT)
    # the CPU draw came from ``g``: the same mask as a plain dropout after manual_seed(0)
    torch.manual_seed(0)
    plain = F.dropout(torch.ones(8), 0.5)
    with dispatch.RandomRouter(torch.Generator().manual_seed(0)):
        routed = F.dropout(torch.ones(8), 0.5)
    assert torch.equal(plain, routed)
