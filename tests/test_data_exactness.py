"""Data loading is the plain loop's: DataLoader workers, loaders with their own generator, samplers, random
augmentation and collate functions, data factories called once per epoch; the sample batch at submit touches none
of the user's data (CPU fp32: max abs parameter difference 0.0)."""
from __future__ import annotations

import itertools
import random
import threading

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


# -- data factories, called once per epoch (case 3) -----------------------------------------------------------
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


def _shuffled_stream(dataset: Dataset, cap: int):
    """A transformed, capped stream: a fresh random order each call (torch.randperm, the task's stream)."""
    for i in torch.randperm(len(dataset))[:cap].tolist():
        x, y = dataset[i]
        yield x.unsqueeze(0), y.unsqueeze(0)


@pytest.mark.parametrize("kind", ["generator", "loader"])
def test_data_factories_are_called_once_per_epoch_like_plain(kind):
    ds = _Points()
    if kind == "generator":
        train, held_out = (lambda: _shuffled_stream(ds, 10)), (lambda: _shuffled_stream(ds, 3))
    else:
        train = lambda: DataLoader(ds, batch_size=4, shuffle=True)  # noqa: E731
        held_out = lambda: DataLoader(ds, batch_size=8, shuffle=True)  # noqa: E731
    calls = []

    def counted():
        calls.append(threading.current_thread() is threading.main_thread())
        return train()

    plain = _plain_with_eval(_task(train, epochs=3, eval_data=held_out))
    with ht.Runtime(devices=["cpu"], device_memory="64MiB") as rt:
        got = trained(rt.submit(_task(counted, epochs=3, eval_data=held_out)))
    assert max_param_diff(plain, got) == 0.0
    assert calls.count(False) == 3 and calls.count(True) >= 1  # once per epoch; at submit for the sample batch


def test_factory_handing_out_slices_of_one_shared_iterator_is_refused():
    ds = _Points()
    shared = iter([(ds.x[i:i + 4], ds.y[i:i + 4]) for i in range(0, N, 4)] * 10)
    with ht.Runtime(devices=["cpu"], device_memory="64MiB") as rt, \
            pytest.raises(ValueError, match=r"the `train_data` factory returns a fresh iterable on every call .* "
                                            r"but got \(task='shared', data='train_data', returned='islice'\)"):
        rt.submit(_task(lambda: itertools.islice(shared, 3), name="shared"))


def test_factory_returning_something_not_iterable_is_refused():
    with ht.Runtime(devices=["cpu"], device_memory="64MiB") as rt, \
            pytest.raises(TypeError, match=r"the `train_data` factory returns an iterable must hold, but got "
                                           r"\(task='int', returned='int'\)"):
        rt.submit(_task(lambda: 3, name="int"))


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


# -- checkpoints repeat the data order (part 2) ---------------------------------------------------------------
_ASK: dict = {}  # the running handle, where to write, when, and the request made (module-level: samplers copy)


class _AskingSampler(RandomSampler):
    """A RandomSampler that, when the training thread starts a pass over it at the chosen point, asks the running
    task for a checkpoint (served at its next step boundary): at epoch 2's start ("train"), or at epoch 1's
    evaluation ("eval": the epoch boundary)."""

    def __init__(self, n: int, role: str, generator: torch.Generator | None = None) -> None:
        super().__init__(range(n), generator=generator)
        self.role = role

    def __iter__(self):
        if threading.current_thread() is not threading.main_thread() and "request" not in _ASK:
            _ASK["ready"].wait(30)
            state = _ASK["handle"]._state
            if self.role == _ASK["when"] and state.epoch == {"train": 2, "eval": 1}[self.role]:
                _ASK["request"] = state.request_checkpoint(_ASK["path"])
        return super().__iter__()


def _asking_loader(g: torch.Generator | None, **kw) -> DataLoader:
    return DataLoader(_Points(), batch_size=4, sampler=_AskingSampler(N, "train", g), generator=g, **kw)


RESUMED = {
    "shuffle": lambda: _asking_loader(None),
    "workers": lambda: _asking_loader(None, num_workers=2),
    "sampler-generator": lambda: DataLoader(_Points(), batch_size=4,
                                            sampler=_AskingSampler(N, "train", torch.Generator().manual_seed(4))),
    "loader-generator": lambda: _asking_loader(torch.Generator().manual_seed(4)),
    "factory-generator": lambda: (lambda g: lambda: _asking_loader(g))(torch.Generator().manual_seed(4)),
}


def _checkpointed(make_data, when: str, path) -> tuple[nn.Module, dict]:
    """Train a 3-epoch task from ``make_data()``, checkpointed at ``when``; (its final model, the position)."""
    from hydra_tune.training import checkpoint

    held_out = DataLoader(_Points(None), batch_size=8, sampler=_AskingSampler(N, "eval"))
    _ASK.clear()
    _ASK.update(ready=threading.Event(), path=str(path), when=when)
    with ht.Runtime(devices=["cpu"], device_memory="64MiB") as rt:
        handle = rt.submit(_task(make_data(), epochs=3, eval_data=held_out))
        _ASK["handle"] = handle
        _ASK["ready"].set()
        full = trained(handle)
    _ASK["request"].wait(30)
    return full, checkpoint.load(path)["position"]


@pytest.mark.parametrize("when", ["train", "eval"])
@pytest.mark.parametrize("name", sorted(RESUMED))
def test_resumed_in_epoch_two_repeats_the_data_order(name, when, tmp_path):
    """The loader's own generators' states at the epoch's start are in the checkpoint. A request is served at the
    boundary the task stands at, if it has not handed out its next minibatch yet: asked while epoch 1's evaluation
    starts, that is epoch 1's last step (1, 6); asked while epoch 2's data starts, the epoch boundary (2, 0) — but a
    data factory's next epoch has no data yet at an epoch boundary, so its checkpoint waits for the next step."""
    make = RESUMED[name]
    full, position = _checkpointed(make, when, tmp_path / "c.pt")
    factory = name.startswith("factory")
    expected = (1, 6) if when == "eval" else (2, 1) if factory else (2, 0)
    assert (position["epoch"], position["batch_in_epoch"]) == expected
    def held_out():
        return DataLoader(_Points(None), batch_size=8, sampler=_AskingSampler(N, "eval"))

    resumed = _hydra(_task(make(), epochs=3, eval_data=held_out(), resume_from=str(tmp_path / "c.pt")))
    assert max_param_diff(full, resumed) == 0.0
    assert max_param_diff(_plain_with_eval(_task(make(), epochs=3, eval_data=held_out())), full) == 0.0


def test_resume_after_epoch_one_with_persistent_workers_is_refused(tmp_path):
    _checkpointed(lambda: _asking_loader(None), "train", tmp_path / "c.pt")
    task = _task(_asking_loader(None, num_workers=1, persistent_workers=True), epochs=3, name="persist",
                 resume_from=str(tmp_path / "c.pt"))
    with ht.Runtime(devices=["cpu"], device_memory="64MiB") as rt, \
            pytest.raises(ValueError, match=r"a task resumed after its first epoch has no DataLoader with persistent "
                                            r"workers .* but got \(task='persist', data='train_data', epoch=2\)"):
        rt.submit(task)


def test_resume_with_other_data_generators_is_refused(tmp_path):
    _checkpointed(lambda: _asking_loader(None), "train", tmp_path / "c.pt")
    task = _task(_asking_loader(torch.Generator().manual_seed(4)), epochs=3, name="gens",
                 resume_from=str(tmp_path / "c.pt"))
    with ht.Runtime(devices=["cpu"], device_memory="64MiB") as rt, \
            pytest.raises(ValueError, match=r"the resumed task's train data has as many generators of its own as the "
                                            r"checkpointed task's .* but got \(task='gens', checkpoint=0, data=1\)"):
        rt.submit(task)
