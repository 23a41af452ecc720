"""Sparse tensors: sparse inputs (a graph's adjacency) train exactly, their bytes counted on the CPU stand-ins by
their indices and values; sparse gradients (sparse embeddings) are refused, at submit where a module says so and
when a unit makes one anyway."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, plain_train

import hydra_tune as ht

G = torch.Generator().manual_seed(0)
ADJ = (torch.rand(20, 20, generator=G) < 0.2).float().to_sparse()
H = torch.randn(20, 8, generator=G)
LABELS = torch.randint(0, 3, (20,), generator=G)
IDS = torch.randint(0, 50, (48, 6), generator=G)
Y = torch.randint(0, 4, (48,), generator=G)


class GCN(nn.Module):
    """Two graph convolutions over a sparse adjacency that comes with the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, batch: tuple) -> torch.Tensor:
        adj, h = batch
        return self.l2(torch.sparse.mm(adj, torch.relu(torch.sparse.mm(adj, self.l1(h)))))


def _gcn_task() -> ht.ModelTask:
    return ht.ModelTask(GCN, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), [((ADJ, H), LABELS)] * 4,
                        loss=lambda o, b: F.cross_entropy(o, b[1]), epochs=2, seed=0, name="gcn")


@pytest.mark.parametrize("budget", ["64MiB", None])
def test_a_sparse_input_trains_exactly(budget):
    # before: the CPU stand-in's memory count read the sparse tensor's storage (NotImplementedError) at submit
    want, _ = plain_train(_gcn_task())
    with ht.Runtime(devices=["cpu"], device_memory=budget) as rt:
        handle = rt.submit(_gcn_task())
        handle.result()
        got = handle.model()
    assert max_param_diff(want, got) == 0.0


class FunctionalSparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(50, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(F.embedding(ids, self.w, sparse=True).mean(1))


def _embedding_task(make) -> ht.ModelTask:
    return ht.ModelTask(make, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        [(IDS[i:i + 8], Y[i:i + 8]) for i in range(0, 48, 8)],
                        loss=lambda o, b: F.cross_entropy(o, b[1]), epochs=1, name="sparse")


def test_a_sparse_embedding_is_refused_at_submit_and_at_prepare():
    # before: its first backward failed reading the gradient's storage, and the task's end then failed writing
    # the state back: its handle never ended (result() waited forever)
    def make():
        return nn.Sequential(nn.Embedding(50, 16, sparse=True), nn.Flatten(), nn.Linear(96, 4))

    with ht.Runtime(devices=["cpu"]) as rt, pytest.raises(TypeError, match=r"gradients are dense.*sparse=\['0'\]"):
        rt.submit(_embedding_task(make))
    model = make()
    with pytest.raises(TypeError, match=r"gradients are dense.*sparse=\['0'\]"):
        ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("budget", ["64MiB", "15KiB"])
def test_a_sparse_gradient_made_by_a_functional_embedding_fails_the_task_naming_it(budget):
    with ht.Runtime(devices=["cpu"], device_memory=budget) as rt:
        handle = rt.submit(_embedding_task(FunctionalSparse))
        with pytest.raises(TypeError, match=r"gradients are dense.*shape=\(50, 16\), layout='torch.sparse_coo'"):
            handle.result(timeout=60)
