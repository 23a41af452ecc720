"""A zero-argument data factory is called once per epoch, like the plain loop calls it, and may return any
iterable (a generator, a DataLoader); one handing out slices of a shared iterator, or returning something not
iterable, is refused at submit (issue 13; CPU fp32: max abs parameter difference 0.0)."""
from __future__ import annotations

import itertools
import threading

import pytest
import torch
from reference import max_param_diff, trained
from test_data_exactness import N, _plain_with_eval, _Points, _task
from torch.utils.data import DataLoader, Dataset

import hydra_tune as ht


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
