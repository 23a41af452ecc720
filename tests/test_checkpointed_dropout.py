"""A model that recomputes a block with dropout inside its own backward (``torch.utils.checkpoint``): the draws its
recompute makes happen while autograd runs, where the light router (dispatch.RandomRouter, a function mode) does
not reach; a measured unit that sees such a draw keeps its task on the full mode (``UnitMode``), so the recompute
redraws the forward's mask and the task ends bit-identical to the plain loop (CPU fp32: max abs difference 0.0), as
a ModelTask and in a prepared loop (whose backward segments are measured on their own)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from reference import max_param_diff, plain_train, sgd_loop

import hydra_tune as ht

X = torch.randn(48, 16, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 4, (48,), generator=torch.Generator().manual_seed(2))


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.block = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 32))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant))


def _task(reentrant: bool) -> ht.ModelTask:
    return ht.ModelTask(lambda: Checkpointed(reentrant), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        [(X[i:i + 8], Y[i:i + 8]) for i in range(0, 48, 8)], loss=lambda o, b: F.cross_entropy(o, b[1]),
                        epochs=2, seed=0, name=f"checkpointed-{reentrant}")


@pytest.mark.filterwarnings("ignore::UserWarning")   # torch: none of the inputs of a reentrant checkpoint need grad
@pytest.mark.parametrize("budget", ["64MiB", "20KiB"], ids=["resident", "tight-budget"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_block_with_dropout_trains_exactly(budget, reentrant):
    # before: non-reentrant, the recompute's dropout drew from torch's global generator, not the task's stream:
    # another mask in the backward (max abs difference 0.012)
    want, _ = plain_train(_task(reentrant))
    with ht.Runtime(devices=["cpu"], device_memory=budget) as rt:
        handle = rt.submit(_task(reentrant))
        handle.result()
        got = handle.model()
    assert max_param_diff(want, got) == 0.0


def test_a_checkpointed_block_with_dropout_in_a_prepared_loop_trains_exactly():
    # before: a prepared backward's segment shared its forward's key, so it was never measured on its own and its
    # recompute's draws were never seen: the light router ran it, another mask (max abs difference 0.067)
    def run(rt=None):
        model = sgd_loop(lambda: Checkpointed(False), X, Y, rt)
        return torch.cat([v.detach().flatten() for v in model.state_dict().values()])
    want = run()
    with ht.Runtime(devices=["cpu"], device_memory="64MiB") as rt:
        assert torch.equal(run(rt), want)
