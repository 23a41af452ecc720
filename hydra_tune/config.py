"""One runtime's settings, validated once: its devices, their memory budget, the host-memory budget, the policy.

    config = RuntimeConfig(devices=["cpu", "cpu"], device_memory="64MiB", host_memory="8GiB", policy="lrtf")
    Runtime(config=config)                  # or Runtime(devices=["cpu", "cpu"], device_memory="64MiB", ...)
    hydra_tune.configure(config=config); hydra_tune.node.connect(config=config)
    hydra_tune.optuna_study(direction="minimize", config=config); HydraExecutor(config=config)

Every entry point takes either ``config=`` or the same four keywords, and builds the ``RuntimeConfig`` where it is
called, so a mistake raises there, with the same message wherever it is made. What needs the machine (is there a
GPU, how much memory is free) is checked when the devices start (hydra_tune/device/devices.py).
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from .errors import rule_error
from .policy.schedule import POLICIES

__all__ = ["RuntimeConfig", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}
_UNIT_NAMES = "B, KB, KiB, MB, MiB, GB, GiB, TB, TiB"
# (what a size setting may be, how to write one) for the message of a bad value
_SIZE_RULES = {
    "device_memory": (f"`device_memory` is a positive int or a size string with a unit in {_UNIT_NAMES}",
                      "write e.g. 512MiB or 8GB"),
    "host_memory": (f"`host_memory` is None (measured), a positive int or a size string with a unit in "
                    f"{_UNIT_NAMES}", "write e.g. host_memory='16GiB', or None to measure the available memory"),
    "retain_frozen": (f"`retain_frozen` is 0 or None (off), a positive int or a size string with a unit in "
                      f"{_UNIT_NAMES}", "write e.g. retain_frozen='4GiB', or 0 to forget a base with its last trial"),
}
RESIDENCY = ("auto", "off")  # where tasks' state lives: on the device while it fits, or always in host memory
_NOT_POSITIVE = {"device_memory": ("`device_memory > 0`", "pass a positive byte count or a string like '512MiB'")}


def parse_bytes(value: int | str | None, name: str = "device_memory") -> int | None:
    """``parse_bytes("512MiB") == 536870912``; ints pass through; None means unlimited (or measured).

    ``name`` is the setting the value was given for: the error names it.
    """
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            rule, fix = _NOT_POSITIVE.get(name, _SIZE_RULES[name])
            raise rule_error(rule, fix, **{name: value})
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
            if n > 0:
                return n
    rule, fix = _SIZE_RULES[name]
    raise rule_error(rule, fix, **{name: value})


def _device_names(devices: Any) -> int | str | tuple[str, ...]:
    """'auto', an int >= 1, or a tuple of names, CPU stand-ins all "cpu" (the runtime numbers them)."""
    if devices == "auto":
        return "auto"
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices < 1:
            raise rule_error("`devices >= 1`", "pass the number of devices to use, 'auto', or a list of names",
                             devices=devices)
        return devices
    if not (isinstance(devices, (list, tuple)) and devices and all(isinstance(d, str) for d in devices)):
        raise rule_error("`devices` is 'auto', a positive int, or a non-empty list of names like ['cuda:0', "
                         "'cuda:1'] or ['cpu', 'cpu']", "pass one of those forms", devices=devices)
    names = []
    for name in devices:
        if name == "cpu" or re.fullmatch(r"cpu:\d+", name):
            names.append("cpu")  # the runtime numbers its CPU stand-ins itself
        elif name == "cuda" or re.fullmatch(r"cuda:\d+", name):
            names.append(name)
        else:
            raise rule_error("each device name is 'cpu' or 'cuda:<index>'", "write e.g. ['cuda:0', 'cuda:1'] or "
                             "['cpu', 'cpu']", device=name)
    if len({n.split(":")[0] for n in names}) > 1:
        raise rule_error("all `devices` are of one kind", "use only CUDA devices or only CPU devices",
                         devices=list(devices))
    gpus = ["cuda:0" if n == "cuda" else n for n in names if n != "cpu"]
    if len(set(gpus)) < len(gpus):  # two workers on one GPU would each plan for its whole memory
        raise rule_error("each CUDA device is listed once", "remove the duplicate (one worker per GPU; 'cuda' "
                         "is 'cuda:0'); only CPU stand-ins such as ['cpu', 'cpu'] may repeat", devices=list(devices))
    return tuple(names)


@dataclass(frozen=True)
class RuntimeConfig:
    """What a runtime is made of. Built from user values (``device_memory="64MiB"``); holds them validated and
    normalised (byte counts, a tuple of device names), so a config passed on is never checked again.

    ``devices``: "auto" (every visible GPU, else one CPU device), a count, or names (``["cuda:0", "cuda:1"]``;
    ``["cpu", "cpu"]``: CPU stand-ins). ``device_memory``: each device's budget (None: CUDA's free memory less a
    margin; unlimited on CPU). ``host_memory``: what admitted tasks' host state may take (None: measured at every
    admission). ``policy``: the schedule, "lrtf" (Sharded-LRTF with affinity), "fifo" or "round_robin".
    ``residency``: "auto" (a task's parameters, gradients and optimizer state stay on the device it runs on while
    they fit beside its units, and its optimizer steps there; training/resident.py) or "off" (always in host
    memory, copied in per unit, stepped on the host: device memory only for the running units).
    ``history``: how many ended tasks keep their record in ``stats()["tasks"]``; ``trace_events``: how many unit
    and copy events ``trace()`` keeps. Both are bounded so that a runtime (a node server) running for weeks does
    not grow: past them the oldest go first, and ``stats()["history"]`` counts what was dropped. Set them with
    ``config=RuntimeConfig(..., history=..., trace_events=...)`` (0 keeps none).
    ``share_frozen``: frozen parameters (``requires_grad=False``) with equal contents in several tasks are held
    once in host memory and once per device (training/shared_frozen.py); False: each task keeps its own.
    ``retain_frozen``: bytes of such weights kept in host memory after their last task ended, the least recently
    used dropped first, so that trials run one after another share one base too; charged to host-memory
    admission and dropped when a task needs the room (0 or None: forgotten with their last task).
    """

    devices: Any = "auto"
    device_memory: int | str | None = None
    host_memory: int | str | None = None
    policy: str = "lrtf"
    residency: str = "auto"
    history: int = 1000          # ended tasks' stats records (a few KiB each)
    trace_events: int = 200_000  # trace events (~0.3 KiB each: ~60 MiB at most)
    share_frozen: bool = True    # equal frozen weights of several tasks held once (training/shared_frozen.py)
    retain_frozen: int | str | None = "1GiB"  # of those, kept after their last task for the next one

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", _device_names(self.devices))
        object.__setattr__(self, "device_memory", parse_bytes(self.device_memory, "device_memory"))
        object.__setattr__(self, "host_memory", parse_bytes(self.host_memory, "host_memory"))
        retain = 0 if self.retain_frozen in (0, None) else parse_bytes(self.retain_frozen, "retain_frozen")
        object.__setattr__(self, "retain_frozen", retain)
        if self.policy not in POLICIES:
            raise rule_error(f"`policy` in {sorted(POLICIES)}", "pick one of those names", policy=self.policy)
        if self.residency not in RESIDENCY:
            raise rule_error(f"`residency` in {list(RESIDENCY)}", "pass 'auto' (state stays on the device while it "
                             "fits) or 'off' (state in host memory, stepped there)", residency=self.residency)
        if not isinstance(self.share_frozen, bool):
            raise rule_error("`share_frozen` is True or False", "pass share_frozen=True (hold equal frozen weights "
                             "once) or False", share_frozen=self.share_frozen)
        for name in ("history", "trace_events"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise rule_error(f"`{name}` is an int >= 0 (how many to keep; past it the oldest are dropped)",
                                 f"pass e.g. {name}={_DEFAULTS[name]} (the default)", **{name: value})

    @classmethod
    def of(cls, config: "RuntimeConfig | None" = None, **settings: Any) -> "RuntimeConfig":
        """``config`` itself, or a new config from ``settings`` (the entry points' keywords). Both at once is an
        error unless the settings are the defaults: the config would silently win over them."""
        if config is None:
            return cls(**settings)
        if not isinstance(config, RuntimeConfig):
            raise rule_error("`config` is a hydra_tune.RuntimeConfig or None", "pass RuntimeConfig(devices=..., "
                             "device_memory=..., host_memory=..., policy=...) or the settings themselves",
                             kind=TypeError, config=type(config).__name__)
        given = {k: v for k, v in settings.items() if v != _DEFAULTS[k]}
        if given:
            raise rule_error("either `config=` or the settings it holds are given, not both", "put the settings "
                             "into the RuntimeConfig (dataclasses.replace(config, ...)) or drop `config=`",
                             **given)
        return config

    def as_dict(self) -> dict[str, Any]:
        """Plain, JSON-ready values (devices as a list): what travels to a node server or a Ray actor."""
        out = asdict(self)
        if isinstance(self.devices, tuple):
            out["devices"] = list(self.devices)
        return out


_DEFAULTS = {f.name: f.default for f in fields(RuntimeConfig)}
RUNTIME_SETTINGS = tuple(_DEFAULTS)  # the settings' names, in order
