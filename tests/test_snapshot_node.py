"""``snapshot()`` and ``model()`` of a task run by the node server (RemoteHandle): the snapshot is served by the
server's loop at a step boundary and shipped; ``model()`` of a running task raises at once, as in-process."""
from __future__ import annotations

import pytest
import torch.nn.functional as F
from reference import max_param_diff, plain_train
from test_node import _connect, _data, _mlp, _sgd, _slow_mse, _wait, node_dir  # noqa: F401 (node_dir: the fixture)

import hydra_tune as ht

NOT_ENDED = "the task has ended: model\\(\\) returns the trained model must hold"


def _task(**kw) -> ht.ModelTask:
    kw = {"epochs": 3, "seed": 2, "grad_accumulation": 2, "name": "snap", "loss": _slow_mse, **kw}
    return ht.ModelTask(_mlp, _sgd, _data(20), **kw)


def _fails_on_small_batches(out, batch):
    if out.shape[0] == 5:
        raise ValueError("boom in user loss")
    return F.mse_loss(out, batch[1])


def test_remote_snapshot_is_served_in_the_server_and_equals_the_plain_loop():
    with _connect() as rt:
        h = rt.submit(_task())
        assert _wait(lambda: h.status == "running", 30)
        with pytest.raises(RuntimeError, match=NOT_ENDED):   # before: waited for the end, then the final model
            h.model()
        snaps = [h.snapshot(timeout=60)]
        for m in h.metrics():
            snaps.append(h.snapshot(timeout=60))
            assert snaps[-1].steps >= m["steps"]
        final = h.model()
        done = h.snapshot()                                  # done: a copy of the final model, here
    assert done.model is not final and max_param_diff(done.model, final) == 0.0
    assert (done.epoch, done.steps, done.epoch_end) == (3, m["steps"], True)
    assert snaps[0].steps >= 1 and [s.steps for s in snaps] == sorted(s.steps for s in snaps)
    for snap in snaps:
        plain, _ = plain_train(_task(max_steps=snap.steps))
        assert max_param_diff(plain, snap.model) == 0.0, (snap.epoch, snap.steps)
    assert max_param_diff(plain_train(_task())[0], final) == 0.0


def test_remote_snapshot_of_a_failed_task_raises_naming_it_as_the_client_does():
    data = _data(4)
    data[2] = (data[2][0][:5], data[2][1][:5])
    with _connect() as rt:
        h = rt.submit(ht.ModelTask(_mlp, _sgd, data, loss=_fails_on_small_batches, epochs=2, name="bad"))
        with pytest.raises(ValueError, match="boom in user loss"):
            h.result(timeout=60)
        with pytest.raises(RuntimeError, match="snapshot\\(\\) copies its model must hold, but got \\(task='bad', "
                                               "status='failed'"):
            h.snapshot()
        with pytest.raises(ValueError, match="boom in user loss"):
            h.model()
