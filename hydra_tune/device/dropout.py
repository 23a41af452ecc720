"""CPU dropout drawn from a task's generator in the four tensor calls torch's own CPU dropout makes.

    out = routed_dropout(args, kwargs, generator)    # F.dropout's arguments; None: not this case

Why: the light router (dispatch.RandomRouter) runs a random call under a dispatch mode that adds the task's
generator to the op that draws; for ``nn.Dropout`` that is a Python call per aten op of the dropout and torch's
wrappers around the mode, several times the dropout's own cost on a small model (about a tenth of a small MLP's
unit). torch's CPU dropout (ATen's unfused path, the one the CPU takes) is ``noise = empty_like(x)``,
``noise.bernoulli_(1 - p)``, ``noise.div_(1 - p)``, ``x * noise``: making the same calls with the task's generator
draws the same numbers, computes the same values and records the same multiply for autograd.

Rule (nothing silently wrong): the short form is used only once this process has checked that torch's CPU dropout
makes exactly those aten ops and that both give bit-identical outputs and leave the generator in the same state
(``matches_torch``, once); a torch whose CPU dropout differs keeps the dispatch mode's path. Only the common case
takes it: a plain strided floating-point CPU tensor, ``training``, not in place, ``0 < p < 1``.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

DROPOUT = F.dropout
_EXPECTED = ("aten.empty_like.default", "aten.bernoulli_.float", "aten.div_.Scalar", "aten.mul.Tensor")
_verdict: list[bool] = []  # [whether the short form matches torch's], once checked
_lock = threading.Lock()


def routed_dropout(args: tuple, kwargs: dict, generator: torch.Generator) -> torch.Tensor | None:
    """``F.dropout(*args, **kwargs)`` drawing from ``generator``, or None when the call is not the common case
    (the caller routes it the general way)."""
    x = args[0] if args else kwargs.get("input")
    if type(x) is not torch.Tensor or x.device.type != "cpu":
        return None
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    training = args[2] if len(args) > 2 else kwargs.get("training", True)
    inplace = args[3] if len(args) > 3 else kwargs.get("inplace", False)
    if (not training or inplace or type(p) not in (float, int) or not 0 < p < 1 or not x.is_floating_point()
            or x.layout is not torch.strided or x.numel() == 0 or not matches_torch()):
        return None
    return dropped(x, float(p), generator)


def dropped(x: torch.Tensor, p: float, generator: torch.Generator) -> torch.Tensor:
    """torch's CPU dropout of ``x`` (training, ``0 < p < 1``) in its four calls, drawing from ``generator`` (the
    attention's too: sdpa.py)."""
    noise = torch.empty_like(x)
    noise.bernoulli_(1 - p, generator=generator)
    noise.div_(1 - p)
    return x * noise


class Recorded(TorchDispatchMode):
    """The aten ops of a call, each random one given ``generator`` (torch's own dropout, drawing from it)."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.generator, self.ops = generator, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = dict(kwargs or {})
        self.ops.append(str(func))
        if any(a.name == "generator" for a in func._schema.arguments) and kwargs.get("generator") is None:
            kwargs["generator"] = self.generator
        return func(*args, **kwargs)


def matches_torch() -> bool:
    """Whether this torch's CPU dropout is the short form's ops and values (checked once per process). The check
    runs in a thread of its own, whose torch state is a fresh thread's: its first call may come from inside a unit,
    a meta-device context, the router, a ``no_grad`` block or an offloading forward, whose saved-tensor hooks
    (thread-local, as modes and grad mode are) would run copies inside the recording and read False for the whole
    process (correct, but every dropout then takes the slow path)."""
    if not _verdict:
        with _lock:
            if not _verdict:
                _verdict.append(in_fresh_thread(_check, "hydra-dropout-check"))
    return _verdict[0]


def in_fresh_thread(check: Callable[[], bool], name: str) -> bool:
    """``check()`` run in a thread of its own (a fresh thread's torch state, see ``matches_torch``); False when it
    raised (the slow path)."""
    found: list[bool] = []
    checker = threading.Thread(target=lambda: found.append(check()), name=name, daemon=True)
    checker.start()
    checker.join()
    return bool(found and found[0])


def _check() -> bool:
    x = torch.linspace(-3.0, 3.0, 4 * 257).reshape(4, 257).requires_grad_()
    theirs, ours = torch.Generator().manual_seed(20261201), torch.Generator().manual_seed(20261201)
    with Recorded(theirs) as recorded:
        expected = F.dropout(x, 0.3, True)
    got = dropped(x, 0.3, ours)
    (g_expected,) = torch.autograd.grad(expected.sum(), x)
    (g_got,) = torch.autograd.grad(got.sum(), x)
    return (tuple(recorded.ops) == _EXPECTED and torch.equal(expected, got) and torch.equal(g_expected, g_got)
            and torch.equal(theirs.get_state(), ours.get_state()))
