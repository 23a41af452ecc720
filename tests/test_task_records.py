"""The records a task keeps for its whole life, kept small without changing what they say (issue 18: a LoRA
trial's own bytes are its Python objects): the as-built Python state of its model (training/pystate.py), the
shared name strings (training/names.py) and the CPU stand-ins' storage accounting (device/dispatch.py)."""
from __future__ import annotations

import torch
import torch.nn as nn

from hydra_tune.device.dispatch import MemoryAccount
from hydra_tune.training import names
from hydra_tune.training.pystate import ModuleState


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Linear(2, 1)))


def test_hooks_registered_and_removed_since_the_snapshot_are_both_reported():
    """The snapshot keeps hook counts only where there were hooks; a hook removed since (count 1 -> 0) and one
    registered where there was none (0 -> 1) are both seen, in the model's module order."""
    model = _model()
    handle = model[1][1].register_forward_hook(lambda m, i, o: None)
    built = ModuleState.of_model(model)
    assert built.hooks_changed() == []
    handle.remove()
    model[0].register_forward_pre_hook(lambda m, i: None)
    assert built.hooks_changed() == [("0", "_forward_pre_hooks", 0, 1), ("1.1", "_forward_hooks", 1, 0)]


def test_the_snapshot_tells_scalars_rebound_and_containers_changed_in_place_apart():
    """Scalars keep no contents record; a rebound scalar and a list grown in place are still reported, and
    ``restore`` puts both back."""
    model = _model()
    model[0].calls, model[0].seen = 0, [1]
    before = ModuleState.take([model[0]])
    model[0].calls += 1
    model[0].seen.append(2)
    assert before.changed_names() == ["Linear.calls", "Linear.seen"]
    seen = model[0].seen
    before.restore()
    assert model[0].calls == 0 and model[0].seen == [1] and model[0].seen is seen
    assert not before.changed()


def test_a_kept_snapshot_shares_equal_contents_and_still_tells_each_place_changed_in_place():
    """The as-built snapshot keeps one copy of equal contents (the same items, by identity: a PEFT LoRA layer's
    ``{"default": r}``, a dozen layers alike); a change in place of one module's container is its own change
    only, and dicts with equal but not identical values are not merged (a dict's values are compared by
    identity)."""
    model = _model()
    for m in model[1]:
        m.r, m.seen, m.empty = {"default": 8}, [1, 2], {}
    model[0].r = {"default": 8.5}
    model[1][1].scaling, model[0].scaling = {"default": float("2.0")}, {"default": float("2.0")}
    built = ModuleState.of_model(model)
    kept = {h.module: contents for h, _, contents in built.entries()}
    assert kept["1.0"]["r"] is kept["1.1"]["r"] and kept["1.0"]["seen"] is kept["1.1"]["seen"]
    assert kept["1.0"]["empty"] is kept["1.1"]["empty"]
    assert kept["0"]["scaling"] is not kept["1.1"]["scaling"] and kept["0"]["r"] is not kept["1.0"]["r"]
    assert built.changes() == []
    model[1][1].r["default"] = 4
    model[1][0].seen.append(3)
    assert [(c.module, c.key, c.how) for c in built.changes()] == [("1.0", "seen", "contents"),
                                                                    ("1.1", "r", "contents")]
    assert model[1][0].r == {"default": 8} and kept["1.0"]["r"] == {"default": 8}


def test_two_builds_of_one_model_share_their_module_path_strings():
    a, b = ModuleState.of_model(_model()), ModuleState.of_model(_model())
    labels_a = [h.module for h, _, _ in a.entries()]
    labels_b = [h.module for h, _, _ in b.entries()]
    assert labels_a == labels_b == ["(root)", "0", "1", "1.0", "1.1"]
    assert all(x is y for x, y in zip(labels_a, labels_b))


def test_shared_name_returns_an_equal_string_and_its_table_stays_bounded(monkeypatch):
    monkeypatch.setattr(names, "_NAMES", {})
    monkeypatch.setattr(names, "MAX_NAMES", 3)
    first = "".join(["layer.", "0.weight"])
    again = "".join(["layer.", "0.weight"])
    assert first is not again
    assert names.shared_name(first) is first
    assert names.shared_name(again) is first
    for i in range(10):
        assert names.shared_name(f"n{i}") == f"n{i}"
        assert len(names._NAMES) <= 3


def test_two_builds_bind_their_parameters_through_shared_name_tuples_and_one_id_object_per_tensor():
    """A shard's binding of each parameter slot holds its names as one tuple object for every build of the
    architecture, and the shard's records hold one int object per tensor's id (not one per id() call)."""
    from hydra_tune.stages import Stage
    from hydra_tune.training.shard import ShardExec

    def shard() -> ShardExec:
        model = _model()
        model[1][1].weight.requires_grad_(False)
        return ShardExec(0, [Stage("a", model[0]), Stage("b", model[1])])

    a, b = shard(), shard()
    slots_a = [slot for bound in a._bound for slot in bound._slots]
    slots_b = [slot for bound in b._bound for slot in bound._slots]
    assert [s[4] for s in slots_a] == [("weight",), ("bias",), ("1.weight",), ("1.bias",)]
    assert all(x[4] is y[4] for x, y in zip(slots_a, slots_b))
    tensor_keys = {id(k): k for k in a.tensors}
    assert all(tensor_keys[id(key)] is key for bound in a._bound for _, key in bound.binding)
    assert all(any(k is f for f in a.tensors) for k in a.frozen) and len(a.frozen) == 1


def test_the_account_forgets_a_freed_storage_and_not_a_later_one_at_its_key():
    """A storage's weak reference carries its key and bytes: freed, it leaves the account; a forgotten one
    (resize_) is not subtracted twice when it is freed later."""
    account = MemoryAccount()
    kept = torch.zeros(10)
    account.track(kept.untyped_storage())
    gone = torch.zeros(100)
    account.track_many([gone.untyped_storage()])
    assert account.current == 440
    del gone
    assert account.current == 40 and len(account._live) == 1
    account.forget(kept.untyped_storage())
    assert account.current == 0
    del kept
    assert account.current == 0 and account._live == {}
