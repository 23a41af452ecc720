"""A prepared step's backward runs on the device its forward ran on (Segment.follows; runtime/opening.py ``FOLLOW``):
the device stays for it past the policy's turn and other ready work, so it runs through the forward's kept graph,
in the loop's own thread (stats ``follow_waits``, ``lent_segments``, ``kept_backwards``), bit identical to the plain
loop; and a kept backward's refill of its released parameter copies runs no op through the CPU device's counting
mode (devices.py ``refill_scope``), its bytes counted as before."""
from __future__ import annotations

import threading

import torch
from test_prepare_exactness import _diff, mlp_loop

import hydra_tune as ht
from hydra_tune.device import dispatch
from hydra_tune.device.devices import CpuDevice
from hydra_tune.device.rng import TaskRNG
from hydra_tune.prepare.streams import trial_stream
from hydra_tune.stages import Stage
from hydra_tune.training.residency import Kept
from hydra_tune.training.shard import ShardExec
from hydra_tune.training.store import HostStore


def test_the_backward_is_lent_on_its_forwards_device_past_the_turn_bit_identical():
    plain = mlp_loop(epochs=2)
    # FIFO takes turns per segment (no turn holds), so before, no call ran lent and every backward went through the
    # task's host thread; now the backward that completes a forward is due on its device whatever the turn
    with ht.Runtime(devices=["cpu"], device_memory=None, policy="fifo") as rt:
        weights, history, model = mlp_loop(lambda m, o: ht.prepare(m, o, runtime=rt, name="pairs"), epochs=2)
        stats = rt.stats()["tasks"]["pairs"]
        model.release()
    assert _diff(plain[0], weights) == 0.0 and plain[1] == history
    assert stats["lent_segments"] >= 1 and stats.get("follow_waits", 0) >= 1
    assert stats.get("lent_picks", 0) >= 1  # forwards out of a turn, lent as the policy, asked then, picked them
    assert stats["kept_backwards"] == 8  # every step (2 epochs x 4) through its forward's graph


def test_two_prepared_tasks_on_two_devices_keep_every_backward_with_its_forward_bit_identical():
    plain = mlp_loop(epochs=2)
    results: dict[str, tuple] = {}
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=None) as rt:
        def run(name: str) -> None:
            with trial_stream():  # each thread its own stream, as Optuna's trial threads (streams.py)
                results[name] = mlp_loop(lambda m, o: ht.prepare(m, o, runtime=rt, name=name), epochs=2)
        threads = [threading.Thread(target=run, args=(f"t{i}",)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = rt.stats()["tasks"]
        for _, _, model in results.values():
            model.release()
    assert set(results) == {"t0", "t1"}
    for name, (weights, history, _) in results.items():
        assert _diff(plain[0], weights) == 0.0 and plain[1] == history, name
        assert stats[name]["kept_backwards"] == 8, name  # each backward on its forward's device, through its graph


def _one_shard() -> tuple[ShardExec, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    stages = [Stage(f"{i}:{type(m).__name__}", m) for i, m in enumerate(model)]
    return ShardExec(0, stages), model


def test_a_kept_backwards_refill_runs_no_op_through_the_counting_mode_and_counts_its_bytes(monkeypatch):
    ex, model = _one_shard()
    device = CpuDevice("cpu:0", None)
    device.measuring = False
    store, rng = HostStore(), TaskRNG(0)
    store.carries[0] = torch.randn(3, 8)
    ex.forward(device, store, rng, keep=True)  # (a planned keep: its parameter bytes released until B)
    kept: Kept = store.kept[0]
    assert not kept.filled and all(kept.copies[id(p)].untyped_storage().nbytes() == 0 for p in ex.params)
    before = device.account.current
    ops: list[object] = []
    real = dispatch.UnitMode.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        ops.append(func)
        return real(self, func, types, args, kwargs)
    monkeypatch.setattr(dispatch.UnitMode, "__torch_dispatch__", counting)
    nbytes = ex.refill(device, kept)
    assert ops == []  # before: every refill's detach, empty, set_ and copy_ went through the mode
    assert nbytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert device.account.current - before == nbytes  # the refilled storages are counted as the device's
    for p in ex.params:
        assert torch.equal(kept.copies[id(p)], p)


def test_a_backward_right_after_its_forward_needs_no_refill_bit_identical():
    plain = mlp_loop(epochs=2)
    # its state (34 KiB) does not stay beside its peak (33 KiB) in 64 KiB: it moves in per step, the graph fits
    with ht.Runtime(devices=["cpu"], device_memory="64KiB") as rt:
        weights, history, model = mlp_loop(lambda m, o: ht.prepare(m, o, runtime=rt, name="loaded"), epochs=2)
        stats = rt.stats()
        model.release()
    assert _diff(plain[0], weights) == 0.0 and plain[1] == history
    task = stats["tasks"]["loaded"]
    # before: each kept backward copied its parameters in a second time (refill); now they stay from the forward
    assert task["residency"]["step_path"] == "whole-host"
    assert task["kept_backwards"] == 8 and task.get("loaded_backwards", 0) == 8
    assert stats["devices"][0]["graphs_unloaded"] == 0


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x), y)


def test_another_tasks_segment_between_forward_and_backward_unloads_the_parameters_and_stays_exact():
    from test_prepare_exactness import X, Y, _mlp

    def two(prepare=None) -> list[dict]:
        models = []
        for seed in (1, 2):
            torch.manual_seed(seed)
            m = _mlp()
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
            models.append(prepare(m, opt, seed) if prepare is not None else (m, opt))
        for i in range(3):
            x, y = X[i * 16:(i + 1) * 16], Y[i * 16:(i + 1) * 16]
            (a, a_opt), (b, b_opt) = models
            loss_a = _loss(a, x, y)          # a's forward: its graph and parameters stay on the device
            loss_b = _loss(b, x, y)          # b's forward runs there meanwhile: a's parameters give way
            b_opt.zero_grad(); loss_b.backward(); b_opt.step()
            a_opt.zero_grad(); loss_a.backward(); a_opt.step()   # a's backward refills them, through its graph
        return [{k: v.clone() for k, v in m.state_dict().items()} for m, _ in models]

    plain = two()
    with ht.Runtime(devices=["cpu"], device_memory="64KiB") as rt:  # neither state stays; both graphs fit
        got = two(lambda m, o, s: ht.prepare(m, o, runtime=rt, name=f"m{s}"))
        stats = rt.stats()
    assert all(_diff(p, g) == 0.0 for p, g in zip(plain, got))
    assert stats["devices"][0]["graphs_unloaded"] >= 3  # a's, at each of b's forwards
    assert stats["tasks"]["m1"]["kept_backwards"] == 3 and stats["tasks"]["m1"]["loaded_backwards"] == 0
    assert stats["devices"][0]["peak_bytes"] <= 64 * 1024


def test_a_prepared_loop_that_calls_again_and_again_leaves_the_device_to_a_model_task_beside_it():
    """FIFO: a turn per segment; a forward lent out of its turn only where the policy, asked then, picks it (the
    ModelTask's segment, ready first, goes first), its backward before any other. (Under LRTF the loop, whose
    remaining time is unknown, is the longer task: it goes first by that policy's rule.)"""
    from test_prepare_exactness import X, Y, _mlp

    batches = [(X[i:i + 8], Y[i:i + 8]) for i in range(0, 64, 8)]
    with ht.Runtime(devices=["cpu"], device_memory="64KiB", policy="fifo") as rt:
        torch.manual_seed(3)
        m = _mlp()
        model, opt = ht.prepare(m, torch.optim.AdamW(m.parameters(), lr=1e-3), runtime=rt, name="busy")

        def step() -> None:
            loss = torch.nn.functional.cross_entropy(model(X[:16]), Y[:16])
            opt.zero_grad()
            loss.backward()
            opt.step()
        for _ in range(5):  # planned, measured, lending
            step()
        handle = rt.submit(ht.ModelTask(_mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), batches,
                                        loss=lambda out, b: torch.nn.functional.cross_entropy(out, b[1]),
                                        epochs=2, seed=1, name="beside"))
        steps = 0
        while not handle.done() and steps < 3000:  # the loop's calls keep coming: the device still takes turns
            step()
            steps += 1
        stats = rt.stats()["tasks"]
        model.release()
    assert handle.done() and handle.error is None and steps < 3000, steps
    assert stats["busy"]["lent_segments"] > 0
