"""How tasks, models and Tune trainables travel to another process (hydra_tune/shipping.py): each storage once,
shared storages shared on the other side, factories by value. The node server's round trip is in test_node.py, a
Tune trainable's in test_ray_tune.py."""
from __future__ import annotations

import cloudpickle
import torch
import torch.nn as nn
import torch.nn.functional as F

import hydra_tune as ht
from hydra_tune import shipping


def _sliced(n: int = 32, batch: int = 8) -> tuple[torch.Tensor, list]:
    """Minibatches sliced from one dataset tensor, the usual way to batch an in-memory set."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n * batch, 16, generator=g), torch.randn(n * batch, 4, generator=g)
    return x, [(x[i:i + batch], y[i:i + batch]) for i in range(0, n * batch, batch)]


def _task(data: list, lr: float = 0.05) -> ht.ModelTask:
    return ht.ModelTask(lambda: nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)),
                        lambda m: torch.optim.SGD(m.parameters(), lr=lr), data,
                        loss=lambda out, b: F.mse_loss(out, b[1]), epochs=1, seed=3, name="sliced")


def test_a_dataset_sliced_into_minibatches_travels_once_not_once_per_minibatch():
    x, data = _sliced()
    dataset_bytes = 2 * x.numel() * x.element_size()  # x and y
    blob = shipping.dump(_task(data))
    # before: pickle wrote each slice's whole storage, 32 minibatches x the dataset (cloudpickle's own reading)
    assert len(cloudpickle.dumps(_task(data))) > 16 * dataset_bytes
    assert len(blob) < dataset_bytes + 64 * 1024


def test_slices_of_one_tensor_still_share_it_after_loading():
    _, data = _sliced()
    got = shipping.load(shipping.dump(_task(data))).train_data
    assert len({b[0].untyped_storage().data_ptr() for b in got}) == 1  # one storage, as in the sender
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, data))
    x = torch.arange(12.0)
    first, second = shipping.load(shipping.dump([x[0:8], x[4:12]]))  # overlapping views: a write shows through
    first[5] = -1.0
    assert second[1].item() == -1.0


def test_factories_and_lambdas_travel_by_value_and_build_the_same_model():
    _, data = _sliced(4)
    task = shipping.load(shipping.dump(_task(data, lr=0.125)))
    torch.manual_seed(0)
    mine = _task(data).model()
    torch.manual_seed(0)
    theirs = task.model()
    assert all(torch.equal(a, b) for a, b in zip(mine.state_dict().values(), theirs.state_dict().values()))
    assert task.optimizer(theirs).param_groups[0]["lr"] == 0.125
    out = theirs(data[0][0])
    assert task.loss(out, data[0]).item() == F.mse_loss(out, data[0][1]).item()


def test_a_model_with_tied_weights_comes_back_tied():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = shipping.load(shipping.dump(nn.Sequential(emb, head)))
    assert model[0].weight is model[1].weight
    assert torch.equal(model[0].weight, emb.weight)


def test_a_plain_cloudpickle_blob_still_loads():
    _, data = _sliced(2)
    task = shipping.load(cloudpickle.dumps(_task(data)))
    assert task.name == "sliced" and torch.equal(task.train_data[1][0], data[1][0])


def test_a_tune_trainable_over_a_sliced_dataset_carries_it_once(monkeypatch):
    from hydra_tune.integrations import _tune_proxy, ray_tune

    seen: dict[str, bytes] = {}
    monkeypatch.setattr(_tune_proxy, "make_proxy", lambda fn_bytes, *args, **kw: seen.setdefault("fn", fn_bytes))
    x, data = _sliced()

    def train_fn(config):
        return sum(float(b[0].sum()) for b in data)
    ray_tune.HydraExecutor().wrap(train_fn)  # what each trial's runtime actor loads (its Tune run: test_ray_tune.py)
    assert len(seen["fn"]) < 2 * x.numel() * x.element_size() + 64 * 1024
    assert shipping.load(seen["fn"])({}) == train_fn({})
