"""What a runtime's CPU stand-ins learned counting segments (device/measured.py): a segment one of them counted is not
counted again on another; one being counted elsewhere runs routed and guarded, and a draw the guard sees makes that
device count it itself."""
from __future__ import annotations

import pytest
import torch

import hydra_tune as ht
from hydra_tune.device import dispatch
from hydra_tune.device.devices import CpuDevice
from hydra_tune.device.measured import Measurements
from hydra_tune.device.quiet import UnroutedDraw
from hydra_tune.device.rng import TaskRNG

KEY = ("t", ("train", (4, 8)))


@pytest.fixture(autouse=True)
def no_lending_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    # once any task lent the global generator (another test of this worker), nothing runs guarded: fresh, as a process
    monkeypatch.setattr(dispatch, "_LENT", [])


@pytest.fixture
def pair() -> tuple[CpuDevice, CpuDevice]:
    records = Measurements()
    return CpuDevice("cpu:0", None, records), CpuDevice("cpu:1", None, records)


def _unit(device: CpuDevice, rng: TaskRNG, nbytes: int) -> torch.Tensor:
    """A unit that allocates ``nbytes`` (freed at its end) and draws once (normal_ takes a generator: no lending)."""
    with device.unit_scope(rng):
        scratch = torch.ones(nbytes // 4)
        del scratch
        return torch.empty(3).normal_()


def test_a_segment_counted_on_one_device_runs_uncounted_on_the_other(pair) -> None:
    first, second = pair
    assert first.measure(KEY, "t")  # counted op by op here
    first.measuring = True
    _unit(first, TaskRNG(0), 4096)
    first.segment_done()
    # the other device runs it as the first would on its next segment: not counted (before: counted again there),
    # its peak the one counted for it
    assert not second.measure(KEY, "t2")
    assert second.peak_bytes() == first.peak_bytes() >= 4096
    assert not first.measure(KEY, "t")


def test_the_counting_device_adds_nothing_to_its_own_peak_later(pair) -> None:
    # its peak has the segment, and what still lives of the storages it made is in its bytes: adding them again
    # read P2's spilled plan 10 MiB over its count (and P3's second device 21-25 MiB)
    first, second = pair
    assert first.measure(KEY, "t")
    first.measuring = True
    kept = [_unit(first, TaskRNG(0), 4096) for _ in range(3)]
    first.segment_done()
    peak = first.peak_bytes()
    for _ in range(3):
        assert not first.measure(KEY, "t")
    assert first.peak_bytes() == peak
    del kept


def test_a_segment_counted_elsewhere_now_runs_routed_and_guarded(pair) -> None:
    first, second = pair
    assert first.measure(KEY, "t")  # its count has begun, not ended: what it draws is not known yet
    assert not second.measure(KEY, "t2")
    second.measuring = False
    # draws through torch's functions come from the task's stream, as counted: the same numbers, the global generator
    # untouched
    before = torch.get_rng_state()
    assert torch.equal(_unit(second, TaskRNG(5), 64), _unit(CpuDevice("alone", None), TaskRNG(5), 64))
    assert torch.equal(torch.get_rng_state(), before)
    # a draw the router does not see (a generator object's own method) moves the global generator: caught, and the
    # device counts the segment itself next
    try:
        with pytest.raises(UnroutedDraw, match="counted on another device"):
            with second.unit_scope(TaskRNG(5)):
                torch.default_generator.manual_seed(99)
    finally:
        torch.set_rng_state(before)
    assert second.measure(KEY, "t2")


def test_a_lent_global_generator_means_counting_here(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    # a guard reads the global generator, which tells nothing once a task lent it: count instead of guessing
    first, second = pair
    assert first.measure(KEY, "t")
    monkeypatch.setattr(dispatch, "_LENT", [True])
    assert second.measure(KEY, "t2")


def test_a_runtimes_cpu_devices_share_their_records() -> None:
    with ht.Runtime(devices=["cpu", "cpu"]) as rt:
        a, b = rt.devices
        assert a.records is b.records
    with ht.Runtime(devices=["cpu"]) as other:
        assert other.devices[0].records is not a.records  # (one runtime's task names are not another's)


def test_a_task_that_ended_is_forgotten_on_every_device(pair) -> None:
    first, second = pair
    assert first.measure(KEY, "t")
    first.segment_done()
    second.forget("t")
    assert first.measure(KEY, "t")  # a later task of that name is counted again, wherever it runs
