"""The tool versions the integrations are tested with (benchmarks/compat.sh), and the error outside them.

    from hydra_tune.integrations._versions import require
    require("ray", ray.__version__)      # ImportError: `ray[tune] >= 2.41, < 2.61` must hold, but got (ray=2.40.0,
                                         #   supported='>=2.41,<2.61'). Fix: pip install 'ray[tune]>=2.41,<2.61' ...

Rules: ``SUPPORTED`` is the one table of ranges; pyproject.toml's extras declare the same ones (tests/test_compat.py
compares them). A range is (lowest, first unsupported) as (major, minor) pairs, the upper bound None when open.
This module imports no tool itself (callers pass the version they imported), so it is cheap and torch-free.
"""
from __future__ import annotations

from hydra_tune.errors import rule_error

# distribution -> (lowest supported (major, minor), first unsupported (major, minor) or None)
SUPPORTED: dict[str, tuple[tuple[int, int], tuple[int, int] | None]] = {
    "ray": ((2, 41), (2, 61)),     # the Tune integration routes Ray's private session variable (_tune_proxy)
    "optuna": ((3, 1), None),
}
EXTRA = {"ray": "ray[tune]", "optuna": "optuna"}


def parse(version: str) -> tuple[int, int]:
    """``parse("2.60.0") == (2, 60)``; ``parse("5.0.0rc1") == (5, 0)``; local and pre-release parts are dropped."""
    parts = (version.split("+")[0].split(".") + ["0", "0"])[:2]
    out = []
    for p in parts:
        digits = ""
        for c in p:
            if not c.isdigit():
                break
            digits += c
        out.append(int(digits or 0))
    return out[0], out[1]


def spec(name: str) -> str:
    """The pip specifier of ``name``'s supported range: ``spec("ray") == ">=2.41,<2.61"``."""
    low, high = SUPPORTED[name]
    text = f">={low[0]}.{low[1]}"
    return text if high is None else f"{text},<{high[0]}.{high[1]}"


def supported(name: str, version: str) -> bool:
    low, high = SUPPORTED[name]
    have = parse(version)
    return have >= low and (high is None or have < high)


def require(name: str, version: str) -> None:
    """Raise ImportError naming the installed and the supported versions when ``version`` is outside the range."""
    if not supported(name, version):
        raise rule_error(f"`{EXTRA[name]}{spec(name)}` (the versions hydra_tune is tested with)",
                         f"pip install '{EXTRA[name]}{spec(name)}' (or 'hydra_tune[{name}]')", kind=ImportError,
                         **{name: version, "supported": spec(name)})
