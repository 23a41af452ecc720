"""A spilled prepared model steps lazily per shard (each shard's update applied just before its next use): what the
user's loop reads or writes between ``optimizer.step()`` and the next forward, through any reference it holds, is
what the plain loop would read (fp32 on CPU, bit for bit), or the read raises naming the call.

Each test runs one loop function without ``prepare`` and with it on a runtime whose budget spills the MLP's state
(3 shards, per-shard entries: ``step_path == "lazy"``), and compares the weights and what the loop recorded.
"""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from test_prepare_exactness import X, Y, _diff, _mlp

import hydra_tune as ht

SPILLED = 30_000  # device bytes: the MLP in 3 shards, its state as per-shard entries (lazy per-shard step)


def loop(prepare=None, between=None, zero=lambda opt: opt.zero_grad(), steps: int = 4):
    """Shuffle, dropout, AdamW; ``between(model, opt, kept, history)`` runs right after each ``optimizer.step()``
    (``kept``: ``list(model.parameters())`` taken before prepare); ``zero(opt)`` zeroes the gradients after it."""
    torch.manual_seed(0)
    model = _mlp()
    kept = list(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    if prepare is not None:
        model, opt = prepare(model, opt)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=16, shuffle=True)
    history: list = []
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if between is not None:
            between(model, opt, kept, history)
        zero(opt)
        history.append(loss.item())
        if len(history) >= steps * 8:
            break
    return {k: v.clone() for k, v in model.state_dict().items()}, history, model


def both(**kw):
    want, want_history, _ = loop(**kw)
    with ht.Runtime(devices=["cpu"], device_memory=SPILLED) as rt:
        got, history, model = loop(lambda m, o: ht.prepare(m, o, runtime=rt), **kw)
        res = rt.stats()["tasks"][model.task.name]["residency"]
    assert res["step_path"] == "lazy", res
    return want, want_history, got, history, res


def _grads(params):
    return [None if p.grad is None else p.grad.sum().item() for p in params]


def test_zero_grad_sets_grads_to_none_through_a_parameter_list_kept_from_before_prepare():
    def between(model, opt, kept, history):
        opt.zero_grad()
        history.append(_grads(kept))  # plain: all None

    want, want_history, got, history, _ = both(between=between)
    assert _diff(want, got) == 0.0 and history == want_history
    assert all(g is None for g in history[0]), history[0]


def test_a_loop_that_reads_nothing_between_steps_keeps_every_update_lazy():
    """step, zero_grad, forward: no read applies an update early; each is applied on the device before its use."""
    want, want_history, got, history, res = both()
    assert _diff(want, got) == 0.0 and history == want_history
    assert res["lazy_pending_reads"] == 0 and res["shard_steps_on_device"] > 0, res


def test_model_zero_grad_keeps_every_update_lazy_and_exact():
    """model.zero_grad() (as Hugging Face's Trainer calls it) between step() and the next forward."""
    models = []

    def between(model, opt, kept, history):
        models[:] = [model]  # the loop's own model (plain, then prepared)

    def zero(opt):
        models[0].zero_grad()

    want, want_history, got, history, res = both(between=between, zero=zero)
    assert _diff(want, got) == 0.0 and history == want_history
    assert res["lazy_pending_reads"] == 0 and res["shard_steps_on_device"] > 0, res


def test_gradients_read_between_step_and_zero_grad_are_the_steps_gradients():
    """model.parameters() and optimizer.param_groups after step(): the gradients the step used (not None)."""
    def between(model, opt, kept, history):
        history.append(_grads(model.parameters()))
        history.append(_grads(p for g in opt.param_groups for p in g["params"]))

    want, want_history, got, history, _ = both(between=between)
    assert _diff(want, got) == 0.0 and history == want_history
    assert all(g is not None for g in history[0]), history[0]


def test_zero_grad_set_to_none_false_leaves_zero_gradients():
    def between(model, opt, kept, history):
        opt.zero_grad(set_to_none=False)
        history.append(_grads(kept))  # plain: zeros, not None

    want, want_history, got, history, _ = both(between=between, zero=lambda opt: None)
    assert _diff(want, got) == 0.0 and history == want_history
    assert history[0] == [0.0] * len(history[0]), history[0]


def test_gradients_never_zeroed_accumulate_across_steps_as_in_the_plain_loop():
    want, want_history, got, history, _ = both(zero=lambda opt: None)
    assert _diff(want, got) == 0.0 and history == want_history


def test_weights_read_through_param_groups_and_a_kept_list_are_the_updated_ones():
    def between(model, opt, kept, history):
        history.append([p.sum().item() for g in opt.param_groups for p in g["params"]])
        history.append([p.detach().clone().sum().item() for p in kept])

    want, want_history, got, history, res = both(between=between)
    assert _diff(want, got) == 0.0 and history == want_history
    assert res["lazy_pending_reads"] > 0, res


def test_weights_written_through_param_groups_after_the_step_land_on_the_updated_weights():
    """A hand-written decoupled weight decay after step(): the plain loop shrinks the updated weights."""
    def between(model, opt, kept, history):
        with torch.no_grad():
            for g in opt.param_groups:
                for p in g["params"]:
                    p.mul_(1 - 1e-2)

    want, want_history, got, history, _ = both(between=between)
    assert _diff(want, got) == 0.0 and history == want_history


def test_a_submodule_weight_and_the_optimizer_state_read_after_the_step_are_current():
    def between(model, opt, kept, history):
        history.append(getattr(model, "0").weight.sum().item())  # model[0] in the plain loop
        history.append([s["exp_avg"].sum().item() for s in opt.state.values()])
        history.append(sum(len(s) for s in opt.state.values()))

    want, want_history, got, history, _ = both(between=between)
    assert _diff(want, got) == 0.0 and history == want_history


def test_reading_a_pending_weight_from_another_thread_raises():
    """Only the loop's own thread brings a pending update up to date: another thread's read is refused."""
    errors: list = []

    def between(model, opt, kept, history):
        if history:
            return

        def read():
            try:
                kept[0].sum()
            except RuntimeError as e:
                errors.append(e)
        t = threading.Thread(target=read)
        t.start()
        t.join()

    with ht.Runtime(devices=["cpu"], device_memory=SPILLED) as rt:
        loop(lambda m, o: ht.prepare(m, o, runtime=rt), between=between, steps=1)
    assert len(errors) == 1 and "another thread" in str(errors[0]), errors


@pytest.mark.parametrize("opt_name", ["SGD", "Adam"])
def test_first_step_zero_grad_then_eval_matches(opt_name):
    """The first step creates the optimizer state: zero_grad before it is applied, then an evaluation."""
    def between(model, opt, kept, history):
        opt.zero_grad()
        model.eval()
        with torch.no_grad():
            history.append(model(X[:16]).sum().item())
        model.train()

    def run(prepare=None):
        torch.manual_seed(0)
        model = _mlp()
        cls = getattr(torch.optim, opt_name)
        opt = cls(model.parameters(), lr=1e-2, **({"momentum": 0.9} if opt_name == "SGD" else {}))
        if prepare is not None:
            model, opt = prepare(model, opt)
        history: list = []
        for _ in range(4):
            F.cross_entropy(model(X[:16]), Y[:16]).backward()
            opt.step()
            between(model, opt, None, history)
        history.append([list(s) for s in opt.state_dict()["state"].values()])
        return {k: v.clone() for k, v in model.state_dict().items()}, history

    want, want_history = run()
    with ht.Runtime(devices=["cpu"], device_memory=SPILLED) as rt:
        got, history = run(lambda m, o: ht.prepare(m, o, runtime=rt, name="first"))
        assert rt.stats()["tasks"]["first"]["residency"]["step_path"] == "lazy"
    assert _diff(want, got) == 0.0 and history == want_history


def test_gpt2_tied_weights_read_through_the_lists_its_optimizer_was_built_from():
    """GPT-2 (tied embeddings, dropout, labels=) in shards, AdamW over two lists kept from before prepare: after
    each step the loop reads weights through them, zeroes, and reads a gradient (None)."""
    from conftest import lm_batches, make_gpt2

    def run(prepare=None):
        torch.manual_seed(0)
        model = make_gpt2()
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest}], lr=3e-3)
        if prepare is not None:
            model, opt = prepare(model, opt)
        history: list = []
        for batch in lm_batches(4):
            out = model(**batch)
            out.loss.backward()
            opt.step()
            history.append([p.sum().item() for p in decay[:2] + decay[-1:]])  # wte (tied with lm_head) first
            opt.zero_grad()
            history.append([p.grad is None for p in rest[:2]] + [out.loss.item()])
        return {k: v.clone() for k, v in model.state_dict().items()}, history

    want, want_history = run()
    with ht.Runtime(devices=["cpu"], device_memory=1_600_000) as rt:  # 2 shards, per-shard entries
        got, history = run(lambda m, o: ht.prepare(m, o, runtime=rt, name="gpt2"))
        res = rt.stats()["tasks"]["gpt2"]["residency"]
    assert _diff(want, got) == 0.0 and history == want_history
    assert res["step_path"] == "lazy" and res["lazy_pending_reads"] > 0, res
