"""The light path of a resident only shard (training/direct.py): its units run over the model's own parameters and
end bit-identical to the plain loop (CPU fp32: max abs parameter difference 0.0); what it cannot do exactly takes
the general path or is refused."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, plain_train, trained

import hydra_tune as ht
from hydra_tune.device import dispatch


@pytest.fixture(autouse=True)
def no_lending_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    # quiet units (and so reruns) stop for the process once any task lent the global generator: start afresh
    monkeypatch.setattr(dispatch, "_LENT", [])


def _batches(n: int = 8, seed: int = 3) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def _ce(out: torch.Tensor, batch: tuple) -> torch.Tensor:
    return F.cross_entropy(out, batch[1])


def _correct(out: torch.Tensor, batch: tuple) -> tuple[torch.Tensor, int]:
    return (out.argmax(-1) == batch[1]).sum(), batch[1].numel()


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))


def _task(model=_mlp, name: str = "t", seed: int = 7, **kw) -> ht.ModelTask:
    kw.setdefault("eval_data", _batches(3, seed=5))
    metrics = {"accuracy": _correct} if kw["eval_data"] is not None else None
    return ht.ModelTask(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), _batches(),
                        loss=_ce, metrics=metrics, epochs=3, seed=seed, name=name, **kw)


def _run(*tasks: ht.ModelTask, devices: int = 1, **runtime) -> tuple[list, dict]:
    with ht.Runtime(devices=["cpu"] * devices, **runtime) as rt:
        handles = [rt.submit(t) for t in tasks]
        results = [h.result() for h in handles]
        stats = rt.stats()
        return [(trained(h), r) for h, r in zip(handles, results)], stats


def test_only_shard_takes_the_light_path_and_stays_exact() -> None:
    task = _task()
    [(model, result)], stats = _run(task)
    plain, _ = plain_train(task)
    assert max_param_diff(model, plain) == 0.0
    record = stats["tasks"]["t"]
    assert record["shards"] == [["0:Linear", "1:ReLU", "2:Dropout", "3:Linear"]] or len(record["shards"]) == 1
    # every train and eval unit but the first segment of each (measured op by op on the general path)
    assert record["light_units"] >= record["units"] - 2
    assert 0.0 <= result["accuracy"] <= 1.0


def test_concurrent_trials_on_two_devices_stay_exact() -> None:
    tasks = [_task(name=f"t{i}", seed=i) for i in range(4)]
    runs, stats = _run(*tasks, devices=2)
    for task, (model, _) in zip(tasks, runs):
        assert max_param_diff(model, plain_train(task)[0]) == 0.0, task.name
        assert stats["tasks"][task.name]["light_units"] > 0


class LateNoise(nn.Module):
    """Draws nothing on its first ``quiet`` forwards, then adds noise on every one: the first light unit that draws
    is rerun (device/quiet.py) after its backward has written gradients into ``.grad``."""

    def __init__(self, quiet: int = 3) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.quiet, self.calls = quiet, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x + torch.empty_like(x).normal_(0.0, 0.1) if self.calls > self.quiet else x)


def test_a_light_unit_run_again_starts_from_no_gradient() -> None:
    # Without setting the gradients back to None when the unit fails, the rerun would add its gradient to the
    # failed attempt's: twice the step (the weights differ from the plain loop's).
    task = _task(LateNoise, eval_data=None)
    [(model, _)], stats = _run(task)
    assert stats["devices"][0]["unrouted"]["reruns"] == 1
    assert stats["tasks"]["t"]["light_units"] > 0
    assert max_param_diff(model, plain_train(task)[0]) == 0.0


def test_accumulated_minibatches_after_the_first_take_the_general_path() -> None:
    task = _task(grad_accumulation=2, eval_data=None)
    [(model, _)], stats = _run(task)
    assert max_param_diff(model, plain_train(task)[0]) == 0.0
    record = stats["tasks"]["t"]
    assert 0 < record["light_units"] < record["units"]  # the second of each pair holds gradients: general path


def test_a_sharded_task_takes_the_general_path() -> None:
    task = _task()
    [(model, _)], stats = _run(task, device_memory=6000)  # bytes: two shards
    assert len(stats["tasks"]["t"]["shards"]) > 1
    assert stats["tasks"]["t"]["light_units"] == 0
    assert max_param_diff(model, plain_train(task)[0]) == 0.0


class Replaces(nn.Module):
    """Assigns a new Parameter to its own slot in every forward: the optimizer's parameter would never train."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lin.weight = nn.Parameter(self.lin.weight.detach() * 1.0)
        return self.lin(x)


def test_a_forward_that_replaces_a_parameter_is_refused() -> None:
    with ht.Runtime(devices=["cpu"]) as rt:
        handle = rt.submit(_task(Replaces, eval_data=None))
        with pytest.raises(Exception, match="leaves its module's parameters in their slots") as err:
            handle.result()
    assert "lin.weight" in str(err.value) or "weight" in str(err.value)


def test_a_parameter_gradient_hook_is_refused_at_submit() -> None:
    # Before: the hook silently never ran (the units differentiate their own device tensors), so a hook that
    # zeroes a gradient left that parameter training in hydra_tune and frozen in the plain loop.
    def hooked() -> nn.Module:
        model = _mlp()
        model[0].weight.register_hook(lambda g: g * 0)
        return model

    with ht.Runtime(devices=["cpu"]) as rt:
        with pytest.raises(Exception, match="carry no gradient hooks") as err:
            rt.submit(_task(hooked)).result()
    assert "0.weight" in str(err.value)


def test_torch_modules_take_no_state_snapshot_unless_hooked_or_changed() -> None:
    from hydra_tune.training.pystate_inert import inert_modules, still_inert

    model = _mlp()
    inert = inert_modules(list(model.modules()))
    assert still_inert(inert)
    handle = model[0].register_forward_hook(lambda m, i, o: None)
    assert not still_inert(inert)  # a hook's closure may keep state: snapshots again
    handle.remove()
    model[3].scale = 2.0
    assert not still_inert(inert)  # an attribute added since: not known to be inert
    assert inert_modules(list(LateNoise().modules())) is None  # a class of the user's: always a snapshot


def test_a_hook_counter_on_torch_modules_is_undone_when_its_unit_runs_again() -> None:
    # nn.Linear alone would take no snapshot; its forward hook keeps a counter in its closure and, from its 4th
    # call on, draws (a rerun, device/quiet.py): the rerun must start from the count before the failed attempt.
    def make() -> nn.Module:
        model = nn.Sequential(nn.Linear(8, 3))
        calls = [0]

        def hook(module: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            return out + torch.empty_like(out).normal_(0.0, 0.1) if calls[0] > 3 else out
        model[0].register_forward_hook(hook)
        model.calls = calls
        return model

    task = _task(make, eval_data=None)
    [(model, _)], stats = _run(task)
    plain, _ = plain_train(task)
    assert stats["devices"][0]["unrouted"]["reruns"] == 1
    assert model.calls == plain.calls == [24]  # 8 batches x 3 epochs: each forward counted once
    assert max_param_diff(model, plain) == 0.0


def _autoencoder() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Dropout(0.2), nn.Linear(4, 8))


def _reconstruction(out: torch.Tensor, batch: tuple) -> torch.Tensor:
    return F.mse_loss(out, batch[1])


@pytest.mark.parametrize("container", [tuple, list])
def test_a_batch_holding_one_tensor_twice_is_copied_once_a_unit_and_stays_exact(container) -> None:
    # an autoencoder's (x, x): the forward and the loss read one x, as in the plain loop, and its bytes cross once
    g = torch.Generator().manual_seed(4)
    data = [container([x, x]) for x in torch.randn(6, 4, 8, generator=g)]
    counted = []
    for epochs in (1, 3):
        task = ht.ModelTask(_autoencoder, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), data,
                            loss=_reconstruction, epochs=epochs, seed=3, name="ae")
        [(model, _)], stats = _run(task)
        assert max_param_diff(model, plain_train(task)[0]) == 0.0
        record = stats["tasks"]["ae"]
        counted.append((record["units"], record["light_units"], record["residency"]["copies"]["h2d"]["batches"]))
    (units1, light1, bytes1), (units3, light3, bytes3) = counted
    assert light3 - light1 == units3 - units1 == 12  # the later epochs' units all took the light path
    assert bytes3 - bytes1 == 12 * data[0][0].nbytes  # each copied x once
