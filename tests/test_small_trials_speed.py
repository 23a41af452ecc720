"""Small and short trials (issue 15): the fast paths keep every result exact.

Each test compares with the plain PyTorch loop (tests/reference.py): max abs parameter difference 0.0 on CPU fp32.
"""
from __future__ import annotations

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
