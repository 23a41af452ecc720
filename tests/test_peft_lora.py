"""PEFT/LoRA tasks: cut like their base model, trained bit-identical to the plain PEFT loop (``get_peft_model`` +
AdamW over the trainable parameters), their frozen base held once per runtime (training/shared_frozen.py)."""
from __future__ import annotations

import threading

import pytest
import torch
from reference import max_param_diff, plain_train, run_in_mode, trained

import hydra_tune as ht
from hydra_tune.training.state import TaskState

pytest.importorskip("peft", reason="PEFT support needs the `peft` extra (pip install hydra_tune[peft])")


def tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=2))


def lora_bert(r: int = 4, nudge: bool = False):
    """A LoRA model over one base: the base's init is seeded apart from the task's stream, so every trial gets
    the same base weights (as from one checkpoint); ``nudge``: one base value differs by one ulp."""
    def make():
        from peft import LoraConfig, get_peft_model

        state = torch.random.get_rng_state()
        torch.manual_seed(1234)
        base = tiny_bert()
        torch.random.set_rng_state(state)  # LoRA's own init and the new head draw from the task's stream
        if nudge:
            w = base.bert.encoder.layer[1].attention.self.key.weight
            with torch.no_grad():
                w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(float("inf")))
        return get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=["query", "value"],
                                               lora_dropout=0.1, modules_to_save=["classifier"]))
    return make


def batches(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 64, (4, 12), generator=g), "labels": torch.randint(0, 2, (4,), generator=g)}
            for _ in range(n)]


def adamw(m):
    return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)


def task(name: str, r: int = 4, data=None, nudge: bool = False, **kw) -> ht.ModelTask:
    return ht.ModelTask(lora_bert(r, nudge), kw.pop("optimizer", adamw), data if data is not None else batches(3),
                        epochs=kw.pop("epochs", 2), seed=kw.pop("seed", 0), name=name, **kw)


def frozen_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)


class Gated:
    """Batches whose second one waits for ``go``: the tasks stay running while the test looks at the pool."""

    def __init__(self, data: list, go: threading.Event) -> None:
        self.data, self.go = data, go

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self):
        for i, b in enumerate(self.data):
            if i == 1:
                self.go.wait(60)
            yield b


BUDGET = 400_000  # the tiny LoRA BERT (~124 KiB of weights, ~550 KiB at its largest unit) in 3+ shards


def test_lora_bert_sharded_matches_plain_peft_loop_and_frozen_get_no_grads():
    t = task("lora")
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=BUDGET) as rt:
        model = trained(rt.submit(t))
        stats = rt.stats()
    assert len(stats["tasks"]["lora"]["shards"]) >= 3, stats["tasks"]["lora"]["shards"]  # cut like its BERT
    ref = plain_train(t)[0]
    assert max_param_diff(ref, model) == 0.0
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for p in model.parameters() if not p.requires_grad)
    # no gradient traffic for frozen weights: what came back as state is at most the trainable gradients
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    d2h = sum(d["copies"]["d2h"].get("state", 0) for d in stats["devices"])
    assert d2h <= trainable * 6 * 2, (d2h, trainable)  # 6 minibatches; resident shards send none


@pytest.mark.parametrize("mode", ["keep", "offload"])
def test_lora_kept_and_offloaded_shards_with_a_pooled_base_match_plain_loop(mode):
    from hydra_tune.training.shared_frozen import SharedFrozen

    state = TaskState.build(task("spill"), budget=BUDGET)
    assert len(state.execs) >= 3
    state.share_frozen(SharedFrozen())
    run_in_mode(state, mode)
    assert max_param_diff(plain_train(state.task)[0], state.model) == 0.0


def test_three_lora_ranks_share_one_base_held_once():
    go = threading.Event()
    tasks = [task(f"r{r}", r=r, data=Gated(batches(2), go), seed=r, epochs=1) for r in (2, 4, 8)]
    base = distinct_bytes(lora_bert()())  # equal LayerNorm weights within the base are pooled once too
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=BUDGET, host_memory="1GB") as rt:
        handles = [rt.submit(t) for t in tasks]
        pool = rt.stats()["shared_frozen"]
        admitted = rt.host_memory()["admitted"]
        go.set()
        models = [trained(h) for h in handles]
        stats = rt.stats()
    assert pool["shared_bytes"] == base, (pool, base)   # one base for three trials
    assert pool["saved_bytes"] == 2 * base
    assert pool["per_task_shared_bytes"] == {"r2": base, "r4": base, "r8": base}
    # admission charges the base once, to the pool; each trial its own part
    assert admitted["(shared frozen weights)"] == base
    frozen = frozen_bytes(lora_bert()())  # each trial's frozen parameters, all in the pool
    assert [stats["tasks"][t.name]["host_footprint"]["shared"] for t in tasks] == [frozen] * 3
    for t, m in zip(tasks, models):
        assert max_param_diff(plain_train(t)[0], m) == 0.0, t.name
    sf = stats["shared_frozen"]  # no trial holds the base now: kept for a later one (retain_frozen), not held
    assert sf["tensors"] == sf["retained_tensors"] and not sf["per_task_shared_bytes"], sf
    # the user's models are independent: no two frozen parameters share a storage after the runtime let them go
    ptrs = [p.data_ptr() for m in models for p in m.parameters() if not p.requires_grad]
    assert len(ptrs) == len(set(ptrs))


def test_a_device_copies_the_shared_base_once_for_all_trials():
    go = threading.Event()  # both trials hold the base before either can end (a base no task holds is kept in
    # host memory, its device copies not: a trial that ended before the other shared it would make that copy twice)
    tasks = [task(f"t{r}", r=r, data=Gated(batches(3), go), epochs=2) for r in (2, 4)]
    base = distinct_bytes(lora_bert()())
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        handles = [rt.submit(t) for t in tasks]
        go.set()
        models = [trained(h) for h in handles]
        stats = rt.stats()
    # 2 trials x 6 minibatches: the base came in once (0 base bytes per minibatch after the first)
    assert stats["shared_frozen"]["copied_bytes"] == {"cpu:0": base}, stats["shared_frozen"]
    trainable = sum(p.numel() * p.element_size() for m in models for p in m.parameters() if p.requires_grad)
    assert stats["devices"][0]["copies"]["h2d"]["state"] <= base + 4 * trainable, stats["devices"][0]["copies"]
    for t, m in zip(tasks, models):
        assert max_param_diff(plain_train(t)[0], m) == 0.0, t.name


def test_bases_differing_in_one_value_are_not_merged():
    go = threading.Event()
    a, b = (task("a", data=Gated(batches(2), go), epochs=1),
            task("b", data=Gated(batches(2), go), nudge=True, epochs=1))
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        handles = [rt.submit(a), rt.submit(b)]
        pool = rt.stats()["shared_frozen"]
        go.set()
        models = [trained(h) for h in handles]
    n_frozen = sum(1 for p in models[0].parameters() if not p.requires_grad)
    key = models[0].base_model.model.bert.encoder.layer[1].attention.self.key.weight
    assert pool["tensors"] == n_frozen + 1 - _equal_frozen(models[0]), pool   # the nudged weight: its own entry
    assert pool["saved_bytes"] == distinct_bytes(models[0]) - key.numel() * key.element_size()
    for t, m in zip((a, b), models):
        assert max_param_diff(plain_train(t)[0], m) == 0.0, t.name


def distinct_bytes(model) -> int:
    """Bytes of the frozen parameters of ``model`` with distinct contents: what the pool holds for it."""
    from hydra_tune.training.shared_frozen import content_key

    return sum({content_key(p): p.numel() * p.element_size() for p in model.parameters()
                if not p.requires_grad}.values())


def test_tensors_differing_in_one_unsampled_byte_are_not_merged():
    """The pool finds candidates by a probe of sampled bytes; equal probes are then compared byte for byte."""
    from hydra_tune.training.shared_frozen import SharedFrozen, probe_key

    def frozen_linear(nudge: bool):
        torch.manual_seed(0)
        m = torch.nn.Linear(512, 512).requires_grad_(False)
        if nudge:  # one ulp in the middle: outside the probe's samples
            w = m.weight.view(-1)
            w[131_071] = torch.nextafter(w[131_071], torch.tensor(float("inf")))
        return m

    a, b, c = frozen_linear(False), frozen_linear(True), frozen_linear(False)
    assert probe_key(a.weight) == probe_key(b.weight)
    pool = SharedFrozen()
    for name, m in (("a", a), ("b", b), ("c", c)):
        pool.share(name, m)
    assert pool.stats()["tensors"] == 3            # a's weight (with c's), b's weight, the bias (all three)
    assert a.weight.data_ptr() == c.weight.data_ptr() != b.weight.data_ptr()
    assert a.bias.data_ptr() == b.bias.data_ptr() == c.bias.data_ptr()


def _equal_frozen(model) -> int:
    """Frozen parameters of one model whose bytes equal another's (LayerNorm ones and zeros): pooled once."""
    from hydra_tune.training.shared_frozen import content_key

    keys = [content_key(p) for p in model.parameters() if not p.requires_grad]
    return len(keys) - len(set(keys))


def test_a_failed_and_a_cancelled_trial_leave_the_shared_base_to_the_others():
    go = threading.Event()

    def failing_loss(out, batch):
        raise RuntimeError("boom in the loss")

    ok = task("ok", data=Gated(batches(3), go))
    bad = task("bad", data=Gated(batches(3), go), loss=failing_loss)
    gone = task("gone", data=Gated(batches(3), go), epochs=50)
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=BUDGET) as rt:
        try:
            h_bad = rt.submit(bad)
        except Exception:  # a loss failing on the sample batch may fail at build: then it never held the base
            h_bad = None
        h_ok, h_gone = rt.submit(ok), rt.submit(gone)
        h_gone.cancel()
        go.set()
        model = trained(h_ok)
        if h_bad is not None:
            with pytest.raises(Exception):
                h_bad.result()
        with pytest.raises(Exception):
            h_gone.result()
        pool = rt.stats()["shared_frozen"]
    assert max_param_diff(plain_train(ok)[0], model) == 0.0
    assert pool["tensors"] == pool["retained_tensors"] and not pool["per_task_shared_bytes"], pool  # kept, unheld


def test_a_write_into_a_shared_frozen_weight_fails_that_trial_only():
    class Writes(torch.optim.AdamW):
        def __init__(self, model):
            self.victim = model.base_model.model.bert.encoder.layer[0].attention.self.key.weight
            super().__init__([p for p in model.parameters() if p.requires_grad], lr=1e-2)

        def step(self, closure=None):
            out = super().step(closure)
            with torch.no_grad():
                self.victim.mul_(2.0)
            return out

    go = threading.Event()
    good, writer = task("good", data=Gated(batches(3), go)), task("writer", data=Gated(batches(3), go),
                                                                   optimizer=Writes)
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        h_good, h_writer = rt.submit(good), rt.submit(writer)
        go.set()
        with pytest.raises(ValueError, match="changes no frozen parameter it shares") as err:
            h_writer.result()
        model = trained(h_good)
    assert "attention.self.key.weight" in str(err.value)
    assert max_param_diff(plain_train(good)[0], model) == 0.0


def test_lora_plans_fewer_shards_than_full_fine_tuning_of_the_same_base():
    """Weights dominate (short sequences): a full fine-tune's units hold gradients, a LoRA model's do not, so
    its shards hold more layers within the same budget (the planner tries runs of stages as prefetch reserves)."""
    from peft import LoraConfig, get_peft_model
    from transformers import BertConfig, BertForSequenceClassification

    def wide():
        torch.manual_seed(1234)
        return BertForSequenceClassification(BertConfig(
            vocab_size=64, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, intermediate_size=256,
            max_position_embeddings=16, num_labels=2))

    def lora():
        return get_peft_model(wide(), LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"]))

    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 64, (2, 6), generator=g), "labels": torch.randint(0, 2, (2,), generator=g)}]
    plans = [TaskState.build(ht.ModelTask(make, adamw, data, epochs=1, seed=0, name=name), budget=1_000_000,
                             keep=False).plan for make, name in ((lora, "lora"), (wide, "full"))]
    assert len(plans[0].shards) < len(plans[1].shards), [[s.names for s in p.shards] for p in plans]
    assert all(p.peak <= 1_000_000 for p in plans)


def test_share_frozen_false_keeps_each_trial_its_own_base_and_bad_values_are_refused():
    with pytest.raises(ValueError, match="`share_frozen` is True or False"):
        ht.RuntimeConfig(share_frozen="yes")
    with ht.Runtime(config=ht.RuntimeConfig(devices=["cpu"], share_frozen=False)) as rt:
        model = trained(rt.submit(task("own", epochs=1)))
        assert rt.stats()["shared_frozen"]["tensors"] == 0
    assert max_param_diff(plain_train(task("own", epochs=1))[0], model) == 0.0


def two_equal_frozen_linears() -> tuple:
    """A SharedFrozen pool holding two equal frozen Linear(8, 8) of tasks "a" and "b": (pool, a, b, shares)."""
    from hydra_tune.training.shared_frozen import SharedFrozen

    def frozen():
        torch.manual_seed(0)
        return torch.nn.Linear(8, 8).requires_grad_(False)

    a, b = frozen(), frozen()
    pool = SharedFrozen()
    return pool, a, b, {name: pool.share(name, m) for name, m in (("a", a), ("b", b))}


def test_a_write_with_no_clean_device_copy_left_fails_every_holder_naming_the_writer():
    pool, a, b, shares = two_equal_frozen_linears()
    with torch.no_grad():
        b.weight.add_(1.0)   # b writes into the pooled weight; no device ever copied it
    with pytest.raises(ValueError, match="changes no frozen parameter") as own:
        shares["b"].check()
    assert "weight" in str(own.value)
    with pytest.raises(ValueError, match="another task wrote into") as other:
        shares["a"].check()
    assert "b: weight" in str(other.value)
