"""A prepared training forward keeps its last shard's graph for the backward call (prepare/driver.py
``_train_forward``): that B unit backpropagates through it instead of recomputing (stats ``kept_backwards``), bit
identical to the plain loop; a graph the device drops for room (held_graphs.py) or that does not fit is recomputed,
bit identical too; a forward whose backward never comes holds no graph past the next forward or the release."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from test_prepare_exactness import X, Y, _bn_mlp, _diff, gpt2_loop, mlp_loop
from test_resident import _tiny_state

import hydra_tune as ht
from hydra_tune.device.devices import CpuDevice
from hydra_tune.training.state_cache import StateCache


def _held(rt: ht.Runtime) -> list[int]:
    return [d.states.graphs.nbytes() for d in rt.devices]


def test_the_backward_runs_through_the_kept_last_graph_bit_identical_with_dropout_clipping_and_evaluation():
    plain = mlp_loop(epochs=2)
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=None) as rt:
        weights, history, model = mlp_loop(lambda m, o: ht.prepare(m, o, runtime=rt, name="kept"), epochs=2)
        stats = rt.stats()
        model.release()
    assert _diff(plain[0], weights) == 0.0 and plain[1] == history
    assert stats["tasks"]["kept"].get("kept_backwards", 0) == 8  # every step (2 epochs x 4) ran no recompute
    assert sum(d.get("graphs_held", 0) for d in stats["devices"]) == 8


def test_gpt2_sharded_keeps_its_last_shards_graph_where_it_fits_bit_identical():
    plain = gpt2_loop()
    with ht.Runtime(devices=["cpu", "cpu"], device_memory="900KiB") as rt:
        weights, losses, _ = gpt2_loop(lambda m, o, s: ht.prepare(m, o, lr_scheduler=s, runtime=rt, name="gpt2"))
        stats = rt.stats()
    assert len(stats["tasks"]["gpt2"]["shards"]) > 1
    assert _diff(plain[0], weights) == 0.0 and plain[1] == losses
    assert sum(d.get("graphs_held", 0) for d in stats["devices"]) == 6  # every training forward's last shard


def bn_loop(prepare=None, between=None, steps: int = 4):
    """BatchNorm (buffers a recompute must see as the forward did) and dropout; ``between(i)`` runs between each
    forward and its backward."""
    torch.manual_seed(5)
    model = _bn_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if prepare is not None:
        model, opt = prepare(model, opt)
    for i in range(steps):
        loss = F.cross_entropy(model(X[i * 16:(i + 1) * 16]), Y[i * 16:(i + 1) * 16])
        if between is not None:
            between(i)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}, model


def test_a_graph_dropped_for_room_is_recomputed_bit_identical_with_batchnorm_and_dropout():
    plain, _ = bn_loop()
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        dropped = []

        def between(i: int) -> None:  # as another task that needs the room would, on every other step
            if i % 2:
                dropped.append(rt.devices[0].states.graphs.drop(1 << 40))
        weights, model = bn_loop(lambda m, o: ht.prepare(m, o, runtime=rt, name="dropped"), between)
        stats = rt.stats()
        model.release()
    assert _diff(plain, weights) == 0.0
    assert len(dropped) == 2 and all(n > 0 for n in dropped)
    assert stats["devices"][0]["graphs_dropped"] == 2
    assert stats["tasks"]["dropped"]["kept_backwards"] == 2  # the other two steps ran through their graphs


def test_the_last_graph_is_kept_within_the_peak_its_recomputing_backward_reserves():
    plain, _ = bn_loop()
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        _, model = bn_loop(lambda m, o: ht.prepare(m, o, runtime=rt, name="probe"), steps=1)
        peak = rt.stats()["tasks"]["probe"]["predicted_peak"]
        model.release()
    # the same one-shard plan with no room beside its peak: the graph is the one its B unit would recompute within
    # that peak, so it is kept all the same, and the device's measured peak stays within the budget
    with ht.Runtime(devices=["cpu"], device_memory=peak + 1) as rt:
        weights, model = bn_loop(lambda m, o: ht.prepare(m, o, runtime=rt, name="tight"))
        stats = rt.stats()
        model.release()
    assert len(stats["tasks"]["tight"]["shards"]) == 1
    assert _diff(plain, weights) == 0.0
    assert stats["tasks"]["tight"]["kept_backwards"] > 0 and stats["devices"][0]["graphs_held"] > 0
    assert 0 < stats["devices"][0]["peak_bytes"] <= peak + 1


def test_a_graph_beyond_what_the_peak_reserves_needs_room_beside_it():
    home = _tiny_state("held").home
    device = CpuDevice("cpu:0", budget=home.state_bytes + 1000)
    cache = StateCache(device, 0, lambda: [])
    cache.begin(home, 900)  # its state moves in: 100 bytes are left beside the state and the peak
    assert cache.total() == home.state_bytes
    assert cache.room_for_graph(100) and not cache.room_for_graph(101)
    assert cache.room_for_graph(600, reserved=600) and cache.room_for_graph(600, reserved=500)
    assert not cache.room_for_graph(600, reserved=499)  # 101 bytes beyond the reserved part
    cache.end(home)
    cache.clear()


def test_a_forward_whose_backward_never_comes_holds_no_graph_past_the_next_forward_or_the_release():
    torch.manual_seed(0)
    m = _bn_mlp()
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        model, opt = ht.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1), runtime=rt, name="dropped-out")
        model(X[:16])                      # an evaluation without no_grad: its output is dropped
        one = _held(rt)[0]
        in_use = rt.stats()["devices"][0]["current_bytes"]
        model(X[16:32])                    # the next forward drops the first one's graph
        assert one > 0 and _held(rt)[0] == one
        assert rt.stats()["devices"][0]["current_bytes"] <= in_use  # the device holds one graph, not two
        model.release()
        # the task's host buffers are cleared once no thread advances it (Admitted.let_go): wait for that
        deadline = time.monotonic() + 10
        while (_held(rt) != [0] or rt.stats()["devices"][0]["current_bytes"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _held(rt) == [0] and rt.stats()["devices"][0]["current_bytes"] == 0
