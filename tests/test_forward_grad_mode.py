"""A training forward whose backward recomputes it runs with autograd, as the plain loop's forward does.

The CPU's LSTM (and, on CUDA, the choice among attention backends) computes otherwise without autograd: the F unit
of a recomputed shard used to run under ``torch.no_grad()``, so a 2-layer LSTM's output, the loss the user read and
the gradient the user's backward sent in were 3e-8 off the plain loop's, and the weights with them (the tests fail
before). A probe with two devices also saw the recompute's Python-state check refuse the model: the LSTM's weight
cache changed in the recompute and not in the F unit.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hydra_tune as ht
import hydra_tune.device.devices as devices_module

X = torch.randn(64, 12, 16, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 4, (64,), generator=torch.Generator().manual_seed(2))


class Sequence(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 16, batch_first=True, num_layers=2, dropout=0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0].mean(1)


def test_lstm_differs_with_and_without_autograd_here():
    """The premise: without it the tests below could not fail."""
    torch.manual_seed(0)
    lstm = nn.LSTM(16, 16, batch_first=True, num_layers=2)
    with torch.no_grad():
        inference = lstm(X)[0]
    assert not torch.equal(lstm(X)[0], inference)


def _loop(prepare=None) -> tuple[dict, list[float]]:
    torch.manual_seed(0)
    model = nn.Sequential(Sequence(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if prepare is not None:
        model, opt = prepare(model, opt)
    losses = []
    for _ in range(2):
        for i in range(0, 64, 16):
            loss = F.cross_entropy(model(X[i:i + 16]), Y[i:i + 16])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return {k: v.clone() for k, v in model.state_dict().items()}, losses


@pytest.mark.parametrize("devices", [1, 2])
def test_prepared_lstm_whose_backward_recomputes_is_bit_identical(devices, monkeypatch):
    plain, losses = _loop()
    # plans that keep no forward's graph (as HYDRA_TUNE_CUDA_RECOMPUTE=1 makes them on CUDA): the one shard's graph
    # would be kept within the peak its recomputing backward reserves (prepare/driver.py), and never recomputed
    monkeypatch.setattr(devices_module, "releases_graphs", lambda device_type: False)
    with ht.Runtime(devices=["cpu"] * devices, device_memory="600KiB") as rt:
        ours, losses2 = _loop(lambda m, o: ht.prepare(m, o, runtime=rt))
        stats = next(iter(rt.stats()["tasks"].values()))
    assert stats["light_units"] == 0 and stats["kept_backwards"] == 0   # every backward recomputed its forward
    assert losses2 == losses
    assert all(torch.equal(plain[k], ours[k]) for k in plain)


def test_prepared_lstm_whose_backward_runs_through_its_kept_graph_is_bit_identical():
    plain, losses = _loop()
    with ht.Runtime(devices=["cpu"], device_memory="600KiB") as rt:
        ours, losses2 = _loop(lambda m, o: ht.prepare(m, o, runtime=rt))
        stats = next(iter(rt.stats()["tasks"].values()))
    assert stats["light_units"] == 0 and stats["kept_backwards"] == 8  # every backward, through its forward's graph
    assert losses2 == losses
    assert all(torch.equal(plain[k], ours[k]) for k in plain)
