"""Which torch calls draw random numbers on the CPU, and whether the light router (dispatch.RandomRouter) sees them.

    is_seeded(func) and draws(func, args, kwargs)       # an aten op that draws here (UnitMode counts it)
    routed(func, args, kwargs)                          # a torch call the router runs under UnitMode
    with UnitMode(gen) as mode, OutermostCall() as mode.outermost: ...   # a measured unit: UNSEEN marks a draw
                                                                         # the router would miss

Why: the router is a torch-function mode, so it is handed only the outermost call of each computation; the draws
inside a call it runs as it is reach no function mode and would come from torch's global generator. A measured unit
(dispatch.UnitMode) therefore notes, for every aten op that draws, whether the outermost call around it is one the
router runs under UnitMode: by its name (``RANDOM_NAMES``), or for the composite functions of ``DRAWS_WHEN`` by the
arguments that make them draw. A task whose measured units drew outside those (``UNSEEN``), in a backward or a
recomputed block (``IN_BACKWARD``), or through an aten op not in ``ROUTED``, keeps the full mode.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_seeded_ops: dict[Any, bool] = {}


def is_seeded(func: Any) -> bool:
    """Whether an aten op may draw (torch tags it ``nondeterministic_seeded``)."""
    known = _seeded_ops.get(func)
    if known is None:
        known = _seeded_ops[func] = torch.Tag.nondeterministic_seeded in func.tags
    return known


_dropout_at: dict[Any, int | None] = {}


def draws(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a seeded op draws here: one with a ``dropout_p`` argument (CPU attention's fused kernels) only when
    it is above 0. Else it would count as a draw (keeping its task off the light router) and lend the global
    generator under its lock at every attention call of a model with no attention dropout (LLaMA's default)."""
    at = _dropout_at.get(func, -1)
    if at == -1:
        names = [a.name for a in func._schema.arguments]
        at = _dropout_at[func] = names.index("dropout_p") if "dropout_p" in names else None
    if at is None:
        return True
    p = args[at] if len(args) > at else kwargs.get("dropout_p", 0.0)
    return not isinstance(p, (int, float)) or p > 0


# A measured unit's mark for a draw made while autograd ran a backward, or under saved-tensor hooks other than ours
# (torch.utils.checkpoint's: the block is drawn again in the backward): not in ROUTED, the task keeps UnitMode.
IN_BACKWARD = "<drawn in a backward or a recomputed block>"


def recomputed_in_backward() -> bool:
    """Whether saved-tensor hooks not hydra_tune's own (offload.py) are active: torch.utils.checkpoint's
    non-reentrant form recomputes the block under them in the backward."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return top is not None and not getattr(top[0], "__module__", "").startswith("hydra_tune.")

# A measured unit's mark for a draw the light router would miss: made inside a torch function that is not a random
# one (one of torch's composite functions: F.multi_head_attention_forward's attention dropout; a function mode sees
# only the outermost call, and the router runs a non-random one as it is) or outside any torch function call:
# not in ROUTED, the task keeps UnitMode.
UNSEEN = "<drawn where the light router does not see>"


class OutermostCall(TorchFunctionMode):
    """Around a measured unit: whether the torch call running at the outermost level now (the call a function
    mode, the light router, is handed: the calls inside it reach no function mode) is one the router would run
    under UnitMode (``routed``, as ``routed`` decides); False between calls."""

    def __init__(self) -> None:
        super().__init__()
        self.routed = False

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        outer, self.routed = self.routed, routed(func, args, kwargs)
        try:
            return func(*args, **kwargs)
        finally:
            self.routed = outer


def _mha_draws(args: tuple, kwargs: dict) -> bool:
    """F.multi_head_attention_forward draws its attention dropout in training with ``dropout_p > 0``."""
    p = args[10] if len(args) > 10 else kwargs.get("dropout_p", 0.0)
    training = args[13] if len(args) > 13 else kwargs.get("training", True)
    return bool(training) and p > 0


def _rnn_draws(args: tuple, kwargs: dict) -> bool:
    """torch.lstm / gru / rnn_* (as nn.RNNBase calls them, positionally) draw between layers when ``train`` and
    ``dropout > 0``: ``(input, hx, params, has_biases, num_layers, dropout, train, ...)``, or packed,
    ``(data, batch_sizes, hx, params, ...)`` one place later."""
    at = 5 if isinstance(args[2], (list, tuple)) else 6
    return bool(args[at + 1]) and args[at] > 0


# Composite torch functions whose draws happen inside (out of a function mode's reach) only under some
# arguments: the router runs such a call under UnitMode when they say it draws, else as it is
DRAWS_WHEN = {"multi_head_attention_forward": _mha_draws, "lstm": _rnn_draws, "gru": _rnn_draws,
               "rnn_tanh": _rnn_draws, "rnn_relu": _rnn_draws}


def routed(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the light router runs this call under UnitMode: a function that may draw by its name, or one of
    ``DRAWS_WHEN`` called so that it draws (arguments it cannot read: routed)."""
    name = getattr(func, "__name__", None)
    if name in RANDOM_NAMES:
        return True
    when = DRAWS_WHEN.get(name)  # type: ignore[arg-type]
    if when is None:
        return False
    try:
        return when(args, kwargs)
    except (IndexError, TypeError):
        return True


# The random aten ops those functions make (by base name): any other one seen in a measured segment means the
# task has a random op the router would miss.
ROUTED = frozenset((
    "bernoulli", "bernoulli_", "native_dropout", "rand", "rand_like", "randn", "randn_like", "randint",
    "randint_like", "randperm", "multinomial", "normal", "normal_", "uniform_", "random_", "exponential_",
    "geometric_", "cauchy_", "log_normal_", "poisson", "rrelu_with_noise", "rrelu_with_noise_", "_fused_dropout"))

# Functions that may draw from the CPU generator, by name (torch.*, torch.nn.functional.*, Tensor methods).
RANDOM_NAMES = frozenset((
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "feature_dropout",
    "native_dropout", "rrelu", "rrelu_", "gumbel_softmax", "rand", "randn", "randint", "randperm", "rand_like",
    "randn_like", "randint_like", "bernoulli", "bernoulli_", "multinomial", "normal", "normal_", "poisson",
    "uniform_", "random_", "exponential_", "geometric_", "cauchy_", "log_normal_", "scaled_dot_product_attention",
    "fused_dropout", "_fused_dropout"))
