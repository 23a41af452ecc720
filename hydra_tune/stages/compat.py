"""The few transformers internals the family stages call whose names changed across the supported releases.

    mask = call_renamed(create_causal_mask, config=cfg, inputs_embeds=x, attention_mask=m, cache=None)
    hidden = call_renamed(layer, hidden, attention_mask=mask, cache=cache)   # past_key_values= before 5.24
    hidden = keep_all_positions(hidden)          # slice_logits_to_keep(hidden, 0), or the slice it replaced
    check_family("opt")                          # ValueError naming the installed and the needed transformers

Rules: a keyword is renamed only to a parameter the callee declares by name (a layer that takes ``**kwargs``
would otherwise swallow an unknown name silently); names are the current release's (``cache``,
``cache_length``), their older spellings (``past_key_values``, ``past_key_values_length``) are used where the
callee declares those instead. Where a release's model forward differs in what it computes, not only in names,
``check_family`` refuses the family on it (``FAMILY_MIN``) rather than train something other than the model.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from ..errors import rule_error

# current name -> the names older transformers releases declared for the same argument
ALIASES: dict[str, tuple[str, ...]] = {"cache": ("past_key_values",), "cache_length": ("past_key_values_length",),
                                       "inputs_embeds": ("input_embeds",)}

# The oldest transformers release whose model forward each family's stages repeat exactly (found by
# benchmarks/compat.sh with the family's exactness tests). OPT before 5.23 draws a layerdrop random number in
# every training forward even with layerdrop=0, which moves the dropout random stream.
TRANSFORMERS_MIN = (5, 9)
FAMILY_MIN: dict[str, tuple[int, int]] = {"opt": (5, 23)}


@functools.lru_cache(maxsize=None)
def _declared(fn: Callable[..., Any]) -> frozenset[str]:
    """The parameter names ``fn`` declares (``**kwargs`` excluded); follows ``__wrapped__`` (deprecation shims)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def _key(fn: Any) -> Any:
    # nn.Module instances differ but their class's forward is what declares the names
    return type(fn).forward if hasattr(fn, "forward") and not inspect.isfunction(fn) else fn


def renamed(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with each current name replaced by the older alias ``fn`` declares, when it lacks the current one."""
    declared = _declared(_key(fn))
    out = {}
    for name, value in kwargs.items():
        if name in ALIASES and name not in declared:
            name = next((old for old in ALIASES[name] if old in declared), name)
        out[name] = value
    return out


def call_renamed(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with keywords renamed for the installed transformers (see ``renamed``)."""
    return fn(*args, **renamed(fn, kwargs))


def keep_all_positions(hidden: Any) -> Any:
    """What the causal-LM heads do with ``logits_to_keep=0`` (every position): ``slice_logits_to_keep`` where it
    exists (5.22+), else the slice ``[:, 0:, :]`` those heads took before it."""
    try:
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:
        return hidden[:, slice(0, None), :]
    return slice_logits_to_keep(hidden, 0)


def _version(text: str) -> tuple[int, int]:
    parts = (text.split("+")[0].split(".") + ["0", "0"])[:2]
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts)  # type: ignore[return-value]


def check_family(family: str) -> None:
    """Raise ValueError naming the installed and the needed transformers when ``family``'s stages do not repeat the
    installed release's model forward exactly (older than ``TRANSFORMERS_MIN`` or the family's ``FAMILY_MIN``)."""
    import transformers

    have = _version(transformers.__version__)
    need = max(TRANSFORMERS_MIN, FAMILY_MIN.get(family, TRANSFORMERS_MIN))
    if have < need:
        raise rule_error(f"transformers >= {need[0]}.{need[1]} for {family} models cut into stages",
                         f"pip install 'transformers>={need[0]}.{need[1]}', or train the model unsharded (a budget "
                         "that fits the whole model)", transformers=transformers.__version__, family=family)
