"""How long the pool of shared frozen weights holds what (training/shared_frozen.py): an ended trial's model gets
its private copies only when its user asks for it (``handle.model()``)."""
from __future__ import annotations

import threading

import pytest
from reference import max_param_diff, plain_train, trained
from test_peft_lora import Gated, batches, distinct_bytes, frozen_bytes, lora_bert, task

import hydra_tune as ht

pytest.importorskip("peft", reason="PEFT support needs the `peft` extra (pip install hydra_tune[peft])")


def _storages(model) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters() if not p.requires_grad}


def test_an_ended_trials_model_copies_the_shared_base_only_when_asked_for():
    """Before: every ended trial's model got a private copy of the base at its end, asked for or not (the
    benchmark's peak: one base per ended trial whose handle lived). Now: none until ``handle.model()``; then its
    frozen weights are its own (a write into them reaches no other trial) and it matches the plain loop."""
    go = threading.Event()
    first, second = task("first", epochs=1), task("second", r=8, data=Gated(batches(2), go), epochs=1)
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        h_first, h_second = rt.submit(first), rt.submit(second)
        h_first.result()
        assert rt.stats()["shared_frozen"]["private_copy_bytes"] == 0   # ended, nobody asked: nothing copied
        model = h_first.model()
        copied = rt.stats()["shared_frozen"]["private_copy_bytes"]
        assert 0 < copied <= frozen_bytes(model)
        assert h_first.model() is model and rt.stats()["shared_frozen"]["private_copy_bytes"] == copied  # once
        pooled = {e.tensor.untyped_storage().data_ptr() for e in rt.shared._entries.values()}
        assert not _storages(model) & pooled   # its own now
        for p in model.parameters():
            if not p.requires_grad:
                p.data.add_(1.0)   # what merge_and_unload() does to the base: reaches no other trial
        go.set()
        h_second.result()
        second_model = h_second.model()
    assert max_param_diff(plain_train(second)[0], second_model) == 0.0


def _ends_with_private_copies(mine: ht.ModelTask, held) -> None:
    """``mine`` ends while another trial of its base still trains: ``held`` (the model its user holds) has its
    own frozen weights at once, and a write into them reaches the other trial not at all."""
    go = threading.Event()
    other = task("other", data=Gated(batches(2), go), epochs=1)
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        h_mine, h_other = rt.submit(mine), rt.submit(other)
        h_mine.result()
        assert rt.stats()["shared_frozen"]["private_copy_bytes"] > 0
        pooled = {e.tensor.untyped_storage().data_ptr() for e in rt.shared._entries.values()}
        assert not _storages(held) & pooled
        for p in held.parameters():
            if not p.requires_grad:
                p.data.add_(1.0)   # the user's own write into their model (merge_and_unload() does one)
        go.set()
        other_model = trained(h_other)
    assert max_param_diff(plain_train(other)[0], other_model) == 0.0


def test_a_model_passed_in_gets_its_private_copies_at_the_end():
    """The user holds a model they passed in: it cannot wait for ``handle.model()``."""
    mine = task("mine", epochs=1)
    mine = ht.ModelTask(mine.model(), mine.optimizer, mine.train_data, epochs=1, seed=0, name="mine")
    _ends_with_private_copies(mine, mine.model)


def test_a_factory_returning_a_model_its_user_holds_gets_its_private_copies_at_the_end():
    """`lambda: model` over a model the user keeps: they can reach it (say, `merge_and_unload()` after the trial)
    before any `handle.model()`, so it must not keep the pool's tensors other trials still train over."""
    held = task("held", epochs=1).model()
    _ends_with_private_copies(ht.ModelTask(lambda: held, task("held").optimizer, batches(2), epochs=1, seed=0,
                                           name="held"), held)


def test_trials_run_one_after_another_share_the_base_kept_after_the_first():
    """A sequential search (Optuna n_jobs=1): before, the pool forgot the base with the first trial, and the next
    one pooled its own copy anew. Now the base stays (``retain_frozen``, charged to admission) and the second
    trial's frozen weights are the very storages the first one trained over."""
    base = distinct_bytes(lora_bert()())
    go = threading.Event()
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        first = rt.submit(task("first", epochs=1))
        first.result()
        pool = rt.stats()["shared_frozen"]
        assert pool["retained_bytes"] >= base and pool["shared_bytes"] == pool["retained_bytes"], pool
        assert rt.host_memory()["admitted"]["(shared frozen weights)"] == pool["retained_bytes"]  # charged
        kept = {e.tensor.untyped_storage().data_ptr() for e in rt.shared._entries.values()}
        second = task("second", r=8, data=Gated(batches(2), go), epochs=1)
        h_second = rt.submit(second)
        mine = rt.shared._tasks["second"].storages()
        assert mine <= kept and rt.stats()["shared_frozen"]["retained_hit_bytes"] >= base
        go.set()
        model = trained(h_second)
    assert max_param_diff(plain_train(second)[0], model) == 0.0


def test_a_retained_base_is_dropped_when_a_task_needs_its_room():
    """Retained bytes are charged to host-memory admission: a task that does not fit beside them gets the room
    (the least recently used go first) and is admitted at once instead of waiting."""
    probe = task("probe", epochs=1)
    with ht.Runtime(devices=["cpu"], device_memory=None, host_memory="1GB") as rt:
        need = rt.footprint(probe).total
    budget = need + (16 << 10)  # one task fits; the first trial's retained base (~124 KiB) and a second do not
    with ht.Runtime(devices=["cpu"], device_memory=None, host_memory=budget) as rt:
        rt.submit(task("first", epochs=1)).result()
        assert rt.stats()["shared_frozen"]["retained_bytes"] > 16 << 10
        other = task("other", nudge=True, epochs=1)   # a base one value apart
        h_other = rt.submit(other)
        assert "other" in rt.host_memory()["admitted"], rt.host_memory()   # admitted, not waiting
        pool = rt.stats()["shared_frozen"]
        assert pool["evicted_bytes"] > 0, pool
        model = trained(h_other)
    assert max_param_diff(plain_train(other)[0], model) == 0.0
