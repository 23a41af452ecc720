"""A checkpoint taken at the end of a task's last epoch resumes to a task that emits that epoch's metrics once more
and ends with the checkpointed model (a Tune trial restored from its final checkpoint ends with its final result);
a resume that would train nothing else, or steps past ``max_steps``, is refused at submit."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, plain_train, trained

import hydra_tune as ht
from hydra_tune.device.devices import CpuDevice
from hydra_tune.training import checkpoint
from hydra_tune.training.residency import ShardCache
from hydra_tune.training.state import TaskState

RULE = "a resumed task has training left at its checkpoint"


def _batches(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]


def _task(**kw) -> ht.ModelTask:
    kw = {"epochs": 2, "seed": 4, "name": "final", "eval_data": _batches(2, 9), **kw}
    return ht.ModelTask(lambda: nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 2)),
                        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), _batches(3, 0),
                        loss=lambda out, b: F.mse_loss(out, b[1]), **kw)


def _checkpoint_at_epoch_end(task: ht.ModelTask, epoch: int, path) -> tuple[list, nn.Module]:
    """Train ``task`` and ask a checkpoint while it emits epoch ``epoch``'s metrics: it is written at that epoch's
    end. Returns the metrics emitted and the trained model."""
    state, emitted, asked = TaskState.build(task, budget=None), [], []

    def emit(m: dict) -> None:
        emitted.append(dict(m))
        if m["epoch"] == epoch:
            asked.append(state.request_checkpoint(str(path)))

    device = CpuDevice("cpu:0", None)
    device.resident = ShardCache()
    for segment in state.segments(emit):
        for unit in segment.units:
            unit.run(device)
    assert asked[0].wait(timeout=10) == str(path)
    return emitted, state.model


def _resume(task: ht.ModelTask) -> tuple[list, dict, nn.Module]:
    with ht.Runtime(devices=["cpu"]) as rt:
        handle = rt.submit(task)
        metrics = list(handle.metrics())
        return metrics, handle.result(), trained(handle)


def test_resumed_from_its_final_checkpoint_the_task_reports_its_final_metrics_once(tmp_path):
    path = tmp_path / "final.pt"
    emitted, model = _checkpoint_at_epoch_end(_task(), 2, path)
    pos = checkpoint.load(path)["position"]
    assert (pos["epoch"], pos["batch_in_epoch"]) == (3, 0)
    metrics, result, resumed = _resume(_task(resume_from=str(path)))
    final = dict(emitted[-1], task="final")            # the handle names the task in each epoch's metrics
    assert metrics == [final] and result == final      # before: no metrics at all, result() == {}
    assert pos["metrics"] == emitted[-1]
    assert max_param_diff(model, resumed) == 0.0
    assert max_param_diff(plain_train(_task())[0], resumed) == 0.0


def test_a_final_checkpoint_resumed_with_new_hparams_reports_the_new_learning_rate(tmp_path):
    """PBT's exploit at the last perturbation: the restored trial's final report carries the explored rate its
    optimizer now holds (resume_hparams="task"), not the checkpointed trial's."""
    path = tmp_path / "final.pt"
    emitted, model = _checkpoint_at_epoch_end(_task(), 2, path)
    explored = ht.ModelTask(lambda: nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 2)),
                            lambda m: torch.optim.SGD(m.parameters(), lr=0.005, momentum=0.9), _batches(3, 0),
                            loss=lambda out, b: F.mse_loss(out, b[1]), epochs=2, seed=4, name="final",
                            eval_data=_batches(2, 9), resume_from=str(path), resume_hparams="task")
    metrics, _, resumed = _resume(explored)
    assert emitted[-1]["lr"] == 0.05 and [m["lr"] for m in metrics] == [0.005]
    assert max_param_diff(model, resumed) == 0.0


def test_the_restored_trials_loop_body_runs_once_and_can_checkpoint_again(tmp_path):
    # The Tune pattern: for m in train(task): save_checkpoint(...); report(m). The body sees the final metrics
    # once; a checkpoint asked as they are emitted is the same final checkpoint again.
    path, again = tmp_path / "final.pt", tmp_path / "again.pt"
    emitted, _ = _checkpoint_at_epoch_end(_task(), 2, path)
    metrics, model = _checkpoint_at_epoch_end(_task(resume_from=str(path)), 2, again)
    assert metrics == [emitted[-1]]
    a, b = checkpoint.load(path), checkpoint.load(again)
    assert a["position"]["metrics"] == b["position"]["metrics"] and a["position"]["steps"] == b["position"]["steps"]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    torch.testing.assert_close(a["position"]["rng"], b["position"]["rng"], rtol=0, atol=0)


def test_a_final_checkpoint_resumed_with_more_epochs_trains_on_exactly(tmp_path):
    path = tmp_path / "final.pt"
    _checkpoint_at_epoch_end(_task(), 2, path)
    metrics, _, resumed = _resume(_task(epochs=3, resume_from=str(path)))
    assert [m["epoch"] for m in metrics] == [3]
    assert max_param_diff(plain_train(_task(epochs=3))[0], resumed) == 0.0


def test_a_checkpoint_past_the_tasks_epochs_is_refused(tmp_path):
    path = tmp_path / "final.pt"
    _checkpoint_at_epoch_end(_task(), 2, path)
    with ht.Runtime(devices=["cpu"]) as rt:
        with pytest.raises(ValueError, match=RULE) as err:   # before: the task trained nothing, silently
            rt.submit(_task(epochs=1, resume_from=str(path)))
    assert "checkpoint_epoch=3" in str(err.value) and "resume with epochs >= 3" in str(err.value)


def test_a_final_checkpoint_without_its_metrics_is_refused(tmp_path):
    path = tmp_path / "final.pt"
    _checkpoint_at_epoch_end(_task(), 2, path)
    data = checkpoint.load(path)
    del data["position"]["metrics"]   # written before checkpoints held them
    checkpoint.save(data, path)
    with ht.Runtime(devices=["cpu"]) as rt, pytest.raises(ValueError, match=RULE):
        rt.submit(_task(resume_from=str(path)))


def test_a_resume_with_no_steps_left_under_max_steps_is_refused(tmp_path):
    path = tmp_path / "epoch1.pt"
    _checkpoint_at_epoch_end(_task(epochs=3), 1, path)      # 3 steps done, at the start of epoch 2
    with ht.Runtime(devices=["cpu"]) as rt:
        for max_steps in (2, 3):   # before: each trained one step past max_steps
            with pytest.raises(ValueError, match="a resumed task has steps left") as err:
                rt.submit(_task(epochs=3, max_steps=max_steps, resume_from=str(path)))
            assert "checkpoint_steps=3" in str(err.value)
        metrics, _, resumed = _resume(_task(epochs=3, max_steps=4, resume_from=str(path)))
    assert [m["steps"] for m in metrics] == [4]
    assert max_param_diff(plain_train(_task(epochs=3, max_steps=4))[0], resumed) == 0.0
