"""The memory model and partitioner over plain numbers: exact expected shards and peaks."""
from __future__ import annotations

import pytest

from hydra_tune.errors import PlanError
from hydra_tune.policy.partition import Shard, StageCost, partition, shard_of


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


def _sh(i: int, kept: int, fwd: float, io: int = 10) -> Shard:
    return Shard(i, i, i + 1, (str(i),), 100, 200, 300, kept_bytes=kept, fwd_seconds=fwd, input_bytes=io,
                 output_bytes=io)


def test_choose_keep_takes_most_seconds_per_byte_within_room():
    from hydra_tune.policy.partition import choose_keep

    shards = [_sh(0, 100, 1.0), _sh(1, 50, 1.0), _sh(2, 100, 3.0), _sh(3, 10, 9.0)]  # the last never keeps
    # seconds per byte: #1 0.02, #2 0.03, #0 0.01 -> #2 (100) then #1 (50) fit in 160; #0 does not
    assert choose_keep(shards, 160) == (False, True, True, False)
    assert choose_keep(shards, None) == (True, True, True, False)
    assert choose_keep(shards, 49) == (False, False, False, False)
    assert choose_keep([_sh(0, 10, 0.0), _sh(1, 10, 1.0)], None) == (False, False)  # nothing measured: no gain


def test_choose_offload_when_copies_beat_the_recompute():
    from hydra_tune.policy.partition import choose_offload

    shards = [_sh(0, 1020, 1.0), _sh(1, 2020, 1.0), _sh(2, 520, 1.0), _sh(3, 20, 1.0)]
    # moved bytes: kept - in - out = 1000, 2000, 500; two copies at 2000 B/s: 1.0 s, 2.0 s, 0.5 s vs 1.0 s forward
    assert choose_offload(shards, [False] * 4, 2000.0) == (False, False, True, False)
    assert choose_offload(shards, [False, False, True, False], 4000.0) == (True, False, False, False)
    assert choose_offload(shards, [False] * 4, None) == (False,) * 4


def test_plan_peak_counts_kept_activations():
    from hydra_tune.policy.partition import Plan

    shards = (_sh(0, 40, 1.0), _sh(1, 60, 1.0), _sh(2, 0, 1.0))
    plan = Plan(shards, 1000, 100, keep=(True, False, False), offload=(False, True, False))
    assert plan.held_bytes == 40 and plan.peak == 300 + 100 + 40
    assert plan.extra_seconds(bandwidth=50.0) == 2 * 40 / 50.0  # shard 1's moved bytes: 60 - 10 - 10
