"""The lazy per-shard step's rules (hydra_tune/training/step): which optimizers it takes and why not the others,
clipping and scaling cut into shards against torch's own functions, hooks and errors, the pending record's
lifecycle, a tensor lr, steps that cannot be split, tied parameters (GPT-2), and CUDA where there is one."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
from lazy_harness import SCENARIOS, OptCfg, Scenario, differences, run

from hydra_tune.training.step import (
    ALLOWED,
    PendingStep,
    StepSnapshot,
    check_lazy,
    clip_coefficient,
    clip_shard,
    shard_norms,
    step_shard,
    total_norm,
)

optim = torch.optim


def _params(n: int = 2) -> list[nn.Parameter]:
    return [nn.Parameter(torch.ones(3)) for _ in range(n)]


# ------------------------------------------------------------------------------------------------ check_lazy
@pytest.mark.parametrize("cls", sorted(ALLOWED, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_every_allowlisted_optimizer_is_lazy_in_every_implementation(cls):
    fused = cls in (optim.SGD, optim.Adam, optim.AdamW, optim.Adagrad)
    impls = [{"foreach": False}, {"foreach": True}, {}] + ([{"fused": True}] if fused else [])
    for kw in impls:
        opt = cls(_params(), lr=0.1, **kw)
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # wraps opt.step: still torch's own step
        verdict = check_lazy(opt, torch.amp.GradScaler("cpu"), nn.Linear(2, 2))
        assert verdict.lazy and cls.__name__ in verdict.reason, (kw, verdict)


class _MyAdamW(optim.AdamW):
    pass


class _OwnOptimizer(optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    def step(self, closure=None):
        return None


class _MyScaler(torch.amp.GradScaler):
    pass


def _hooked(kind: str):
    opt = optim.AdamW(_params())
    getattr(opt, f"register_step_{kind}_hook")(lambda *a: None)
    return opt


def _patched():
    opt = optim.AdamW(_params())
    opt.step = lambda closure=None: None
    return opt


REFUSED = {
    "LBFGS": (lambda: optim.LBFGS(_params()), None, None, "LBFGS re-evaluates the loss over all parameters"),
    "SparseAdam": (lambda: optim.SparseAdam(_params()), None, None, "SparseAdam steps sparse gradients"),
    "Adafactor": (lambda: optim.Adafactor(_params()), None, None, "torch.optim.Adafactor is not on the lazy-step "),
    "subclass": (lambda: _MyAdamW(_params()), None, None, "is a subclass of torch.optim.AdamW"),
    "other package": (lambda: _OwnOptimizer(_params()), None, None, "is not a torch.optim optimizer on the"),
    "pre hook": (lambda: _hooked("pre"), None, None, "the optimizer has a step pre-hook"),
    "post hook": (lambda: _hooked("post"), None, None, "the optimizer has a step post-hook"),
    "patched step": (_patched, None, None, "optimizer.step was replaced on the instance"),
    "differentiable": (lambda: optim.Adam(_params(), differentiable=True), None, None, "differentiable=True"),
    "capturable": (lambda: optim.Adam(_params(), capturable=True), None, None, "capturable=True"),
    "scaler subclass": (lambda: optim.AdamW(_params()), _MyScaler("cpu"), None, "the loss scaler"),
    "sparse embedding": (lambda: optim.SGD(_params(), lr=0.1), None, nn.Embedding(4, 2, sparse=True),
                         "makes sparse gradients"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_optimizer_off_the_allowlist_is_refused_with_its_reason(case):
    make, scaler, model, why = REFUSED[case]
    verdict = check_lazy(make(), scaler, model)
    assert not verdict.lazy and why in verdict.reason, verdict


@pytest.mark.parametrize("kind", ["pre", "post"])
def test_a_global_step_hook_refuses_the_lazy_step(kind):
    import torch.optim.optimizer as torch_optimizer

    register = getattr(torch_optimizer, f"register_optimizer_step_{kind}_hook")
    handle = register(lambda *a: None)
    try:
        verdict = check_lazy(optim.AdamW(_params()))
    finally:
        handle.remove()
    assert not verdict.lazy and f"global optimizer step {kind}-hook" in verdict.reason
    assert check_lazy(optim.AdamW(_params())).lazy


# ------------------------------------------------------------------------------------------------ step_shard
def _stepped_once(opt_cls=optim.Adam):
    ps = _params(3)
    opt = opt_cls([{"params": ps[:2]}, {"params": ps[2:], "lr": 0.5}], lr=0.1)
    for p in ps:
        p.grad = torch.full((3,), 0.5)
    return ps, opt


def test_a_hook_registered_later_fails_the_shard_step_and_the_groups_come_back():
    ps, opt = _stepped_once()
    groups, snap = opt.param_groups, StepSnapshot.take(opt)
    handle = opt.register_step_pre_hook(lambda *a: None)
    with pytest.raises(RuntimeError, match="no step hook while it is stepped per shard"):
        step_shard(opt, ps[:1], snap)
    handle.remove()
    assert opt.param_groups is groups and torch.equal(ps[0], torch.ones(3))


def test_the_groups_and_hyper_parameters_come_back_even_when_the_step_fails():
    ps, opt = _stepped_once()
    snap = StepSnapshot.take(opt)
    groups, lr = opt.param_groups, [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 9.0  # as a scheduler would, after the snapshot
    ps[2].grad = torch.ones(3).to_sparse()  # Adam raises on a sparse gradient
    with pytest.raises(RuntimeError):
        step_shard(opt, ps[1:], snap)
    assert opt.param_groups is groups and [g["lr"] for g in groups] == [9.0, 9.0] and lr == [0.1, 0.5]
    assert [len(g["params"]) for g in groups] == [2, 1] and "grad_scale" not in vars(opt)


def test_a_parameter_outside_the_optimizer_or_changed_groups_are_refused():
    ps, opt = _stepped_once()
    snap = StepSnapshot.take(opt)
    with pytest.raises(ValueError, match="every parameter stepped per shard is a parameter of the optimizer"):
        step_shard(opt, [nn.Parameter(torch.ones(1))], snap)
    opt.add_param_group({"params": [nn.Parameter(torch.ones(1))]})
    with pytest.raises(RuntimeError, match="param groups hold the parameters they held at the step's snapshot"):
        step_shard(opt, ps[:1], snap)


def test_a_tensor_lr_that_the_scheduler_changes_in_place_is_snapshotted():
    warmup = Scenario("warmup", schedule="warmup")
    for impl in ("for", "fused"):
        cfg = OptCfg(optim.Adam, dict(lr=torch.tensor(0.01)), impl)
        plain = run(cfg, warmup)
        assert differences(plain, run(cfg, warmup, 4)) == [], impl


# ------------------------------------------------------------------------------------------------ clipping
def _grads(seed: int, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(int(torch.randint(1, 40, (1,), generator=g)), generator=g) * 3).to(d) for d in dtypes]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
@pytest.mark.parametrize("foreach", [None, True, False])
def test_clipping_cut_into_shards_equals_clip_grad_norm(norm_type, foreach):
    dtypes = [torch.float32, torch.float16, torch.float32, torch.bfloat16] * 8 + [torch.float32] * 10
    for seed in range(3):
        grads = _grads(seed, dtypes)
        params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        want = torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type=norm_type, foreach=foreach)
        shards = [grads[i::3] for i in (2, 0, 1)]          # any partition; norms come back in parameter order
        norms = {id(g): n for s in shards for g, n in zip(s, shard_norms(s, norm_type, foreach))}
        total = total_norm([norms[id(g)] for g in grads], norm_type)
        assert total.dtype == want.dtype and torch.equal(total, want), seed
        coef = clip_coefficient(total, 0.5)
        for s in shards:
            clip_shard(s, coef, foreach)
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, params))


def test_a_nonfinite_total_raises_torchs_own_error_when_asked():
    grads = [torch.ones(3), torch.tensor([1.0, math.inf])]
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    with pytest.raises(RuntimeError) as want:
        torch.nn.utils.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError) as got:
        total_norm(shard_norms(grads), error_if_nonfinite=True)
    assert str(got.value) == str(want.value)
    assert torch.equal(total_norm([]), torch.tensor(0.0)) and shard_norms([]) == []


def test_the_inf_norm_through_the_pending_step_is_exact():
    scenario = Scenario("clip_inf", max_norm=0.05, norm_type=math.inf, exclude="b1.bias")
    for cfg in (OptCfg(optim.AdamW, dict(lr=0.01), "foreach"), OptCfg(optim.SGD, dict(lr=0.1, momentum=0.9), "fused")):
        plain = run(cfg, scenario)
        assert differences(plain, run(cfg, scenario, 4)) == [], cfg


def test_the_scenarios_really_clip_and_overflow():
    by_name = {s.name: s for s in SCENARIOS}
    cfg = OptCfg(optim.Adam, dict(lr=0.01))
    assert min(run(cfg, by_name["clip"])["norms"]) > 0.05
    # scale 1024, growth every 2 clean steps: one overflow at step 3 leaves 2048 after 6 steps (none: 8192)
    assert run(cfg, by_name["scaler"])["scaler"].get_scale() == 2048.0


def test_fp16_gradients_are_refused_as_the_scaler_refuses_them():
    p = nn.Parameter(torch.ones(2, dtype=torch.float16))
    opt = optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    p.grad = torch.ones(2, dtype=torch.float16)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        scaler.unscale_(opt)
    fresh = torch.amp.GradScaler("cpu")
    fresh.scale(torch.ones(()))
    pending = PendingStep(opt, [[p]], [p], scaler=fresh, max_norm=1.0)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        pending.begin()


# ------------------------------------------------------------------------------------------------ PendingStep
def test_the_pending_record_lifecycle():
    ps = _params(3)
    opt = optim.SGD(ps, lr=0.1)
    with pytest.raises(ValueError, match="the shards hold every parameter of the model and of the optimizer"):
        PendingStep(opt, [ps[:2]], ps)
    pending = PendingStep(opt, [ps[:1], ps[1:]], ps)
    assert pending.pending_shards() == [] and not pending.apply(0)
    for p in ps:
        p.grad = torch.ones(3)
    assert pending.begin() is None and pending.pending_shards() == [0, 1]
    with pytest.raises(RuntimeError, match="still has the previous step's update pending"):
        pending.prepare(1)
    with pytest.raises(RuntimeError, match="the previous step is still pending for shards"):
        pending.begin()
    assert pending.apply(1) and not pending.apply(1) and pending.pending_shards() == [0]
    assert ps[0].grad is not None and ps[1].grad is None and torch.equal(ps[0], torch.ones(3))
    assert torch.equal(ps[1], torch.full((3,), 0.9))
    pending.flush()
    assert pending.pending_shards() == [] and ps[0].grad is None and torch.equal(ps[0], torch.full((3,), 0.9))


def test_no_scheduler_warning_about_the_step_order():
    cfg, warmup = OptCfg(optim.AdamW, dict(lr=0.01)), Scenario("warmup", schedule="warmup")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the plain loop gives none: "Detected call of `lr_scheduler.step()` ..."
        run(cfg, warmup)
        run(cfg, warmup, 2)


def _late_param_run(impl: str, split: bool):
    """SGD with momentum where one parameter gets its first gradient at the second step."""
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
    opt = optim.SGD([a, b], lr=0.1, momentum=0.9, **({"fused": True} if impl == "fused" else {"foreach": True}))
    pending = PendingStep(opt, [[a], [b]], [a, b]) if split else None
    reasons = []
    for step in range(3):
        if pending is not None:
            pending.flush()
        (a * a).sum().backward()
        if step > 0:
            (b * b * a).sum().backward()
        if pending is None:
            opt.step()
            opt.zero_grad()
        else:
            reasons.append(pending.begin())
    if pending is not None:
        pending.flush()
    return a, b, opt, reasons


def test_a_step_that_cannot_be_split_is_applied_whole():
    a, b, opt, _ = _late_param_run("foreach", split=False)
    la, lb, lopt, reasons = _late_param_run("foreach", split=True)
    assert reasons[0] is None and "momentum buffers" in reasons[1] and reasons[2] is None
    assert torch.equal(a, la) and torch.equal(b, lb)
    assert all(torch.equal(opt.state[p]["momentum_buffer"], lopt.state[q]["momentum_buffer"])
               for p, q in ((a, la), (b, lb)))
    # fused SGD refuses such a group itself (a TypeError): the whole step raises it too, never a per-shard result
    with pytest.raises(TypeError) as plain:
        _late_param_run("fused", split=False)
    with pytest.raises(TypeError) as lazy:
        _late_param_run("fused", split=True)
    assert str(lazy.value) == str(plain.value)


def test_gpt2_with_tied_embeddings_in_two_shards_is_exact():
    from conftest import lm_batches, make_gpt2

    def train(split: bool):
        torch.manual_seed(0)
        model = make_gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        opt = optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=True)
        sched = optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=4, pct_start=0.5)
        params = list(model.parameters())
        shards = [params[i::4] for i in range(4)]
        shards[3].append(model.lm_head.weight)   # the tied embedding again: stepped once, by its first shard
        pending = PendingStep(opt, shards, params, max_norm=0.5) if split else None
        for batch in lm_batches(4, batch=2, seq=8):
            if pending is not None:
                for i in (3, 1, 2, 0):
                    pending.apply(i)
            model(**batch).loss.backward()
            if pending is None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
            else:
                assert pending.begin() is None
            sched.step()
            if pending is None:
                opt.zero_grad()
        if pending is not None:
            pending.flush()
        return model, opt

    (m1, o1), (m2, o2) = train(False), train(True)
    assert all(torch.equal(p, q) for p, q in zip(m1.state_dict().values(), m2.state_dict().values()))
    s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]  # keyed by parameter index
    assert list(s1) == list(s2) and len(s1) == len(list(m1.parameters()))
    assert all(torch.equal(s1[k][name], s2[k][name]) for k in s1 for name in ("step", "exp_avg", "exp_avg_sq"))


# ------------------------------------------------------------------------------------------------ CUDA
CUDA_CONFIGS = [OptCfg(optim.AdamW, dict(lr=0.01, weight_decay=0.1), impl) for impl in ("for", "foreach", "fused")] + [
    OptCfg(optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True), impl) for impl in ("foreach", "fused")] + [
    OptCfg(optim.NAdam, dict(lr=0.01), "foreach"), OptCfg(optim.RAdam, dict(lr=0.01, betas=(0.9, 0.9)), "foreach")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cfg", CUDA_CONFIGS, ids=str)
def test_on_cuda_the_lazy_step_is_bit_identical_too(cfg):
    for scenario in SCENARIOS:
        plain = run(cfg, scenario, device="cuda")
        for split in (2, 4):
            assert differences(plain, run(cfg, scenario, split, device="cuda")) == [], (scenario.name, split)


def test_a_shard_step_touches_only_its_parameters_and_leaves_no_trace_in_the_optimizer():
    ps, opt = _stepped_once(optim.AdamW)
    step_shard(opt, ps[2:], StepSnapshot.take(opt))
    saved = opt.state_dict()
    assert [len(g["params"]) for g in saved["param_groups"]] == [2, 1] and list(saved["state"]) == [2]
    assert torch.equal(ps[0], torch.ones(3)) and not torch.equal(ps[2], torch.ones(3))
