"""hydra_tune.prepare keeps a prepared task's state where a ModelTask's would be (issue 14's residency): a task
whose state fits stays on its device and moves no state bytes after its first step; a spilled one takes the lazy
per-shard step. The user's own loop (clipping, optimizer.step(), zero_grad, reading the weights between steps)
stays bit-identical to the plain loop (fp32 on CPU: max abs diff 0.0)."""
from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_prepare_exactness import X, Y, _diff, _mlp

import hydra_tune as ht


def loop(prepare=None, ema: bool = False, set_to_none: bool = True):
    """A plain loop (shuffle, dropout, AdamW, clipping, warmup, eval) returning its weights and history;
    ``ema``: an EMA of the weights read right after each step, and a state_dict mid-training."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if prepare is not None:
        model, opt = prepare(model, opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=16, shuffle=True)
    history, avg = [], None
    for epoch in range(2):
        model.train()
        for x, y in loader:
            opt.zero_grad(set_to_none=set_to_none)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            sched.step()
            if ema:  # the optimizer's state, then the weights, of the step just taken
                history.append(sum(v.sum().item() for s in opt.state_dict()["state"].values() for v in s.values()))
                now = [p.detach().clone() for p in model.parameters()]
                avg = now if avg is None else [0.9 * a + 0.1 * n for a, n in zip(avg, now)]
            history.append(loss.item())
        if ema and epoch == 0:
            history.append(sum(v.sum().item() for v in model.state_dict().values()))
        model.eval()
        with torch.no_grad():
            history.append((model(X).argmax(-1) == Y).sum().item())
    if avg is not None:
        history.append([a.sum().item() for a in avg])
    return {k: v.clone() for k, v in model.state_dict().items()}, history, model


def _prepared(budget, devices=("cpu",), **kw):
    with ht.Runtime(devices=list(devices), device_memory=budget) as rt:
        got, history, model = loop(lambda m, o: ht.prepare(m, o, runtime=rt), **kw)
        stats = rt.stats()["tasks"][model.task.name]
    return got, history, stats


def test_prepared_task_that_fits_stays_resident_and_moves_no_state_after_its_first_step():
    want, want_history, _ = loop()
    got, history, stats = _prepared(None)
    res = stats["residency"]
    assert _diff(want, got) == 0.0 and history == want_history
    assert res["step_path"] == "resident", res
    assert (res["steps_on_device"], res["steps_on_host"]) == (8, 0), res
    assert res["state_bytes_after_first_step"] == 0 and res["entry_moves_in"] == [1], res


def test_spilled_sharded_prepared_task_steps_lazily_per_shard_bit_identical():
    want, want_history, _ = loop()
    got, history, stats = _prepared(30_000)  # 3 shards; the state does not fit whole: per-shard entries
    res = stats["residency"]
    assert len(stats["shards"]) > 1 and _diff(want, got) == 0.0 and history == want_history
    assert res["step_path"] == "lazy" and res["shard_steps_on_device"] > 0 and res["unsplit_steps"] == 0, res


def test_weights_read_between_steps_see_the_step_resident_and_lazy():
    """An EMA read right after each step, zero_grad(set_to_none=False), the model's state_dict mid-training,
    the optimizer's state_dict after each step."""
    want, want_history, _ = loop(ema=True, set_to_none=False)
    for budget in (None, 30_000):
        got, history, stats = _prepared(budget, ema=True, set_to_none=False)
        assert _diff(want, got) == 0.0 and history == want_history, budget
        assert stats["residency"]["step_path"] == ("resident" if budget is None else "lazy")


def test_two_prepared_trials_in_threads_evict_each_other_and_stay_resident_and_exact():
    """One device holds one task's state at a time: each step runs where its state is, moved back in after the
    other task evicted it (each trial thread with its own random stream: prepare/streams.py)."""
    import threading
    import types

    from hydra_tune.prepare.streams import trial_stream

    want, want_history, _ = loop()
    results: dict[int, tuple] = {}
    both_stepped = threading.Barrier(2, timeout=60)   # so the trials overlap, whatever the machine's load

    def prepare_and_meet(rt, m, o):
        model, opt = ht.prepare(m, o, runtime=rt)
        step, met = opt.step, []

        def first_step_then_meet(self, *args, **kwargs):
            out = step(*args, **kwargs)
            if not met:   # after its first step each task holds its state: the other's next step evicts it
                met.append(True)
                both_stepped.wait()
            return out
        opt.step = types.MethodType(first_step_then_meet, opt)  # a method: the LR scheduler wraps it
        return model, opt

    with ht.Runtime(devices=["cpu"], device_memory=90_000) as rt:
        def trial(i: int) -> None:
            with trial_stream():
                results[i] = loop(lambda m, o: prepare_and_meet(rt, m, o))

        threads = [threading.Thread(target=trial, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        stats = rt.stats()
    assert sorted(results) == [0, 1] and stats["devices"][0]["evictions"] > 0
    for got, history, model in results.values():
        res = stats["tasks"][model.task.name]["residency"]
        assert _diff(want, got) == 0.0 and history == want_history
        assert res["step_path"] == "resident" and res["steps_on_host"] == 0, res


def _held_loop(rt=None, hold_from: int = 2, drop_at: int = 5, steps: int = 8, held: str = "model"):
    """A loop that keeps ``sd = model.state_dict()`` from step ``hold_from`` to ``drop_at`` (torch's values alias
    the live weights: read at the drop, they are that step's) and saves a temporary state dict every step."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if rt is not None:
        model, opt = ht.prepare(model, opt, runtime=rt)
    sd, read, paths = None, None, []
    for s in range(steps):
        loss = F.cross_entropy(model(X[s * 8:(s + 1) * 8]), Y[s * 8:(s + 1) * 8])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rt is not None:  # where this step ran: the state moved in for its forward, or stayed in host memory
            paths.append(rt.stats()["tasks"][model.hydra_task.name]["residency"]["state_on"])
        torch.save(model.state_dict(), io.BytesIO())  # a temporary: nothing held past the call
        if s == hold_from:   # the model's: its weights; the optimizer's: its state tensors themselves
            sd = model.state_dict() if held == "model" else \
                {(i, k): v for i, st in opt.state_dict()["state"].items() for k, v in st.items() if k != "step"}
        if s == drop_at:
            read, sd = torch.cat([v.flatten() for v in sd.values()]).clone(), None
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    if rt is not None:
        model.release()
    return weights, read, paths


@pytest.mark.parametrize("held", ["model", "optimizer"])
def test_a_state_dict_the_loop_holds_reads_the_live_state_as_in_torch_and_keeps_the_state_on_the_host(held):
    # before: state_dict() wrote the state back, the next call moved it to the device again, and the dict the loop
    # held kept step 2's values (torch's reads the live weights or optimizer state): silently other results
    want, want_read, _ = _held_loop(held=held)
    with ht.Runtime(devices=["cpu"], device_memory="64MiB") as rt:
        with pytest.warns(RuntimeWarning, match="holds tensors of model.state_dict") as caught:
            got, read, where = _held_loop(rt, held=held)
    assert len([w for w in caught if "state_dict" in str(w.message)]) == 1   # once per model
    assert _diff(want, got) == 0.0 and torch.equal(read, want_read)
    # the temporary dicts alone keep nothing on the host; the held one does, until it is dropped
    assert where[:3] == ["cpu:0"] * 3 and where[3:6] == [None] * 3 and where[6:] == ["cpu:0"] * 2, where


def test_a_temporary_state_dict_moves_the_state_back_to_its_device_without_a_warning():
    with ht.Runtime(devices=["cpu"], device_memory="64MiB") as rt, warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _, _, where = _held_loop(rt, hold_from=-1, drop_at=-1)
    assert where == ["cpu:0"] * 8, where
