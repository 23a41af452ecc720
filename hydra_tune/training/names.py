"""One string object for each module path or parameter name that several tasks' records hold.

    label = shared_name(path)     # an equal string, the same object for every task of this architecture

Why: ``named_modules()`` and ``named_parameters()`` build new strings on every call, and each task keeps them in
several records (its as-built Python state, its shards' bindings, its pool entries): for a MiniLM LoRA trial ~250
module paths and ~130 parameter names, ~50 KiB per task, the same text in every trial of a search. ``sys.intern``
would share them too, but on Python 3.12 interned strings are never freed.

Rules: the result equals its argument (only identity is shared, so nothing can change meaning); at most
``MAX_NAMES`` strings are kept, process-wide; past that the table starts over (later tasks then hold their own
copies until it fills again: memory only, never a behaviour).
"""
from __future__ import annotations

MAX_NAMES = 16_384   # ~1.5 MiB of typical paths at most, for every architecture a process sees

_NAMES: dict = {}  # str -> str, and tuple of str -> tuple (shared_names)


def shared_name(name: str) -> str:
    """``name``, or an equal string that an earlier call returned (dict operations are atomic under the GIL)."""
    if len(_NAMES) >= MAX_NAMES:
        _NAMES.clear()
    return _NAMES.setdefault(name, name)


def shared_names(names: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` (a tuple of names), or an equal tuple an earlier call returned: a task keeps one per parameter
    slot (bind.py), most of them ``(name,)``, alike in every trial of an architecture."""
    return shared_name(names)  # type: ignore[arg-type]  (a tuple of strings: hashable, compared by value)
