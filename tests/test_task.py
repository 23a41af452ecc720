"""ModelTask and Runtime arguments: bad input fails at construction with the rule, the values and the fix."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hydra_tune as ht
from hydra_tune.config import parse_bytes

DATA = [(torch.randn(2, 4), torch.randn(2, 4))]


def _task(**kw):
    args = dict(model=lambda: nn.Linear(4, 4), optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                train_data=DATA)
    args.update(kw)
    return ht.ModelTask(args.pop("model"), args.pop("optimizer"), args.pop("train_data"), **args)


@pytest.mark.parametrize("kw, exc, text", [
    (dict(epochs=0), ValueError, "`epochs >= 1` (an int) must hold, but got (epochs=0)"),
    (dict(epochs=-2), ValueError, "but got (epochs=-2). Fix: train for at least one epoch"),
    (dict(grad_accumulation=0), ValueError, "`grad_accumulation >= 1` (an int) must hold, but got (grad_accumulation=0)"),
    (dict(max_steps=0), ValueError, "`max_steps >= 1` (an int) must hold, but got (max_steps=0)"),
    (dict(grad_clip_norm=-1.0), ValueError, "`grad_clip_norm > 0` (or None) must hold, but got (grad_clip_norm=-1.0)"),
    (dict(model=42), TypeError, "`model` is an nn.Module or a zero-argument callable returning one must hold, "
                                "but got (model='int')"),
    (dict(optimizer="adam"), TypeError, "`optimizer` is callable(model) -> torch.optim.Optimizer must hold"),
    (dict(train_data=(b for b in DATA)), TypeError, "`train_data` can be iterated once per epoch (not a one-shot "
                                                    "iterator or generator) must hold, but got (train_data='generator')"),
    (dict(train_data=None), TypeError, "`train_data is not None` must hold"),
    (dict(loss="mse"), TypeError, "`loss` is None or callable must hold, but got (loss='str')"),
    (dict(seed=1.5), TypeError, "`seed` is an int must hold, but got (seed=1.5)"),
])
def test_bad_task_arguments_raise_clear_errors(kw, exc, text):
    with pytest.raises(exc) as err:
        _task(**kw)
    assert text in str(err.value)
    assert "Fix: " in str(err.value)


def test_optimizer_instance_instead_of_factory_is_explained():
    model = nn.Linear(4, 4)
    with pytest.raises(TypeError, match=r"`optimizer` is a factory .* but got \(optimizer='SGD'\)"):
        ht.ModelTask(model, torch.optim.SGD(model.parameters(), lr=0.1), DATA)


@pytest.mark.parametrize("text, n", [("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("4096", 4096),
                                     (1024, 1024), ("64 KiB", 65536)])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("bad", ["lots", "-3MiB", 0, "12 parsecs"])
def test_bad_budget_is_rejected(bad):
    with pytest.raises(ValueError, match="device_memory"):
        parse_bytes(bad)


@pytest.mark.parametrize("devices, text", [
    (["tpu:0"], "each device name is 'cpu' or 'cuda:<index>' must hold, but got (device='tpu:0')"),
    (["cuda:0"], "a CUDA device is available (torch.cuda.device_count() > 0) must hold, but got (device='cuda:0', "
                 "device_count=0"),
    (["cpu", "cuda:0"], "all `devices` are of one kind must hold"),
    (0, "`devices >= 1` must hold, but got (devices=0)"),
    ("gpu", "`devices` is 'auto', a positive int, or a non-empty list"),
])
def test_bad_devices_are_rejected(devices, text):
    if torch.cuda.is_available():
        pytest.skip("expectations are written for a machine without CUDA")
    with pytest.raises(ValueError) as err:
        ht.Runtime(devices=devices)
    assert text in str(err.value)


def test_auto_devices_without_gpu_is_one_unlimited_cpu_device():
    if torch.cuda.is_available():
        pytest.skip("CPU-only expectation")
    with ht.Runtime() as rt:
        devs = rt.stats()["devices"]
    assert [(d["name"], d["budget"]) for d in devs] == [("cpu:0", None)]
    with ht.Runtime(devices=3, device_memory="1MiB") as rt:
        assert [d["budget"] for d in rt.stats()["devices"]] == [2**20] * 3
