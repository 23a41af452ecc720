"""The prepared model behaves as the user's model in their loop: attributes set on it reach the forward, a container
model is indexed and iterated as itself, ``apply`` and state-dict hooks act on the user's model, and what would
silently not reach the runtime (a new module, parameter or buffer, a dtype cast) is refused at the call. Trials
that share a frozen base stay apart: one trial's loop (unfreezing the base, loading a state dict) never changes
another's. Each exactness check compares the loop with and without ``prepare`` (max abs difference 0.0, fp32 on
CPU), on a runtime where the model's state stays on its device and on one with a tight budget (spilled or cut)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hydra_tune as ht

X = torch.randn(48, 16, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 4, (48,), generator=torch.Generator().manual_seed(2))


class Scaled(nn.Module):
    """A forward that reads a plain attribute the loop changes (a temperature, a mixing weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 4)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))


@pytest.fixture(scope="module", params=["64MiB", "12KiB"], ids=["resident", "tight-budget"])
def rt(request):
    with ht.Runtime(devices=["cpu"], device_memory=request.param) as runtime:
        yield runtime


def _loop(make, change, rt=None, steps: int = 6) -> tuple[dict, list[float]]:
    """A plain classifier loop; ``change(model, step)`` runs before each step's forward; ``rt``: prepared there."""
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if rt is not None:
        model, opt = ht.prepare(model, opt, runtime=rt)
    losses = []
    for s in range(steps):
        change(model, s)
        loss = F.cross_entropy(model(X[s * 8:(s + 1) * 8]), Y[s * 8:(s + 1) * 8])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if rt is not None:
        model.release()
    return state, losses


def _same(a: tuple[dict, list[float]], b: tuple[dict, list[float]]) -> None:
    assert max((a[0][k] - b[0][k]).abs().max().item() for k in a[0]) == 0.0
    assert a[1] == b[1]


def test_a_plain_attribute_set_on_the_prepared_model_reaches_its_forward(rt):
    # without forwarding, model.scale = ... landed on the proxy and the forward kept reading 1.0: silently other
    def change(model, step):
        if step in (0, 3):
            model.scale = 2.0 + step
            assert model.scale == 2.0 + step
    _same(_loop(Scaled, change), _loop(Scaled, change, rt))


class TrainingFlag(Scaled):
    """A forward that reads its own ``training`` flag."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (2.0 if self.training else 1.0)


def test_the_training_flag_set_directly_is_the_top_modules_as_in_the_plain_loop(rt):
    # ``model.training = False`` changes the top module's flag only; on the proxy alone its forward read True
    def change(model, step):
        if step == 2:
            model.training = False
            assert not model.training
    _same(_loop(TrainingFlag, change), _loop(TrainingFlag, change, rt))


def test_a_sequential_model_is_indexed_measured_and_iterated_as_itself(rt):
    def change(model, step):
        assert len(model) == 4 and isinstance(model[0], nn.Linear) and model[-1].out_features == 4
        assert [type(m).__name__ for m in model] == ["Linear", "ReLU", "Dropout", "Linear"]
        assert model[2] in model and bool(model)
        if step == 2:
            model[2].p = 0.5  # the submodule itself: the runtime runs it, as the plain loop does
    _same(_loop(_mlp, change), _loop(_mlp, change, rt))
    model, _ = _prepared(rt, Scaled)
    with pytest.raises(TypeError, match="not subscriptable"):  # as the user's own model would raise
        model[0]
    assert bool(model)  # a module without __len__ is true, prepared or not
    model.release()


def _prepared(rt, make=_mlp):
    model = make()
    return ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), runtime=rt)


@pytest.mark.parametrize("call", [
    lambda m: setattr(m, "head", nn.Linear(4, 4)),
    lambda m: setattr(m, "0", nn.Linear(16, 32)),
    lambda m: setattr(m, "extra", nn.Parameter(torch.zeros(3))),
    lambda m: m.register_buffer("running", torch.zeros(3)),
    lambda m: m.register_parameter("bias2", nn.Parameter(torch.zeros(3))),
    lambda m: m.add_module("head", nn.Linear(4, 4)),
    lambda m: m.__setitem__(0, nn.Linear(16, 32)),
    lambda m: m.__delitem__(0),
    lambda m: delattr(m, "0"),
], ids=["module", "replace-module", "parameter", "register_buffer", "register_parameter", "add_module", "setitem",
        "delitem", "delattr"])
def test_new_modules_parameters_and_buffers_on_the_prepared_model_are_refused(rt, call):
    model, opt = _prepared(rt)
    before = [id(p) for p in model.parameters()]
    with pytest.raises(RuntimeError, match="keeps the modules, parameters and buffers it was prepared with"):
        call(model)
    F.cross_entropy(model(X[:8]), Y[:8]).backward()  # the model trains on, unchanged
    opt.step()
    assert [id(p) for p in model.parameters()] == before and len(model) == 4
    model.release()


def test_casts_that_change_nothing_pass_and_others_are_refused(rt):
    model, _ = _prepared(rt)
    assert model.float() is model and model.to(torch.float32) is model and model.to("cpu", torch.float32) is model
    for call in (model.half, model.double, model.bfloat16, lambda: model.type(torch.float64),
                 lambda: model.to(torch.float16)):
        with pytest.raises(RuntimeError, match="keeps the dtype it was prepared with"):
            call()
    with pytest.raises(RuntimeError, match="keeps the modules"):
        model.to_empty(device="cpu")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    model.release()


def _frozen_base() -> nn.Module:
    torch.manual_seed(123)  # equal bytes in every trial: the runtime holds the frozen layer once for all of them
    base = nn.Linear(16, 32)
    base.requires_grad_(False)
    return nn.Sequential(base, nn.ReLU(), nn.Linear(32, 4))


def _trainable(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)


def _thawing_loop(model: nn.Module, opt: torch.optim.Optimizer, steps: int, thaw_at: int | None = None,
                  start: int = 0) -> None:
    """Trains minibatches ``start`` to ``steps - 1``; at ``thaw_at`` the frozen first layer is made trainable
    (gradual unfreezing)."""
    for s in range(start, steps):
        if s == thaw_at:
            model[0].requires_grad_(True)
            opt.add_param_group({"params": list(model[0].parameters()), "lr": 0.1})
        loss = F.cross_entropy(model(X[s * 8:(s + 1) * 8]), Y[s * 8:(s + 1) * 8])
        opt.zero_grad()
        loss.backward()
        opt.step()


def _max_diff(a: nn.Module, b: dict[str, torch.Tensor]) -> float:
    return max((b[k] - v).abs().max().item() for k, v in a.state_dict().items())


@pytest.mark.parametrize("budget,first", [(None, "B"), (None, "A"), ("7KiB", "A")],
                         ids=["B-brought-the-base", "A-brought-the-base", "A-brought-it-aliased-on-a-cpu-device"])
def test_a_trial_that_unfreezes_a_shared_base_in_its_loop_gets_its_own_copy_and_leaves_the_others_alone(budget,
                                                                                                        first):
    # two prepared trials share the frozen layer (one tensor); trial A unfreezes it mid-loop and adds it to its
    # optimizer. At first A's step wrote the shared tensor (trial B trained on from A's values, max diff 0.044);
    # then A's step was refused. Now A's layer becomes its own copy: A trains as the plain unfreezing loop does,
    # B as the plain frozen one. When A brought the base (its first call came first), the pool's tensor shared A's
    # parameter's in-place counter: A's steps after the thaw moved it, and a CPU device handing B the pooled tensor
    # itself (too small a budget to keep a copy) refused B's next unit as a write into shared weights
    plain_a, plain_b = _frozen_base(), _frozen_base()
    _thawing_loop(plain_a, _trainable(plain_a), 4, thaw_at=2)
    _thawing_loop(plain_b, _trainable(plain_b), 4)
    with ht.Runtime(devices=["cpu"], device_memory=budget) as rt:
        a, b = _frozen_base(), _frozen_base()
        a, a_opt = ht.prepare(a, _trainable(a), runtime=rt, name="A")
        b, b_opt = ht.prepare(b, _trainable(b), runtime=rt, name="B")
        if first == "A":
            _thawing_loop(a, a_opt, 1)
            _thawing_loop(b, b_opt, 2)
            _thawing_loop(a, a_opt, 4, thaw_at=2, start=1)
        else:
            _thawing_loop(b, b_opt, 2)
            _thawing_loop(a, a_opt, 4, thaw_at=2)
        pool = rt.stats()["shared_frozen"]
        _thawing_loop(b, b_opt, 4, start=2)  # B goes on from where it was, its frozen layer as it was built
        got_a = {k: v.clone() for k, v in a.state_dict().items()}
        got_b = {k: v.clone() for k, v in b.state_dict().items()}
        a.release()
        b.release()
    assert pool["thawed_copy_bytes"] == (32 * 16 + 32) * 4  # A's weight and bias copied, B still holds them
    assert pool["per_task_shared_bytes"] == {"B": (32 * 16 + 32) * 4}
    assert _max_diff(plain_a, got_a) == 0.0 and _max_diff(plain_b, got_b) == 0.0


@pytest.mark.parametrize("budget", ["64MiB", "12KiB"])
def test_a_lone_trial_unfreezing_its_pooled_base_trains_exactly_and_the_pool_lets_the_tensor_go(budget):
    # a trial alone in its runtime holds its frozen layer in the pool too: unfreezing it was refused as well
    plain = _frozen_base()
    _thawing_loop(plain, _trainable(plain), 5, thaw_at=2)
    with ht.Runtime(devices=["cpu"], device_memory=budget) as rt:
        model = _frozen_base()
        model, opt = ht.prepare(model, _trainable(model), runtime=rt)
        _thawing_loop(model, opt, 5, thaw_at=2)
        pool = rt.stats()["shared_frozen"]
        got = {k: v.clone() for k, v in model.state_dict().items()}
        model.release()
    assert pool["thawed_copy_bytes"] == 0 and pool["tensors"] == 0  # no copy: the pool's tensor became its own
    assert _max_diff(plain, got) == 0.0


def test_loading_a_state_dict_beside_a_shared_base_writes_only_the_trials_own_weights():
    # a checkpoint restore mid-loop (its own state dict, the base unchanged) failed the trial before, as a write
    # into the weight it shares; a state dict with another base changed the other trial's base (by 1.25)
    def loop(model, opt, steps, reload_at=None):
        for s in range(steps):
            if s == reload_at:
                model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
            loss = F.cross_entropy(model(X[s * 8:(s + 1) * 8]), Y[s * 8:(s + 1) * 8])
            opt.zero_grad()
            loss.backward()
            opt.step()

    plain = _frozen_base()
    loop(plain, _trainable(plain), 4, reload_at=2)
    with ht.Runtime(devices=["cpu"]) as rt:
        a, b = _frozen_base(), _frozen_base()
        base = b[0].weight.detach().clone()
        a, a_opt = ht.prepare(a, _trainable(a), runtime=rt, name="A")
        b, b_opt = ht.prepare(b, _trainable(b), runtime=rt, name="B")
        loop(b, b_opt, 1)
        loop(a, a_opt, 4, reload_at=2)  # its own weights back: the shared base's entry is equal, left out
        assert rt.stats()["shared_frozen"]["shared_bytes"] > 0
        other = {k: v.clone() for k, v in a.state_dict().items()}
        other["0.weight"] += 1.0
        with pytest.raises(RuntimeError, match=r"loaded with their own values only.*changed=\['0.weight'\]"):
            a.load_state_dict(other)
        with pytest.raises(RuntimeError, match="Missing key"):  # strict keeps its meaning for the rest
            a.load_state_dict({"0.weight": base})
        loop(b, b_opt, 1)
        got = {k: v.clone() for k, v in a.state_dict().items()}
        assert torch.equal(b.state_dict()["0.weight"], base)
        a.release()
        b.release()
    assert max((got[k] - v).abs().max().item() for k, v in plain.state_dict().items()) == 0.0


class MultiTask(Scaled):
    """A model with attributes named as the prepared model's own accessors: ``task`` and ``module``."""

    def __init__(self) -> None:
        super().__init__()
        self.task = "classify"
        self.module = nn.Identity()


def test_a_models_own_task_and_module_attributes_are_its_own_after_prepare(rt):
    # before, model.task read the runtime's handle and model.module the whole model: the loop's own reads changed
    model, opt = _prepared(rt, MultiTask)
    F.cross_entropy(model(X[:8]), Y[:8]).backward()
    opt.step()
    assert model.task == "classify" and isinstance(model.module, nn.Identity)
    assert model.hydra_task is not None and model.hydra_task.name.startswith("prepared")
    plain, _ = _prepared(rt, Scaled)
    assert plain.task is None and isinstance(plain.module, Scaled)  # the runtime's, where the model has none
    model.release()
    plain.release()


def test_apply_and_state_dict_hooks_reach_the_users_model(rt):
    # model.apply(fn) ran fn on the proxy as the top module (a top-level weight never seen); a state-dict hook
    # registered on the proxy never ran (state_dict() is the user's model's)
    class Top(Scaled):
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) + self.bias

    def reinit(m: nn.Module) -> None:
        if isinstance(m, Top):
            with torch.no_grad():
                m.bias.fill_(0.5)

    def change(model, step):
        if step == 3:
            assert model.apply(reinit) is model
    _same(_loop(Top, change), _loop(Top, change, rt))
    model, _ = _prepared(rt, Top)
    seen = []
    model.register_state_dict_post_hook(lambda module, sd, prefix, local_metadata: seen.append(type(module)))
    model.state_dict()
    assert seen == [Top]
    with pytest.raises(RuntimeError, match="keeps the modules"):
        model.share_memory()
    model.release()
