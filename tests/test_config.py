"""One RuntimeConfig: every entry point validates a runtime's settings once, where they are given, with the same
message for the same mistake; a config object is passed on whole and never checked again."""
from __future__ import annotations

import dataclasses

import pytest

import hydra_tune as ht
from hydra_tune import node
from hydra_tune.config import RuntimeConfig

BAD = [
    dict(devices=0),
    dict(devices=["tpu:0"]),
    dict(devices=["cpu", "cuda:0"]),
    dict(devices=["cpu"], device_memory="64 MBs"),
    dict(devices=["cpu"], device_memory=-5),
    dict(devices=["cpu"], host_memory="lots"),
    dict(devices=["cpu"], host_memory=0),
    dict(devices=["cpu"], policy="sjf"),
]

# Each entry point, called with the settings as keywords. None of them may start anything before validating.
ENTRY_POINTS = {
    "RuntimeConfig": lambda kw: RuntimeConfig(**kw),
    "Runtime": lambda kw: ht.Runtime(**kw),
    "configure": lambda kw: ht.configure(**kw),
    "node.server_files": lambda kw: node.server_files(**kw),
    "node.connect": lambda kw: node.connect(**kw),
}


def _message(call, kw) -> tuple[type, str]:
    with pytest.raises(Exception) as err:
        call(kw)
    return type(err.value), str(err.value)


@pytest.mark.parametrize("kw", BAD, ids=[str(sorted(kw.items())) for kw in BAD])
def test_the_same_mistake_gets_the_same_message_at_every_entry_point(kw):
    messages = {name: _message(call, kw) for name, call in ENTRY_POINTS.items()}
    first = messages["RuntimeConfig"]
    assert first[0] is ValueError and " must hold, but got (" in first[1] and ". Fix: " in first[1]
    assert all(m == first for m in messages.values()), messages


def test_settings_are_normalised_once_and_the_config_travels_as_plain_data():
    cfg = RuntimeConfig(devices=["cpu:3", "cpu"], device_memory="64MiB", host_memory="1GiB", policy="fifo")
    assert (cfg.devices, cfg.device_memory, cfg.host_memory) == (("cpu", "cpu"), 64 << 20, 1 << 30)
    assert RuntimeConfig(**cfg.as_dict()) == cfg and cfg.as_dict()["devices"] == ["cpu", "cpu"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.policy = "lrtf"  # type: ignore[misc]


def test_a_config_reaches_the_runtime_whole():
    cfg = RuntimeConfig(devices=["cpu", "cpu"], device_memory="64MiB", host_memory="2GiB", policy="round_robin")
    with ht.Runtime(config=cfg) as rt:
        stats = rt.stats()
        assert rt.config is cfg
    assert stats["policy"] == "round_robin" and stats["host"]["budget"] == 2 << 30
    assert [(d["name"], d["budget"]) for d in stats["devices"]] == [("cpu:0", 64 << 20), ("cpu:1", 64 << 20)]


def test_config_and_settings_at_once_is_refused_unless_the_settings_are_the_defaults():
    cfg = RuntimeConfig(devices=["cpu"], policy="fifo")
    assert RuntimeConfig.of(cfg, devices="auto", device_memory=None, host_memory=None, policy="lrtf") is cfg
    with pytest.raises(ValueError, match=r"^either `config=` or the settings it holds are given, not both must "
                                         r"hold, but got \(devices=\['cpu'\]\)\. Fix: "):
        ht.Runtime(devices=["cpu"], config=cfg)
    with pytest.raises(TypeError, match=r"`config` is a hydra_tune.RuntimeConfig or None"):
        ht.configure(config={"devices": ["cpu"]})


def test_configure_validates_now_and_the_default_runtime_uses_its_config():
    with pytest.raises(ValueError, match="policy"):
        ht.configure(devices=["cpu"], policy="nope")
    try:
        ht.configure(devices=["cpu"], device_memory="32MiB", policy="fifo")
        rt = ht.default_runtime()
        assert rt.config == RuntimeConfig(devices=["cpu"], device_memory=32 << 20, policy="fifo")
    finally:
        ht.configure()   # the next default runtime is built from the defaults again (and this one is closed)
