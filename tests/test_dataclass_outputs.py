"""Dataclasses holding tensors (a custom model output, a carry between declared stages): the cost profile
registers their types with torch's pytree (training/trees.py ``open_dataclasses``), so their tensors are moved,
detached and joined to the user's graph like a tuple's. A prepared model returning tensors inside another kind of
object is refused, naming it: the runtime cannot see them, so they would get no gradients."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, plain_train

import hydra_tune as ht
from hydra_tune.training import trees

X = torch.randn(48, 16, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 4, (48,), generator=torch.Generator().manual_seed(2))


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor
    note: str = "ok"


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> Output:
        h = self.body(x)
        return Output(self.head(h), h)


def _loop(rt=None):
    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if rt is not None:
        model, opt = ht.prepare(model, opt, runtime=rt)
    for i in range(0, 48, 8):
        out = model(X[i:i + 8])
        loss = F.cross_entropy(out.logits, Y[i:i + 8]) + 1e-3 * out.hidden.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert isinstance(out, Output) and out.note == "ok"
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("budget", ["64MiB", "12KiB"])
def test_a_prepared_model_returning_a_dataclass_trains_exactly(budget):
    # before: the dataclass was a leaf: nothing joined the user's graph, and the profile's loss summed nothing
    # ("the loss is a tensor must hold, ... type='int'", about a loss the user never gave)
    want = _loop()
    with ht.Runtime(devices=["cpu"], device_memory=budget) as rt:
        got = _loop(rt)
    assert all(torch.equal(want[k], got[k]) for k in want)


class Opaque:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class OpaqueOutput(Classifier):
    def forward(self, x: torch.Tensor) -> tuple:
        h = self.body(x)
        return Opaque(self.head(h)), h.mean()


def test_a_prepared_model_returning_tensors_inside_another_object_is_refused_naming_it():
    # before: the tuple's float tensor passed the first call; the object's logits stayed on the unit's graph, so
    # loss.backward() went into the unit's device copies and the parameters got no gradient from it
    model = OpaqueOutput()
    with ht.Runtime(devices=["cpu"]) as rt:
        model, _ = ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), runtime=rt)
        with pytest.raises(TypeError, match=r"dataclasses or transformers' ModelOutput.*tensors inside \['Opaque'\]"):
            model(X[:8])


@dataclasses.dataclass
class Hidden:
    h: torch.Tensor
    scale: float


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(16, 32), nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> Hidden:
        return Hidden(self.drop(torch.relu(self.lin(x))), 0.5)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 4)

    def forward(self, hidden: Hidden) -> torch.Tensor:
        return self.lin(hidden.h * hidden.scale)


class Staged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = Encoder(), Decoder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.enc(x))

    def hydra_stages(self) -> list[nn.Module]:
        return [self.enc, self.dec]


def _task() -> ht.ModelTask:
    return ht.ModelTask(Staged, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        [(X[i:i + 8], Y[i:i + 8]) for i in range(0, 48, 8)], loss=lambda o, b: F.cross_entropy(o, b[1]),
                        epochs=2, seed=0, name="staged")


def test_a_dataclass_carried_between_shards_trains_exactly_and_its_tensors_are_moved():
    want, _ = plain_train(_task())
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=10_200) as rt:
        handle = rt.submit(_task())
        handle.result()
        got = handle.model()
        assert rt.stats()["tasks"]["staged"]["shards"] == [["0:Encoder"], ["1:Decoder"]]
    assert max_param_diff(want, got) == 0.0
    # the carry's tensor is a leaf of torch's pytree now: moved and detached with the rest
    moved = trees.map_tensors(lambda t: t.detach().clone(), Hidden(torch.ones(2, requires_grad=True) * 2, 0.5))
    assert isinstance(moved, Hidden) and moved.h.grad_fn is None and moved.scale == 0.5
