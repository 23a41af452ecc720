"""Checkpoints repeat the data order (issue 13): the loader's own generators' states at the epoch's start are in
the checkpoint, so a task resumed in epoch 2 draws the data its uninterrupted run drew; a resume whose data
cannot repeat it (persistent workers after epoch 1, other generators) is refused at submit."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
from reference import max_param_diff, trained
from test_data_exactness import N, _hydra, _plain_with_eval, _Points, _task
from torch.utils.data import DataLoader, RandomSampler

import hydra_tune as ht


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
