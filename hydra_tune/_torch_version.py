"""The torch releases hydra_tune supports, and the error at ``import hydra_tune`` outside them.

    require_torch(torch.__version__)   # ImportError: `torch>=2.4` (the releases hydra_tune supports) must
                                       #   hold, but got (torch='2.3.1', supported='>=2.4'). Fix: pip install ...

Rules: ``TORCH_MIN`` is the lowest release that has every torch API the code calls (the last to arrive: the
top-level ``torch.OutOfMemoryError``, 2.4; ``torch.amp.GradScaler("cpu")`` and ``_foreach_utils.
_device_has_foreach_support`` came in 2.3); benchmarks/compat.sh's cells torch-low and torch-top run the
torch-dependent tests at both ends; pyproject.toml declares the same bound
(tests/test_torch_range.py compares them). No upper bound: the newest release tested is torch-top's. The check runs
before any other hydra_tune module touches torch, so an old torch fails with this message, not with an
AttributeError from deep inside: hydra_tune/__init__.py imports this module first, which checks the installed torch.
"""
from __future__ import annotations

from .errors import rule_error

TORCH_MIN = (2, 4)
# The hf extra's own lower bound (pyproject.toml): no transformers release imports its models on torch 2.4 (5.9
# declares torch>=2.4 but imports torch.distributed.tensor.device_mesh, which 2.5 added); transformers raises itself.
HF_TORCH_MIN = (2, 5)


def _parse(version: str) -> tuple[int, int]:
    """``_parse("2.13.0+cpu") == (2, 13)``; local and pre-release parts are dropped."""
    parts = (version.split("+")[0].split(".") + ["0", "0"])[:2]
    out = []
    for part in parts:
        digits = ""
        for c in part:
            if not c.isdigit():
                break
            digits += c
        out.append(int(digits or 0))
    return out[0], out[1]


def spec() -> str:
    """The pip specifier of the supported range: ``spec() == ">=2.4"``."""
    return f">={TORCH_MIN[0]}.{TORCH_MIN[1]}"


def supported(version: str) -> bool:
    return _parse(version) >= TORCH_MIN


def require_torch(version: str) -> None:
    """Raise ImportError naming the installed and the supported torch when ``version`` is below ``TORCH_MIN``."""
    if not supported(version):
        added = f"{TORCH_MIN[0]}.{TORCH_MIN[1]}"
        raise rule_error(f"`torch{spec()}` (the releases hydra_tune supports)",
                         f"pip install 'torch{spec()}' (hydra_tune calls APIs torch {added} added: "
                         "torch.OutOfMemoryError)", kind=ImportError, torch=version, supported=spec())


def require_installed() -> None:
    """``require_torch`` for the torch this interpreter imports."""
    import torch

    require_torch(torch.__version__)


require_installed()
