"""The plain whole-step loop and the lazy per-shard loop over the same small two-branch model, for
tests/test_lazy_step*.py: ``run(cfg, scenario, split=None)`` trains one and returns what must match bit for bit."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from hydra_tune.training.step import PendingStep

STEPS = 6  # RAdam's rectified branch starts at step 6 with betas=(0.9, 0.9)


class TwoBranch(nn.Module):
    """Two independent branches whose parameters interleave in ``parameters()`` order (a0, b0, a1, b1): the lazy
    loop backpropagates branch A (its shards already hold step t+1's gradients) before branch B's shards are
    stepped, and the shards are applied in an order unlike parameter order."""

    def __init__(self) -> None:
        super().__init__()
        self.a0, self.b0 = nn.Linear(6, 8), nn.Linear(6, 8)
        self.a1, self.b1 = nn.Linear(8, 3), nn.Linear(8, 3)

    def branch(self, name: str, x: torch.Tensor, before: Callable[[nn.Module], None]) -> torch.Tensor:
        first, second = (self.a0, self.a1) if name == "a" else (self.b0, self.b1)
        before(first)
        h = torch.tanh(first(x))
        before(second)
        return second(h)


def _names(m: TwoBranch, names: list[str]) -> list[torch.Tensor]:
    params = dict(m.named_parameters())
    return [params[n] for n in names]


# shard splits: lists of parameter names; index order is the shards' order, unlike the order they are used in
SPLITS = {
    2: [["b0.weight", "b0.bias", "b1.weight", "b1.bias"], ["a0.weight", "a0.bias", "a1.weight", "a1.bias"]],
    4: [["a0.weight", "a0.bias"], ["b0.weight", "b0.bias", "b1.weight"], ["a1.weight", "a1.bias"], ["b1.bias"]],
}


@dataclass(frozen=True)
class Scenario:
    name: str
    k: int = 1                      # grad_accumulation
    max_norm: float | None = None   # global clipping
    exclude: str | None = None      # a parameter left out of the optimizer (clipped, never unscaled nor zeroed)
    schedule: str | None = None     # "warmup" (LambdaLR) or "onecycle" (OneCycleLR, cycled momentum/betas)
    scaler: bool = False            # fp16 GradScaler, with an inf gradient in branch B at step 3
    norm_type: float = 2.0


# "clip" leaves b1.bias out of the optimizer: the 4-shard split's last shard then has no optimizer parameter.
# "scaler" leaves a1.bias out: its gradient stays scaled (only the optimizer's are unscaled) and accumulates. Not
# with scaler_clip: the overflow step's NaN norm would make it NaN for good, as in the plain loop.
SCENARIOS = [Scenario("plain"), Scenario("clip", max_norm=0.05, exclude="b1.bias"), Scenario("accum2", k=2),
             Scenario("warmup", schedule="warmup"), Scenario("onecycle", schedule="onecycle"),
             Scenario("scaler", scaler=True, exclude="a1.bias"),
             Scenario("scaler_clip", scaler=True, max_norm=0.05, k=2)]


@dataclass(frozen=True)
class OptCfg:
    """One optimizer configuration: class, keyword arguments, implementation ("for", "foreach", "fused",
    "default")."""

    cls: type
    kwargs: dict[str, Any] = field(default_factory=dict)
    impl: str = "for"

    def build(self, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        kw = dict(self.kwargs)
        if self.impl == "fused":
            kw["fused"] = True
        elif self.impl != "default":
            kw["foreach"] = self.impl == "foreach"
        return self.cls(groups, **kw)

    @property
    def cycles_momentum(self) -> bool:
        defaults = self.cls([nn.Parameter(torch.ones(1))], **self.kwargs).defaults
        return "momentum" in defaults or "betas" in defaults

    def __str__(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in self.kwargs.items() if k != "lr")
        return f"{self.cls.__name__}[{extra}]-{self.impl}"


def _batches(step: int, micro: int, scenario: Scenario,
             device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
    xb = x.clone()
    if scenario.scaler and step == 2 and micro == 0:
        xb[0, 0] = math.inf  # only branch B overflows: the global found-inf must skip branch A's shards too
    return x.to(device), y.to(device), xb.to(device)


def _build(cfg: OptCfg, scenario: Scenario, device: str) -> tuple[TwoBranch, Any, Any, Any]:
    torch.manual_seed(0)
    model = TwoBranch().to(device)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias") and n != scenario.exclude]
    lr = cfg.kwargs.get("lr", 0.01)
    opt = cfg.build([{"params": weights}, {"params": biases, "lr": lr * 0.5}])
    sched = None
    if scenario.schedule == "warmup":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    elif scenario.schedule == "onecycle":
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[lr, lr * 0.5], total_steps=STEPS, pct_start=0.4,
                                                    cycle_momentum=cfg.cycles_momentum)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=2) if scenario.scaler else None
    return model, opt, sched, scaler


def _backward(loss: torch.Tensor, k: int, scaler: Any) -> None:
    scaled = loss / k if k != 1 else loss
    (scaler.scale(scaled) if scaler is not None else scaled).backward()


def _nothing(module: nn.Module) -> None:
    return None


def run(cfg: OptCfg, scenario: Scenario, split: int | None = None, device: str = "cpu") -> dict[str, Any]:
    """Train STEPS steps: the plain loop (``split`` None) or the lazy per-shard loop over ``SPLITS[split]``."""
    model, opt, sched, scaler = _build(cfg, scenario, device)
    losses: list[tuple[float, float]] = []
    norms: list[float] = []  # the plain loop's total gradient norms (the scenario really clips)
    pending, before = None, _nothing
    if split is not None:
        shards = [_names(model, names) for names in SPLITS[split]]
        owner = {id(p): i for i, shard in enumerate(shards) for p in shard}
        pending = PendingStep(opt, shards, list(model.parameters()), scaler=scaler, max_norm=scenario.max_norm,
                              norm_type=scenario.norm_type)

        def before(module: nn.Module) -> None:  # just before a layer's first use: its shard's pending update
            for p in module.parameters():
                pending.apply(owner[id(p)])

    for step in range(STEPS):
        for micro in range(scenario.k):
            x, y, xb = _batches(step, micro, scenario, device)
            if pending is None:
                la = F.mse_loss(model.branch("a", x, before), y)
                lb = F.mse_loss(model.branch("b", xb, before), y)
                _backward(la + lb, scenario.k, scaler)
            else:  # branch A's forward and backward first: B's shards still hold step t's gradients meanwhile
                la = F.mse_loss(model.branch("a", x, before), y)
                _backward(la, scenario.k, scaler)
                lb = F.mse_loss(model.branch("b", xb, before), y)
                _backward(lb, scenario.k, scaler)
            losses.append((la.item(), lb.item()))
        if pending is None:
            norms.append(_plain_step(model, opt, scaler, scenario))
        else:
            reason = pending.begin()
            assert reason is None, reason
        if sched is not None:
            sched.step()
        if pending is None:
            opt.zero_grad()
    if pending is not None:
        pending.flush()
        assert pending.pending_shards() == []
    return {"model": model, "opt": opt, "scaler": scaler, "sched": sched, "losses": losses, "norms": norms}


def _plain_step(model: nn.Module, opt: Any, scaler: Any, scenario: Scenario) -> float:
    """hydra_tune's TrainingLoop._step / tests.reference.plain_train's step; returns the clipped total norm."""
    total = math.nan
    if scenario.max_norm is not None:
        if scaler is not None:
            scaler.unscale_(opt)
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), scenario.max_norm,
                                               norm_type=scenario.norm_type).item()
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    return total


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
            torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):  # in the same order too (state_dict() lists optimizer state as it was made)
        return list(a.keys()) == list(b.keys()) and all(_same(a[k], b[k]) for k in a)
    return a == b


def differences(plain: dict[str, Any], lazy: dict[str, Any]) -> list[str]:
    """What differs between two runs' outcomes (empty when bit-identical): losses, parameters, gradients,
    optimizer state and param groups, scaler and scheduler state."""
    out = []
    if plain["losses"] != lazy["losses"]:
        first = next(i for i, (x, y) in enumerate(zip(plain["losses"], lazy["losses"])) if x != y)
        out.append(f"losses differ from minibatch {first}")
    for (name, p), q in zip(plain["model"].named_parameters(), lazy["model"].parameters()):
        if not torch.equal(p, q):
            out.append(f"{name}: max abs diff {(p - q).abs().max().item()}")
        if not _same(p.grad, q.grad):
            out.append(f"{name}.grad differs")
    sa, sb = plain["opt"].state_dict(), lazy["opt"].state_dict()
    if not _same(sa["state"], sb["state"]):
        out.append("optimizer state differs")
    if not _same(sa["param_groups"], sb["param_groups"]):
        out.append("optimizer param_groups differ")
    if plain["scaler"] is not None and plain["scaler"].state_dict() != lazy["scaler"].state_dict():
        out.append(f"scaler {plain['scaler'].state_dict()} != {lazy['scaler'].state_dict()}")
    if plain["sched"] is not None and not _same(plain["sched"].state_dict(), lazy["sched"].state_dict()):
        out.append("scheduler state differs")
    return out
