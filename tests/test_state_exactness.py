"""State a forward keeps outside its parameters ends as in the plain loop, or is refused: buffers changed in place
(BatchNorm) or by reassignment (an EMA, a counter), Python attributes (a call counter annealing a temperature, a
list), the state of forward hooks (a closure counter), torch's parametrizations and norm hooks; unsharded, sharded
in each backward mode, with evaluation and after an out-of-memory retry. Submitting a task (the cost profile, the
footprint estimate) changes nothing of the user's objects."""
from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import SqueezingLoss, run_in_mode, trained

import hydra_tune as ht
from hydra_tune.training.state import TaskState


class EmaCount(nn.Module):
    """Buffers updated by reassignment: an EMA of the input (training only) that the output uses, and a counter
    of every forward (training and eval)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.register_buffer("ema", torch.zeros(n))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.ema = 0.9 * self.ema + 0.1 * x.detach().mean(0)
        self.count = self.count + 1
        return self.lin(x - self.ema) * (1.0 + 0.01 * self.count)


class Annealed(nn.Module):
    """Python state changed by forward: a call counter annealing a temperature, and a list whose length scales."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.calls = 0
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            self.seen.append(x.shape[0])
        return self.lin(x) / (1.0 + 0.1 * self.calls + 0.01 * len(self.seen))


def _hooked_linear(n: int) -> nn.Linear:
    """A Linear whose forward pre-hook keeps state in its closure (a counter scaling the input)."""
    lin = nn.Linear(n, n)
    calls = 0

    def pre_hook(module: nn.Module, args: tuple) -> tuple:
        nonlocal calls
        calls += 1
        return (args[0] * (1.0 + 0.02 * calls),)

    lin.register_forward_pre_hook(pre_hook)
    lin.hook_calls = lambda: calls  # type: ignore[attr-defined]  (read by the tests)
    return lin


def stateful_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), EmaCount(32), nn.ReLU(), Annealed(32), nn.BatchNorm1d(32), nn.ReLU(),
                         _hooked_linear(32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _data(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def _loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.mse_loss(out, batch[1])


def _task(factory: Any = stateful_model, eval_data: Any = None, loss: Any = _loss, **kw: Any) -> ht.ModelTask:
    return ht.ModelTask(factory, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), _data(4, 1),
                        loss=loss, eval_data=eval_data, epochs=2, seed=3, **kw)


def plain(task: ht.ModelTask) -> nn.Module:
    """The user's own loop: train each epoch, then evaluate it in eval mode without autograd."""
    torch.manual_seed(task.seed)
    model = task.model()
    model.train()
    opt = task.optimizer(model)
    for _ in range(task.epochs):
        for i, batch in enumerate(task.train_data):
            loss = task.loss(model(batch[0]), batch) / task.grad_accumulation
            loss.backward()
            if (i + 1) % task.grad_accumulation == 0:
                opt.step()
                opt.zero_grad()
        if task.eval_data is not None:
            model.eval()
            with torch.no_grad():
                for batch in task.eval_data:
                    task.loss(model(batch[0]), batch)
            model.train()
    return model


def python_state(model: nn.Module) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, m in model.named_modules():
        if isinstance(m, Annealed):  # and _Locked
            out[name] = (m.calls, list(m.seen))
        if hasattr(m, "hook_calls"):
            out[name] = m.hook_calls()
    return out


def assert_same_state(expected: nn.Module, got: nn.Module) -> None:
    """Every parameter and buffer (integer ones too) equal bit for bit, and the Python state equal."""
    a, b = expected.state_dict(), got.state_dict()
    assert a.keys() == b.keys()
    diffs = {k: (a[k].double() - b[k].double()).abs().max().item() for k in a if not torch.equal(a[k], b[k])}
    assert diffs == {}, diffs
    assert python_state(expected) == python_state(got)


def smallest_plan(task: ht.ModelTask) -> TaskState:
    """``task`` built for the tightest budget that plans it (the most shards)."""
    for budget in range(20_000, 200_000, 4_000):
        try:
            return TaskState.build(task, budget)
        except ht.PlanError:
            continue
    raise AssertionError("no budget up to 200 KB plans this model")


def run_forced(task: ht.ModelTask, mode: str) -> TaskState:
    """Build ``task`` for the tightest budget and run all its segments on one CPU device with every shard but the
    last in ``mode`` (recompute, keep or offload)."""
    state = smallest_plan(task)
    assert len(state.execs) >= 3, state.plan
    device = run_in_mode(state, mode)
    assert device.account.current == 0, "the model holds device tensors after training (attributes)"
    return state


SHARDED = 20_000  # bytes: the stateful model in 5+ shards, EmaCount, Annealed and the hook in non-last ones


# -- buffers and Python state: unsharded, sharded, eval, out-of-memory ------------------------------------------
def test_unsharded_with_eval_matches_plain():
    task = _task(eval_data=_data(2, 9))
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        got = trained(rt.submit(task))
    assert_same_state(plain(task), got)


@pytest.mark.parametrize("mode", ["recompute", "keep", "offload"])
def test_sharded_each_backward_mode_with_eval_matches_plain(mode):
    task = _task(eval_data=_data(2, 9))
    state = run_forced(task, mode)
    last = state.execs[-1].names
    assert not {"1:EmaCount", "3:Annealed", "4:BatchNorm1d", "6:Linear"} & set(last), last  # all in F/B shards
    assert_same_state(plain(task), state.model)


def test_sharded_grad_accumulation_on_runtime_matches_plain():
    task = _task(grad_accumulation=2)
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=SHARDED) as rt:
        h = rt.submit(task)
        got = trained(h)
        assert len(rt.stats()["tasks"][task.name]["shards"]) >= 3
    assert_same_state(plain(task), got)


@pytest.mark.parametrize("budget,share", [(40_000, 0.7), (None, 0.5)])  # 3 shards -> 5; 1 -> 2 -> 7
def test_out_of_memory_retry_applies_each_update_once(budget, share):
    # with a budget, residency "off": the share is of the units' peak with the whole budget theirs (planned for
    # per-shard entries it would leave a stage no room: tests/test_lazy_runtime.py runs out of memory there)
    residency = "auto" if budget is None else "off"
    with ht.Runtime(config=ht.RuntimeConfig(devices=["cpu"], device_memory=budget, residency=residency)) as rt:
        # The first minibatch's last unit fails after the stateful forwards ran: its loss leaves the device no room
        # (not `share` of the peak right after submit: whether the task then ran out of memory, and where, depended
        # on when the copy thread's prefetch landed; reference.SqueezingLoss), then the device has `share` of it.
        loss = SqueezingLoss(_loss, rt.devices[0], share)
        task = _task(eval_data=_data(1, 9), loss=loss)
        h = rt.submit(task)
        loss.arm(rt.stats()["tasks"][task.name]["predicted_peak"])
        got = trained(h)
        assert loss.squeezed
        assert rt.stats()["tasks"][task.name]["replans"] >= 1
    assert_same_state(plain(task), got)


def test_a_minibatch_abandoned_after_its_offloaded_forwards_leaves_no_device_bytes():
    # What an out-of-memory retry or a cancel does with the forwards' graphs: drop them. EmaCount reassigns its
    # buffers, freeing their old copies mid-forward; an activation that takes a freed copy's storage id stays an
    # activation (moved to host memory), and nothing of a graph outlives the minibatch (it once kept a shard's
    # parameter copies on the device until the task ended, and a re-plan for a tight budget failed).
    import gc

    from hydra_tune.device.devices import CpuDevice
    from hydra_tune.training.residency import ShardCache

    from hydra_tune.policy.partition import Plan, shard_of

    state = TaskState.build(_task(), None)
    cuts = [(0, 1), (1, 3), (3, len(state.costs))]  # EmaCount and the ReLU after it in one offloading forward
    k = len(cuts)
    shards = tuple(shard_of(state.costs, a, b, index=i) for i, (a, b) in enumerate(cuts))
    state.reshard(Plan(shards, None, 0, keep=(False,) * k, offload=(True,) * (k - 1) + (False,)), replanned=False)
    device = CpuDevice("cpu:0", None)
    device.resident = ShardCache()
    segment = next(iter(state.segments(lambda m: None)))
    for unit in segment.units:
        if unit.kind != "F":
            break
        unit.run(device)
    assert len(state.store.kept) == k - 1
    device.resident.clear()
    state.store.clear()
    gc.collect()
    assert device.account.current == 0


# -- submit touches nothing of the user's objects -----------------------------------------------------------------
def test_a_python_counter_in_forward_trains_like_plain():
    def factory() -> nn.Module:
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), Annealed(32), nn.Linear(32, 4))

    task = _task(factory)
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        got = trained(rt.submit(task))
    expected = plain(task)
    assert_same_state(expected, got)
    assert got[2].calls == 8  # 4 batches, 2 epochs: the profile's forwards did not count


def test_submit_and_footprint_leave_the_users_model_as_it_was():
    from hydra_tune.training.footprint import estimate_footprint

    model = stateful_model()
    model[6].weight.grad = torch.ones_like(model[6].weight)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    task = _task(model)
    rng = torch.get_rng_state()
    estimate_footprint(task, budget=SHARDED)
    TaskState.build(task, SHARDED)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert python_state(model) == {"3": (0, []), "6": 0}
    assert torch.equal(model[6].weight.grad, torch.ones_like(model[6].weight))
    assert all(p.grad is None for n, p in model.named_parameters() if not n.startswith("6."))
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training and all(m.training for m in model.modules())


# -- state kept outside parameters and buffers: which is exact, which is refused -------------------------------
class _CountingHook:
    """A forward pre-hook object with a counter scaling the input."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        self.n += 1
        return (args[0] * (1.0 + 0.01 * self.n),)


class _Schedule:
    step = 0


class TensorAttr(nn.Module):
    """A tensor attribute that is not a buffer, an EMA of the input: assigned anew (``rebind``) or changed in
    place (``inplace``); and a plain schedule object stepped by forward."""

    def __init__(self, n: int, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.how = how
        self.t = torch.zeros(n)
        self.schedule = _Schedule()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.schedule.step += 1
            if self.how == "rebind":
                self.t = 0.9 * self.t + 0.1 * x.detach().mean(0)
            else:
                self.t.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return self.lin(x + self.t) / (1.0 + 0.1 * self.schedule.step)


def _hook_object() -> nn.Module:
    lin = nn.Linear(32, 32)
    lin.register_forward_pre_hook(_CountingHook())
    return lin


class _Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return (w + w.T) / 2


def _custom_parametrization() -> nn.Module:
    lin = nn.Linear(32, 32)
    torch.nn.utils.parametrize.register_parametrization(lin, "weight", _Symmetric())
    return lin


def _old_weight_norm() -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated by torch, still used
        return nn.utils.weight_norm(nn.Linear(32, 32))


MIDDLES = {
    "parametrizations.weight_norm": lambda: nn.utils.parametrizations.weight_norm(nn.Linear(32, 32)),
    "parametrizations.spectral_norm": lambda: nn.utils.parametrizations.spectral_norm(nn.Linear(32, 32)),
    "register_parametrization": _custom_parametrization,
    "weight_norm hook": _old_weight_norm,
    "spectral_norm hook": lambda: nn.utils.spectral_norm(nn.Linear(32, 32)),
    "hook object": _hook_object,
    "tensor attribute assigned": lambda: TensorAttr(32, "rebind"),
}


def _around(middle: Any) -> Any:
    def factory() -> nn.Module:
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), middle(), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(),
                             nn.Linear(32, 4))

    return factory


@pytest.mark.parametrize("mode", ["unsharded", "recompute", "keep", "offload"])
@pytest.mark.parametrize("middle", sorted(MIDDLES))
def test_state_outside_parameters_and_buffers_matches_plain(middle, mode):
    task = _task(_around(MIDDLES[middle]), eval_data=_data(1, 9))
    if mode == "unsharded":
        with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
            got = trained(rt.submit(task))
    else:
        got = run_forced(task, mode).model
    expected = plain(task)
    assert_same_state(expected, got)
    if isinstance(expected[2], TensorAttr):
        assert torch.equal(expected[2].t, got[2].t) and got[2].schedule.step == 8
    if middle == "hook object":
        assert [h.n for h in got[2]._forward_pre_hooks.values()] == [8 + 2]  # 4 batches x 2 epochs, 2 evals


def test_tensor_attribute_changed_in_place_trains_exactly_without_recompute_and_is_refused_with_it():
    task = _task(_around(lambda: TensorAttr(32, "inplace")))
    got = run_forced(task, "keep").model
    expected = plain(task)
    assert_same_state(expected, got)
    assert torch.equal(expected[2].t, got[2].t)
    with pytest.raises(ValueError, match=r"changes no tensor attribute in place.*attributes=\['TensorAttr\.t'\]"
                                         r".*Fix: register such a tensor as a buffer"):
        run_forced(_task(_around(lambda: TensorAttr(32, "inplace"))), "recompute")


def test_tensor_attribute_changed_in_place_fails_a_retried_minibatch_visibly():
    task = _task(_around(lambda: TensorAttr(32, "inplace")))
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        h = rt.submit(task)
        rt.devices[0].limit_memory(int(0.5 * rt.stats()["tasks"][task.name]["predicted_peak"]))
        with pytest.raises(ValueError, match=r"retried after a device out-of-memory.*TensorAttr\.t"):
            h.result()


class _Widening(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 4)
        self.how = how
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + 0.5 if self.how == "dtype" else self.count.expand(2) + 1
        return self.lin(x)


@pytest.mark.parametrize("how,assigned", [("dtype", "torch.float32 ()"), ("shape", "torch.int64 (2,)")])
def test_buffer_assigned_another_dtype_or_shape_is_refused_at_submit(how, assigned):
    task = _task(lambda: nn.Sequential(_Widening(how)))
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        with pytest.raises(ValueError, match=re.escape(
                f"(buffer='count', stage='0:_Widening', was='torch.int64 ()', assigned='{assigned}'). Fix: assign")):
            rt.submit(task)


class _Locked(Annealed):
    """Holds an object deepcopy refuses (a lock): the profile runs the module itself and puts its state back."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        import threading

        self.lock = threading.Lock()


def test_a_model_that_cannot_be_copied_is_profiled_itself_with_a_warning_and_its_state_put_back():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), _Locked(32), nn.Linear(32, 4))
    task = _task(model)
    with pytest.warns(RuntimeWarning, match=r"profiles the model's own modules: they cannot be deep-copied"):
        TaskState.build(task, None)
    assert (model[2].calls, model[2].seen) == (0, [])
    task = _task(lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), _Locked(32), nn.Linear(32, 4)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
            got = trained(rt.submit(task))
    assert_same_state(plain(task), got)
    assert got[2].calls == 8


class _GradCounted(Annealed):
    """Counts only forwards that run with autograd (the F unit of a recomputed shard ran without it once)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.calls += 1
        return self.lin(x) / (1.0 + 0.1 * self.calls)


def test_state_updated_only_with_autograd_is_exact_in_every_mode():
    task = _task(_around(lambda: _GradCounted(32)))
    for mode in ("keep", "offload", "recompute"):   # F runs with autograd, as the plain loop's forward
        assert_same_state(plain(task), run_forced(task, mode).model)


class _EveryOtherCall(Annealed):
    """Counts every other call of its class (a counter outside the module): a recompute never repeats what its
    forward changed."""

    ticks = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).ticks += 1
        if type(self).ticks % 2:
            self.calls += 1
        return self.lin(x) / (1.0 + 0.1 * self.calls)


def test_state_a_recompute_changes_otherwise_is_refused():
    with pytest.raises(ValueError, match=r"changes the same Python state when recomputed.*"
                                         r"_EveryOtherCall\.calls"):
        run_forced(_task(_around(lambda: _EveryOtherCall(32))), "recompute")
