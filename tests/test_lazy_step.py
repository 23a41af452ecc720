"""The lazy per-shard optimizer step (hydra_tune/training/step) against the plain whole-step loop, bit for bit:
every allowlisted optimizer and implementation x {plain, global clipping, grad accumulation 2, a warmup schedule,
OneCycleLR with cycled momentum/betas, an fp16 GradScaler with an overflow step (with and without clipping)} x
{2, 4 shards}, the shards applied lazily (just before their next use, out of parameter order, while other shards
already hold the next step's gradients). Parameters, gradients, optimizer state and param groups, the scaler's and
the scheduler's state and every minibatch's loss must be equal (torch.equal, max abs diff 0.0)."""
from __future__ import annotations

import pytest
import torch
from lazy_harness import SCENARIOS, OptCfg, differences, run

optim = torch.optim
_BASE = [
    OptCfg(optim.SGD, dict(lr=0.1)),
    OptCfg(optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    OptCfg(optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1, maximize=True)),
    OptCfg(optim.Adam, dict(lr=0.01, weight_decay=0.01)),
    OptCfg(optim.Adam, dict(lr=0.01, amsgrad=True, maximize=True)),
    OptCfg(optim.AdamW, dict(lr=0.01, weight_decay=0.1, amsgrad=True)),
    OptCfg(optim.Adagrad, dict(lr=0.1, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1)),
    OptCfg(optim.RMSprop, dict(lr=0.01)),
    OptCfg(optim.RMSprop, dict(lr=0.01, centered=True, momentum=0.9, weight_decay=0.01)),
    OptCfg(optim.Adamax, dict(lr=0.01, weight_decay=0.01)),
    OptCfg(optim.NAdam, dict(lr=0.01)),
    OptCfg(optim.NAdam, dict(lr=0.01, weight_decay=0.01, decoupled_weight_decay=True)),
    OptCfg(optim.RAdam, dict(lr=0.01, betas=(0.9, 0.9), weight_decay=0.01, decoupled_weight_decay=True)),
    OptCfg(optim.Rprop, dict(lr=0.01, etas=(0.4, 1.3), step_sizes=(1e-5, 1.0), maximize=True)),
    OptCfg(optim.ASGD, dict(lr=0.01, lambd=1e-3, alpha=0.75, t0=2.0, weight_decay=0.01)),
    OptCfg(optim.Adadelta, dict(lr=1.0, rho=0.8, weight_decay=0.01)),
]
_FUSED = (optim.SGD, optim.Adam, optim.AdamW, optim.Adagrad)  # the torch optimizers with a fused CPU kernel
CONFIGS = ([OptCfg(c.cls, c.kwargs, impl) for c in _BASE for impl in ("for", "foreach")]
           + [OptCfg(c.cls, c.kwargs, "fused") for c in _BASE if c.cls in _FUSED]
           + [OptCfg(optim.AdamW, dict(lr=0.01), "default"), OptCfg(optim.SGD, dict(lr=0.1, momentum=0.9), "default")])


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_lazy_per_shard_step_is_bit_identical_to_the_whole_step(cfg, scenario):
    plain = run(cfg, scenario)
    for split in (2, 4):
        lazy = run(cfg, scenario, split)
        assert differences(plain, lazy) == [], f"{split} shards"


def test_the_matrix_covers_every_allowlisted_optimizer_and_implementation():
    from hydra_tune.training.step import ALLOWED

    assert {c.cls for c in CONFIGS} == set(ALLOWED)
    assert {(c.cls, c.impl) for c in CONFIGS} >= {(c, i) for c in ALLOWED for i in ("for", "foreach")}
    assert {c.cls for c in CONFIGS if c.impl == "fused"} == set(_FUSED)
