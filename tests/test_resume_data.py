"""A resumed task's data continues as the uninterrupted one's and the plain loop's: samplers with ``set_epoch``
(DistributedSampler) get each epoch's number, as the plain loop's idiom does, after a resume too; the state of the
data outside the loader's generators (generators nested in samplers or held by the dataset, samplers' own Python
state, of the eval data's samplers too) repeats at the epoch's start, or the checkpoint is refused naming it."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from reference import max_param_diff, plain_train
from test_resume_exactness import _mlp, _mse, _plain_plateau, _plateau_task, _run, _same
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    Sampler,
    Subset,
    TensorDataset,
)

import hydra_tune as ht
from hydra_tune.training import checkpoint


# -- 4. samplers with set_epoch ---------------------------------------------------------------------------------
class _EpochBatches(BatchSampler):
    """A batch sampler whose order is a function of its epoch (as DistributedSampler's): ``set_epoch`` moves it."""

    def __init__(self, n: int, size: int, seed: int) -> None:
        self.n, self.size, self.seed, self.epoch = n, size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n // self.size

    def __iter__(self):
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        return iter([perm[i:i + self.size] for i in range(0, len(self) * self.size, self.size)])


def _points() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(24, 8, generator=g), torch.randn(24, 4, generator=g))


def _distributed() -> DataLoader:
    data = _points()
    return DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=5))


LOADERS = {
    "DistributedSampler": _distributed,
    "batch_sampler": lambda: DataLoader(_points(), batch_sampler=_EpochBatches(24, 4, seed=5)),
    "BatchSampler(DistributedSampler)": lambda: (lambda d: DataLoader(d, batch_sampler=BatchSampler(
        DistributedSampler(d, num_replicas=1, rank=0, seed=5), 4, drop_last=False)))(_points()),
    "factory": lambda: _distributed,
}


def _epoch_task(make: Any, **kw: Any) -> ht.ModelTask:
    return ht.ModelTask(_mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), make(), loss=_mse,
                        epochs=3, seed=2, name="set-epoch", **kw)


def _plain_set_epoch(task: ht.ModelTask) -> nn.Module:
    """The plain loop's idiom: ``sampler.set_epoch(epoch)`` at each epoch's start (0 for the first)."""
    torch.manual_seed(task.seed)
    model = task.model()
    opt = task.optimizer(model)
    for epoch in range(task.epochs):
        loader = task.train_data() if callable(task.train_data) else task.train_data
        for sampler in (loader.sampler, loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None)):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
        for batch in loader:
            task.loss(model(batch[0]), batch).backward()
            opt.step()
            opt.zero_grad()
    return model


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_set_epoch_each_epoch_as_the_plain_loop_after_a_resume_too(tmp_path, name):
    whole, metrics, requests = _run(_epoch_task(LOADERS[name]), ask_after=(9,), path=tmp_path)   # mid-epoch 2
    expected = _plain_set_epoch(_epoch_task(LOADERS[name]))
    assert max_param_diff(expected, whole.model) == 0.0   # before: every epoch in epoch 0's order
    path = requests[0].wait(0)
    assert checkpoint.load(path)["position"]["epoch"] == 2
    resumed, resumed_metrics, _ = _run(_epoch_task(LOADERS[name], resume_from=path))
    assert max_param_diff(whole.model, resumed.model) == 0.0 and _same(resumed_metrics, metrics[1:])


# -- the hunt: state of the data outside the generators a checkpoint held before -------------------------------
class _Nested(Sampler):
    """A sampler wrapping a RandomSampler with its own generator (two levels down from the loader)."""

    def __init__(self, n: int) -> None:
        self.inner = RandomSampler(range(n), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self):
        return iter(self.inner)


class _Counting(Sampler):
    """A sampler that counts its passes and orders each by the count (Python state its ``__iter__`` changes)."""

    def __init__(self, n: int) -> None:
        self.n, self.passes, self.history = n, 0, []

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        self.passes += 1
        self.history.append(self.passes)
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(sum(self.history))).tolist())


class _OwnGenerator(Dataset):
    """A dataset whose augmentation draws from a generator of its own (read in this process: num_workers=0)."""

    def __init__(self) -> None:
        self.points, self.g = _points(), torch.Generator().manual_seed(9)

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.points[i]
        return x + 0.1 * torch.rand(8, generator=self.g), y


DATA_STATE = {
    "nested sampler generator": lambda: DataLoader(_points(), batch_size=4, sampler=_Nested(24)),
    "sampler counting its passes": lambda: DataLoader(_points(), batch_size=4, sampler=_Counting(24)),
    "dataset's own generator": lambda: DataLoader(_OwnGenerator(), batch_size=4, shuffle=True),
    "Subset of it": lambda: DataLoader(Subset(_OwnGenerator(), list(range(20))), batch_size=4),
}


@pytest.mark.parametrize("name", sorted(DATA_STATE))
def test_data_state_at_the_epoch_start_repeats_on_resume(tmp_path, name):
    """Before, each resumed run diverged from the uninterrupted one (the dataset's generator also from the plain
    loop: the sample batch at submit drew from it)."""
    whole, metrics, requests = _run(_epoch_task(DATA_STATE[name]), ask_after=(9,), path=tmp_path)
    assert max_param_diff(plain_train(_epoch_task(DATA_STATE[name]))[0], whole.model) == 0.0
    resumed, resumed_metrics, _ = _run(_epoch_task(DATA_STATE[name], resume_from=requests[0].wait(0)))
    assert max_param_diff(whole.model, resumed.model) == 0.0 and _same(resumed_metrics, metrics[1:])


class _Remembering(Sampler):
    """Keeps the last order it made as a range object: state a checkpoint cannot store."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        self.last = range(self.n)
        return iter(self.last)


def test_sampler_state_a_checkpoint_cannot_store_refuses_it(tmp_path):
    """What a sampler held at the epoch's start is what a resume needs: a checkpoint in epoch 1 stores nothing of it
    (the resumed epoch's ``__iter__`` sets it again), one in epoch 2 is refused."""
    def task(**kw: Any) -> ht.ModelTask:
        return _epoch_task(lambda: DataLoader(_points(), batch_size=4, sampler=_Remembering(24)), **kw)

    whole, _, requests = _run(task(), ask_after=(2, 8), path=tmp_path)
    resumed, _, _ = _run(task(resume_from=requests[0].wait(0)))
    assert max_param_diff(whole.model, resumed.model) == 0.0
    with pytest.raises(TypeError, match=r"the Python state a sampler changes can be stored in a checkpoint .* but "
                                        r"got \(task='set-epoch', data='train_data', sampler='sampler', "
                                        r"attribute='last', type='range'\)\. Fix: keep a sampler's state as"):
        requests[1].wait(0)


def test_an_eval_samplers_state_survives_a_checkpoint(tmp_path):
    def held_out() -> DataLoader:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(10, 8, generator=g), torch.randn(10, 4, generator=g))
        return DataLoader(data, batch_size=4, sampler=_Counting(10), drop_last=True)   # order by its passes

    whole, metrics, requests = _run(_plateau_task(eval_data=held_out()), ask_after=(12,), path=tmp_path)
    _, _, evals = _plain_plateau(_plateau_task(eval_data=held_out()))
    assert [m["eval_loss"] for m in metrics] == evals
    resumed, resumed_metrics, _ = _run(_plateau_task(eval_data=held_out(), resume_from=requests[0].wait(0)))
    assert [m["eval_loss"] for m in resumed_metrics] == evals[2:]   # before: its passes counted from 0
    assert max_param_diff(whole.model, resumed.model) == 0.0
