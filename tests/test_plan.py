"""The memory model and partitioner over plain numbers: exact expected shards and peaks."""
from __future__ import annotations

import pytest

from hydra_tune.errors import PlanError
from hydra_tune.plan import StageCost, partition, shard_of


def _stage(name: str, key: int, nbytes: int = 100, act: int = 10) -> StageCost:
    return StageCost(name, params=((key, nbytes, True),), input_bytes=act, output_bytes=act, fwd_peak=act,
                     saved_bytes=2 * act, grad_fwd_peak=2 * act, bwd_peak=nbytes + 2 * act)


def test_shard_peaks_follow_the_documented_formula():
    a, b = _stage("a", 1), _stage("b", 2)
    sh = shard_of([a, b], 0, 2)
    # F: P + in_0 + max(fwd_a, fwd_b + in_b) = 200 + 10 + max(10, 20)
    assert sh.forward_peak == 230
    # B: P + in_0 + max(grad_fwd: max(0 + 20, 20 + 20), kept 40 + max(G_b 100 + bwd_a 120, 0 + bwd_b 120))
    assert sh.backward_peak == 200 + 10 + 40 + 220
    assert sh.state_bytes == 200 and sh.names == ("a", "b")


def test_shared_parameter_counts_once_per_shard():
    tied = [_stage("embed", 7, 1000), _stage("mid", 2), _stage("head", 7, 1000)]
    assert shard_of(tied, 0, 3).state_bytes == 1100


def test_unlimited_budget_is_one_shard():
    plan = partition([_stage(str(i), i) for i in range(5)], None)
    assert [s.names for s in plan.shards] == [("0", "1", "2", "3", "4")]
    assert plan.prefetch_bytes == 0


def test_greedy_fewest_shards_with_prefetch_room():
    costs = [_stage(str(i), i) for i in range(6)]
    two = shard_of(costs, 0, 2).peak          # 470
    plan = partition(costs, two + 200)        # room for 2 stages + the prefetch of a 2-stage shard (200 bytes)
    assert [s.names for s in plan.shards] == [("0", "1"), ("2", "3"), ("4", "5")]
    assert plan.prefetch_bytes == 200
    assert plan.peak <= two + 200


def test_prefetch_room_may_force_smaller_shards():
    costs = [_stage(str(i), i) for i in range(4)]
    two = shard_of(costs, 0, 2).peak
    plan = partition(costs, two + 150)        # a 2-stage shard fits, but not beside another 2-stage shard's 200
    assert all(len(s.names) == 1 for s in plan.shards)
    assert plan.prefetch_bytes == 100
    assert partition(costs, two + 150, prefetch=False).shards[0].names == ("0", "1")


def test_stage_too_big_names_stage_bytes_and_budget():
    costs = [_stage("small", 1), _stage("huge", 2, nbytes=10_000), _stage("small2", 3)]
    with pytest.raises(PlanError) as err:
        partition(costs, 5_000)
    msg = str(err.value)
    assert "'huge' (#1)" in msg and "device_memory=5000" in msg and "Fix: raise device_memory" in msg
    need = shard_of(costs, 1, 2).peak + 10_000
    assert f"at least {need} bytes" in msg
