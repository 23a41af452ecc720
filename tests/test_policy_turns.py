"""A task the LRTF policy picked keeps its device for a short turn (runtime/picker.py ``TURN``) before the policy
is asked again, so small models' segments do not each pay a pick over every ready task; FIFO and round-robin are
asked at every segment; every task still trains the weights of the plain loop."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, plain_train, trained

import hydra_tune as ht
from hydra_tune.runtime import picker


def _task(i: int) -> ht.ModelTask:
    g = torch.Generator().manual_seed(i)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(6)]
    return ht.ModelTask(lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 2)),
                        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), data,
                        loss=lambda out, b: F.mse_loss(out, b[1]), epochs=2, seed=i, name=f"t{i}")


def _picks(monkeypatch: pytest.MonkeyPatch, turn: float, policy: str = "lrtf") -> tuple[int, int, float]:
    """(policy picks, segments, max abs weight difference from the plain loop) of 4 tasks on one device."""
    monkeypatch.setattr(picker, "TURN", turn)
    calls = [0]  # (the policy is an attribute each Picker sets: wrapped there)
    real_init = picker.Picker.__init__

    def counting_init(self, name: str) -> None:
        real_init(self, name)
        pick = self.pick

        def counted(*args):
            calls[0] += 1
            return pick(*args)
        self.pick = counted

    monkeypatch.setattr(picker.Picker, "__init__", counting_init)
    tasks = [_task(i) for i in range(4)]
    with ht.Runtime(devices=["cpu"], policy=policy) as rt:
        handles = [rt.submit(t) for t in tasks]
        for h in handles:
            h.result()
        segments = sum(rt.stats()["tasks"][t.name]["units"] for t in tasks)
        diff = max(max_param_diff(trained(h), plain_train(t)[0]) for h, t in zip(handles, tasks))
    return calls[0], segments, diff


def test_a_picked_task_keeps_its_device_for_its_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    asked, segments, diff = _picks(monkeypatch, turn=60.0)
    assert diff == 0.0
    # each task picked about once (the turn lasts until it ends), a few more as tasks become ready or end
    assert asked <= 12 < segments == 4 * 2 * 6, (asked, segments)


def test_without_a_turn_every_segment_asks_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    asked, segments, diff = _picks(monkeypatch, turn=0.0)
    assert diff == 0.0
    assert asked >= segments - 4, (asked, segments)


def test_fifo_asks_at_every_segment_whatever_the_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    asked, segments, diff = _picks(monkeypatch, turn=60.0, policy="fifo")
    assert diff == 0.0
    assert asked >= segments - 4, (asked, segments)
