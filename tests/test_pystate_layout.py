"""A unit's Python-state snapshot through a reused Layout (training/pystate_layout.py) equals a fresh
``ModuleState.take``, whatever changed since the last one: same places, values and contents, same changes found."""
from __future__ import annotations

import collections

import torch
import torch.nn as nn

from hydra_tune.training.pystate import ModuleState
from hydra_tune.training.pystate_layout import Snapshots


class Schedule:
    def __init__(self, step: int = 0) -> None:
        self.step = step


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0
        self.seen: list[int] = []
        self.schedule = Schedule()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _view(state: ModuleState, labels: bool = True) -> list[tuple]:
    """A snapshot as comparable data: each place (name, module, prefix, the mapping's identity: a closure cell's
    own for a cell), its values by identity and its contents; ``labels=False``: without the module's label (a
    layout that shares a kept snapshot's holders has that snapshot's paths there, read only by ``changes``)."""
    return [(h.name, h.module if labels else None, h.prefix, id(getattr(h.mapping, "cell", h.mapping)),
             {k: id(v) for k, v in values.items()}, contents) for h, values, contents in state.entries()]


def _mutations(model: nn.Sequential):
    """Each step changes what a snapshot must see (a rebound plain object, hooks with closure state, ...)."""
    block = model[0]
    yield lambda: None
    yield lambda: setattr(block, "calls", block.calls + 1)
    yield lambda: block.seen.append(1)                             # contents only
    yield lambda: setattr(block, "schedule", Schedule(5))          # a new plain object: a new place
    yield lambda: setattr(block.schedule, "step", 7)
    yield lambda: setattr(block, "extra", {"a": 1})                # an added attribute
    yield lambda: delattr(block, "extra")
    yield lambda: setattr(block.schedule, "__dict__", {"step": 9})  # the owner's dict replaced
    counter = [0]

    def hook(module, args, out):
        counter[0] += 1
    handle: list = []
    yield lambda: handle.append(block.register_forward_hook(hook))  # a hook with closure state: a cell
    yield lambda: counter.__setitem__(0, 3)
    yield lambda: handle.pop().remove()
    yield lambda: model.eval()
    yield lambda: setattr(model[1], "memo", collections.deque([1, 2]))
    for _ in range(3):  # a fresh object each time: the old one freed (its address free for the new one)
        yield lambda: setattr(block, "schedule", Schedule(block.schedule.step + 1))


def test_a_reused_layout_takes_what_a_fresh_snapshot_takes_after_every_kind_of_change():
    model = nn.Sequential(Block(), nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    modules = list(model.modules())
    snaps = Snapshots(modules)
    for change in _mutations(model):
        change()
        fresh, reused = ModuleState.take(modules), snaps.take()
        assert _view(reused) == _view(fresh), change
        assert not reused.changed() and not fresh.changed()
        model[0].calls += 1  # a change after the snapshot: both see it, and both put it back
        assert reused.changed() and reused.changed_names() == fresh.changed_names() == ["Block.calls"]
        reused.restore()
        assert not fresh.changed()


def test_changes_after_a_reused_snapshot_are_found_and_put_back():
    model = nn.Sequential(Block())
    modules = list(model.modules())
    snaps = Snapshots(modules)
    snaps.take()
    before = snaps.take()  # the reused layout's snapshot
    block = model[0]
    old_schedule = block.schedule
    block.schedule = Schedule(3)
    old_schedule.step = 11  # the old object changed too: it is what is put back, with its attributes as taken
    block.seen.append(4)
    block.new_attribute = 1
    assert before.changed_names() == ["Block.new_attribute", "Block.schedule", "Block.schedule.step", "Block.seen"]
    before.restore()
    assert block.schedule is old_schedule and old_schedule.step == 0 and block.seen == []
    assert not hasattr(block, "new_attribute")


def test_a_layout_shares_the_values_of_a_kept_snapshot_where_they_are_unchanged():
    """A shard's layout reuses the task's as-built snapshot's values and holders (kept for checkpoints) for the
    places still bound the same: no second copy of them; a place changed since gets its own values, and snapshots
    stay exact."""
    model = nn.Sequential(Block(), nn.Linear(4, 4))
    known = ModuleState.of_model(model)
    model[0].calls = 5  # changed since the as-built snapshot
    modules = list(model.modules())
    snaps = Snapshots(modules, known)
    reused = snaps.take()
    places = known.places().values()
    shared, holders = {id(v) for _, v in places}, {id(h) for h, _ in places}
    by_name = {h.name: values for h, values, _ in reused.entries()}
    assert id(by_name["Block.schedule"]) in shared and id(by_name["Linear"]) in shared
    assert id(by_name["Block"]) not in shared and by_name["Block"]["calls"] == 5
    assert all(id(h) in holders for h, _, _ in reused.entries())  # (a layout's own holders: ~100 bytes a place)
    assert _view(reused, labels=False) == _view(ModuleState.take(modules), labels=False)


def test_places_that_change_at_every_unit_get_plain_snapshots_for_a_while_and_stay_exact():
    """A forward that rebinds an attribute every time makes every layout out of date at the next take: after two
    such takes in a row the shard takes plain snapshots (RETRY_AFTER of them) before it tries a layout again."""
    from hydra_tune.training import pystate_layout

    model = nn.Sequential(Block())
    modules = list(model.modules())
    snaps = Snapshots(modules)
    held = []
    for _ in range(pystate_layout.RETRY_AFTER + 4):
        model[0].calls += 1  # what the last unit's forward did
        assert _view(snaps.take()) == _view(ModuleState.take(modules))
        held.append(snaps.holds_layout())
    after = 2 + pystate_layout.RETRY_AFTER  # the take that tries a layout again
    assert held[:2] == [True, True] and not any(held[2:after]) and held[after]
    for _ in range(3):  # nothing changes any more: the layout holds
        assert _view(snaps.take()) == _view(ModuleState.take(modules)) and snaps.holds_layout()
