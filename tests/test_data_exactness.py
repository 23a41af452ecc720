"""Data loading is the plain loop's: DataLoader workers, loaders with their own generator, samplers, random
augmentation and collate functions; the sample batch at submit touches none of the user's data (CPU fp32: max abs
parameter difference 0.0). Data factories: test_data_factories.py; resumed data order: test_data_resume.py."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, plain_train, trained
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

import hydra_tune as ht
from hydra_tune.training.data import NO_BATCH, sample_batch

N = 24


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))


def _mse(out: torch.Tensor, batch: tuple) -> torch.Tensor:
    return F.mse_loss(out, batch[1])


class _Points(Dataset):
    """N fixed points; ``aug`` picks the random augmentation __getitem__ draws: "torch", "random" (Python's
    module), "numpy" or None."""

    def __init__(self, aug: str | None = "torch") -> None:
        g = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(N, 8, generator=g), torch.randn(N, 2, generator=g)
        self.aug = aug

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i]
        if self.aug == "torch":
            x = x + 0.1 * torch.rand(8)
        elif self.aug == "random":
            x = x * (1.0 + random.random())
        elif self.aug == "numpy":
            x = x + torch.from_numpy(np.random.rand(8).astype("float32"))
        return x, self.y[i]


def _task(data, epochs: int = 2, **kw) -> ht.ModelTask:
    return ht.ModelTask(_mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), data, loss=_mse, epochs=epochs,
                        seed=3, **kw)


def _hydra(task: ht.ModelTask) -> nn.Module:
    with ht.Runtime(devices=["cpu"], device_memory="64MiB") as rt:
        return trained(rt.submit(task))


def _diff(make_task) -> float:
    """Max parameter difference between the plain loop and hydra_tune, each on a task made fresh."""
    plain, _ = plain_train(make_task())
    return max_param_diff(plain, _hydra(make_task()))


def _plain_with_eval(task: ht.ModelTask) -> nn.Module:
    """The plain loop with an evaluation after every epoch; a data factory is called at each pass."""
    def each(data):
        return data() if callable(data) and not hasattr(data, "__iter__") else data

    torch.manual_seed(task.seed)
    model = task.model()
    opt = task.optimizer(model)
    for _ in range(task.epochs):
        for batch in each(task.train_data):
            task.loss(model(batch[0]), batch).backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            for batch in each(task.eval_data):
                task.loss(model(batch[0]), batch)
        model.train()
    return model


@pytest.fixture(autouse=True)
def _persistent_workers_end_with_their_test(monkeypatch):
    """Every DataLoader iterator with persistent workers made during a test is shut down when the test ends.

    Why: a task's loader clone ends in a reference cycle, so its iterator is freed by the garbage collector, in
    whichever later test it happens to run: the collector first runs the index queues' finalizers (their feeder
    threads stop), then the iterator's ``__del__`` asks its workers to exit through those queues, which no longer
    deliver, and PyTorch kills each worker after a 5 s join timeout (10-15 s lost per test). Shut down here, while
    the queues work, the workers exit at once. The training under test is over by then: nothing it checks changes.
    """
    from torch.utils.data import dataloader

    made = []
    init = dataloader._MultiProcessingDataLoaderIter.__init__

    def recording(self, loader):
        init(self, loader)
        if self._persistent_workers:
            made.append(self)

    monkeypatch.setattr(dataloader._MultiProcessingDataLoaderIter, "__init__", recording)
    yield
    for it in made:
        it._shutdown_workers()


# -- DataLoader workers (case 1) ------------------------------------------------------------------------------
@pytest.mark.parametrize("persistent", [False, True])
def test_worker_augmentation_matches_plain(persistent):
    """Workers forked while the task's data loads leave its RNG routing: each draws its own augmentation from
    base_seed + worker_id, base_seed from the task's stream (the plain loop's global generator)."""
    diff = _diff(lambda: _task(DataLoader(_Points(), batch_size=4, shuffle=True, num_workers=2,
                                          persistent_workers=persistent)))
    assert diff == 0.0


def _seed_numpy_from_torch(worker_id: int) -> None:  # the documented recipe, with a torch draw of the worker's own
    np.random.seed((torch.initial_seed() + int(torch.randint(0, 1000, ()))) % 2**32)


@pytest.mark.parametrize("aug", ["random", "numpy"])
def test_python_and_numpy_random_in_workers_match_plain(aug):
    """PyTorch seeds `random` and numpy in every worker from the base seed; a worker_init_fn runs as in torch."""
    diff = _diff(lambda: _task(DataLoader(_Points(aug), batch_size=4, shuffle=True, num_workers=2,
                                          worker_init_fn=_seed_numpy_from_torch)))
    assert diff == 0.0


def test_a_process_forked_inside_the_task_routing_leaves_it():
    """A child forked inside UnitMode/RandomRouter (a worker) draws from its own global generator, as PyTorch
    seeds it; other modes stay."""
    import os

    from torch.overrides import TorchFunctionMode

    from hydra_tune.device.dispatch import RandomRouter, UnitMode

    class Other(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    read, write = os.pipe()
    with Other(), RandomRouter(torch.Generator().manual_seed(0)), UnitMode(torch.Generator().manual_seed(0)):
        pid = os.fork()
        if pid == 0:  # the child: report its modes and a draw after seeding the global generator
            try:
                torch.manual_seed(11)
                modes = [type(torch._C._get_function_stack_at(i)).__name__
                         for i in range(torch._C._len_torch_function_stack())]
                os.write(write, f"{modes}|{torch._C._len_torch_dispatch_stack()}|{torch.rand(()).item()!r}".encode())
            finally:
                os._exit(0)
    os.waitpid(pid, 0)
    os.close(write)
    with os.fdopen(read) as f:
        got = f.read()
    torch.manual_seed(11)
    assert got == f"['Other']|0|{torch.rand(()).item()!r}"


# -- the sample batch touches nothing (case 2) ----------------------------------------------------------------
def test_loader_with_its_own_generator_matches_plain():
    diff = _diff(lambda: _task(DataLoader(_Points(), batch_size=4, shuffle=True,
                                          generator=torch.Generator().manual_seed(0))))
    assert diff == 0.0


class _CountingSampler(Sampler):
    """A sampler with state: every pass over it is a new permutation (its own epoch counter)."""

    def __init__(self, n: int) -> None:
        self.n, self.passes = n, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        self.passes += 1
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.passes)).tolist())


class _Counting(_Points):
    """A dataset whose __getitem__ changes its attributes."""

    def __getitem__(self, i: int):
        self.reads = getattr(self, "reads", 0) + 1
        return super().__getitem__(i)


@pytest.mark.parametrize("workers", [0, 1])
def test_sample_batch_leaves_the_users_loader_untouched(workers):
    g = torch.Generator().manual_seed(0)
    sampler = RandomSampler(range(N), generator=g)
    loader = DataLoader(_Counting(), batch_size=4, sampler=sampler, generator=g, num_workers=workers,
                        persistent_workers=workers > 0)
    counted = DataLoader(_Points(), batch_sampler=BatchSampler(_CountingSampler(N), 4, False))
    g_state, global_state = g.get_state(), torch.get_rng_state()
    for data in (loader, counted):
        batch = sample_batch(data, seed=5, task="t")
        assert batch is not NO_BATCH and batch[0].shape == (4, 8)
    assert torch.equal(g.get_state(), g_state) and torch.equal(torch.get_rng_state(), global_state)
    assert loader._iterator is None and not hasattr(loader.dataset, "reads")
    assert counted.batch_sampler.sampler.passes == 0
    assert sample_batch(DataLoader(_Points(), batch_size=32, drop_last=True), seed=5, task="t") is NO_BATCH


def test_model_task_checks_a_loader_without_iterating_it():
    """`iter(loader)` would draw a base seed from torch's global generator and start persistent workers."""
    loader = DataLoader(_Points(), batch_size=4, shuffle=True, num_workers=1, persistent_workers=True)
    before = torch.get_rng_state()
    _task(loader)
    assert loader._iterator is None and torch.equal(torch.get_rng_state(), before)


def test_stateful_sampler_and_persistent_loader_with_generator_match_plain():
    diff = _diff(lambda: _task(DataLoader(_Points(), batch_sampler=BatchSampler(_CountingSampler(N), 4, False))))
    assert diff == 0.0
    diff = _diff(lambda: _task(DataLoader(_Points(), batch_size=4, shuffle=True, num_workers=1,
                                          persistent_workers=True, generator=torch.Generator().manual_seed(1))))
    assert diff == 0.0


@pytest.mark.parametrize("kw", [dict(shuffle=True, generator=True), dict(shuffle=True, num_workers=1,
                                                                       persistent_workers=True)],
                         ids=["generator", "persistent-workers"])
def test_tasks_sharing_one_loader_each_match_plain_alone(kw):
    """Each task iterates its own clone of the loader, taken at submit: concurrent tasks do not share its
    generator or its persistent workers, and the user's loader is not advanced."""
    def loader():
        return DataLoader(_Points(), batch_size=4, **dict(kw, generator=torch.Generator().manual_seed(0))
                          if kw.get("generator") else kw)

    shared = loader()
    before = None if shared.generator is None else shared.generator.get_state()
    tasks = [_task(shared, name=f"shared-{i}") for i in range(3)]
    for i, t in enumerate(tasks):
        t.seed = 3 + i
    with ht.Runtime(devices=["cpu", "cpu"], device_memory="64MiB") as rt:
        models = [trained(h) for h in [rt.submit(t) for t in tasks]]
    for i, model in enumerate(models):
        alone = _task(loader())
        alone.seed = 3 + i
        assert max_param_diff(plain_train(alone)[0], model) == 0.0, i
    assert shared._iterator is None
    assert before is None or torch.equal(shared.generator.get_state(), before)


def test_footprint_estimate_leaves_the_loader_untouched():
    g = torch.Generator().manual_seed(0)
    task = _task(DataLoader(_Points(), batch_size=4, shuffle=True, generator=g))
    before = g.get_state()
    with ht.Runtime(devices=["cpu"], device_memory="64MiB") as rt:
        assert rt.footprint(task).total > 0
    assert torch.equal(g.get_state(), before)


# -- other random consumers in data loading (part 2) ----------------------------------------------------------
def _collate_with_randperm(items):
    """A collate_fn that shuffles inside the batch with torch.randperm (the task's stream)."""
    xs, ys = torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])
    perm = torch.randperm(len(items))
    return xs[perm] + 0.01 * torch.randn(xs.shape), ys[perm]


class _Stream(IterableDataset):
    """An IterableDataset with a random augmentation, sharded over the workers."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        ds = _Points(None)
        for i in range(N)[info.id if info else 0::info.num_workers if info else 1]:
            yield ds.x[i] * torch.rand(()), ds.y[i]


LOADERS = {
    "weighted": lambda g: DataLoader(_Points(), batch_size=4,
                                     sampler=WeightedRandomSampler(torch.rand(N, generator=torch.Generator()
                                                                              .manual_seed(1)), 20, generator=g)),
    "subset": lambda g: DataLoader(_Points(), batch_size=4, sampler=SubsetRandomSampler(range(2, 22), generator=g)),
    "replacement": lambda g: DataLoader(_Points(), batch_size=4,
                                        sampler=RandomSampler(range(N), replacement=True, num_samples=16,
                                                              generator=g)),
    "collate-randperm": lambda g: DataLoader(_Points(), batch_size=4, shuffle=True, generator=g,
                                             collate_fn=_collate_with_randperm),
    "collate-in-workers": lambda g: DataLoader(_Points(), batch_size=4, shuffle=True, generator=g, num_workers=2,
                                               collate_fn=_collate_with_randperm),
    "iterable-main": lambda g: DataLoader(_Stream(), batch_size=4, generator=g),
    "iterable-workers": lambda g: DataLoader(_Stream(), batch_size=4, num_workers=2, generator=g),
    "no-batching": lambda g: DataLoader(_Points(), batch_size=None, shuffle=True, generator=g),
}


@pytest.mark.parametrize("own_generator", [False, True])
@pytest.mark.parametrize("name", sorted(LOADERS))
def test_random_consumers_in_data_loading_match_plain(name, own_generator):
    """Samplers, collate functions and augmentations drawing from the global stream (then the task's) or from a
    generator of the loader's own, in the main process or in workers."""
    def make():
        return _task(LOADERS[name](torch.Generator().manual_seed(2) if own_generator else None))

    assert _diff(make) == 0.0


@pytest.mark.parametrize("aug", ["random", "numpy"])
def test_global_python_or_numpy_random_in_this_process_is_refused(aug):
    """`random` and numpy's global generator are shared by all threads: the task's stream cannot be given to them
    (in workers PyTorch seeds them: exact, above)."""
    module = {"random": "random", "numpy": "numpy.random"}[aug]
    with ht.Runtime(devices=["cpu"], device_memory="64MiB") as rt, \
            pytest.raises(ValueError, match=rf"`train_data` draws no random numbers from the global generator of "
                                            rf"`{module}` in this process .* but got \(task='g', data='train_data', "
                                            rf"module='{module}'\)\. Fix: draw with torch"):
        rt.submit(_task(DataLoader(_Points(aug), batch_size=4), name="g"))
