"""A prepared loop's light path (training/direct.py): the forward of a resident one-shard task keeps its graph over
the model's own parameters and the backward call adds into their ``.grad``; where a backward finds gradients there
already (accumulation over minibatches) it recomputes on the general path instead. Both bit-identical to the plain
loop (fp32 on CPU)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_prepare_exactness import X, Y, _diff, _mlp, mlp_loop

import hydra_tune as ht


def _prepared(accumulate: int, budget=None):
    with ht.Runtime(devices=["cpu"], device_memory=budget) as rt:
        got, history, model = mlp_loop(lambda m, o: ht.prepare(m, o, runtime=rt), accumulate=accumulate)
        stats = rt.stats()["tasks"][model.task.name]
    return got, history, stats


def test_resident_prepared_forwards_and_backwards_take_the_light_path_bit_identical():
    want, want_history, _ = mlp_loop()
    got, history, stats = _prepared(1)
    assert len(stats["shards"]) == 1 and stats["residency"]["step_path"] == "resident", stats["residency"]
    assert _diff(want, got) == 0.0 and history == want_history
    # 8 training forwards, 8 backwards, 2 evaluations: all light but the first forward and the first evaluation,
    # which the device measures op by op (the general path), and that forward's backward
    assert stats["light_units"] == 8 + 8 + 2 - 3, stats["light_units"]


def test_a_backward_onto_accumulated_gradients_recomputes_on_the_general_path_bit_identical():
    want, want_history, _ = mlp_loop(accumulate=2)
    got, history, stats = _prepared(2)
    assert _diff(want, got) == 0.0 and history == want_history
    _, _, alone = _prepared(1)
    # the second minibatch of each of the 4 steps finds the first one's gradients: its B is no light unit
    assert alone["light_units"] - stats["light_units"] == 4, (alone["light_units"], stats["light_units"])


def test_gradients_zeroed_before_the_forward_or_after_it_are_both_light_and_exact():
    """The plain loop's two common orders: zero_grad; forward; backward / forward; zero_grad; backward."""
    def run(prepare, early: bool):
        torch.manual_seed(0)
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if prepare is not None:
            model, opt = prepare(model, opt)
        for _ in range(6):
            if early:
                opt.zero_grad()
            loss = F.cross_entropy(model(X), Y)
            if not early:
                opt.zero_grad()
            loss.backward()
            opt.step()
        return {k: v.clone() for k, v in model.state_dict().items()}, model

    for early in (True, False):
        want, _ = run(None, early)
        with ht.Runtime(devices=["cpu"]) as rt:
            got, model = run(lambda m, o: ht.prepare(m, o, runtime=rt), early)
            light = rt.stats()["tasks"][model.task.name]["light_units"]
        assert _diff(want, got) == 0.0, early
        assert light >= 2 * 6 - 2, (early, light)


@pytest.mark.parametrize("budget", ["24KiB"])
def test_a_sharded_prepared_task_takes_no_light_path(budget):
    want, want_history, _ = mlp_loop()
    got, history, stats = _prepared(1, budget)
    assert len(stats["shards"]) > 1 and stats["light_units"] == 0
    assert _diff(want, got) == 0.0 and history == want_history


def test_gpt2_with_tied_weights_dropout_and_its_own_loss_takes_the_light_path_bit_identical():
    """transformers' GPT-2 (tied embeddings, dropout 0.1, the loss from ``labels=``), AdamW, clipping, an eval loss."""
    from conftest import lm_batches, make_gpt2

    def loop(prepare=None):
        torch.manual_seed(0)
        model = make_gpt2()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        if prepare is not None:
            model, opt = prepare(model, opt)
        losses = []
        for b in lm_batches(6):
            opt.zero_grad()
            out = model(**b)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(out.loss.item())
        model.eval()
        with torch.no_grad():
            losses.append(model(**lm_batches(1, seed=5)[0]).loss.item())
        return {k: v.clone() for k, v in model.state_dict().items()}, losses, model

    want, want_losses, _ = loop()
    with ht.Runtime(devices=["cpu"]) as rt:
        got, losses, model = loop(lambda m, o: ht.prepare(m, o, runtime=rt))
        stats = rt.stats()["tasks"][model.task.name]
    assert len(stats["shards"]) == 1 and stats["light_units"] == 6 + 6 + 1 - 3, stats["light_units"]
    assert _diff(want, got) == 0.0 and losses == want_losses
