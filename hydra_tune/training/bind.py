"""Run a stage's module over other tensors in place of its own parameters and buffers, restoring them after.

    bound = Bound(stage.module, [("0.weight", key_w), ("0.bias", key_b)])   # names as named_parameters()
    out, after = bound.call(carry, copies)        # copies: key -> tensor; after: name -> what the slot held

What ``torch.func.functional_call(module, {name: copies[key]}, (carry,), tie_weights=False, strict=False)`` does,
for names that are parameter or buffer slots: resolved once (not on every call, which cost about a tenth of a
small model's unit), and each slot swapped once even when one submodule is reachable under two names.

Rules: during the forward every named slot holds its given tensor; afterwards it holds its own tensor again,
however the forward ended; ``after[name]`` is what the slot held when the forward returned (a buffer the forward
assigned a new tensor shows up there). A module this cannot bind (TorchScript, a name that is no longer a
parameter or buffer slot) is run through ``functional_call`` itself, except that a slot reached under two names is
never left holding a swapped-in tensor (functional_call restores such a slot twice, in the wrong order).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.func import functional_call

from .names import shared_name, shared_names

# owner module, "_parameters" or "_buffers", attribute, the key of its tensor in ``copies``, the names reaching it
# (flat: a task keeps one per parameter and buffer for its life)
Slot = tuple[nn.Module, str, str, int, tuple[str, ...]]


class Bound:
    """One module and the names of its parameters and buffers, each with the key of its tensor in ``copies``."""

    def __init__(self, module: nn.Module, binding: Sequence[tuple[str, int]]) -> None:
        self.module = module
        self.binding = list(binding)
        # One entry per slot. None: run through functional_call.
        self._slots: list[Slot] | None = self._resolve()

    def _resolve(self) -> list[Slot] | None:
        if isinstance(self.module, (torch.jit.ScriptModule, nn.DataParallel)):
            return None
        slots: dict[tuple[int, str], tuple[nn.Module, str, str, int, list[str]]] = {}
        for name, key in self.binding:
            prefix, _, attr = name.rpartition(".")
            try:
                owner = self.module.get_submodule(prefix) if prefix else self.module
            except AttributeError:
                return None
            table = "_parameters" if attr in owner._parameters else "_buffers" if attr in owner._buffers else None
            if table is None:
                return None
            entry = slots.setdefault((id(owner), attr), (owner, table, shared_name(attr), key, []))
            if entry[3] != key:  # one slot given two tensors: cannot be; functional_call decides
                return None
            entry[4].append(name)
        # (each slot's names: one tuple object for every task of the architecture, names.py)
        return [(owner, table, attr, key, shared_names(tuple(names)))
                for owner, table, attr, key, names in slots.values()]

    def call(self, carry: Any, copies: dict[int, torch.Tensor]) -> tuple[Any, dict[str, Any]]:
        """The module's forward on ``carry`` with the bound tensors; and what each name's slot held after it."""
        if self._slots is None or torch.jit.is_tracing():
            return self._functional(carry, copies)
        swapped: list[tuple[dict[str, Any], str, Any, list[str]]] = []
        after: dict[str, Any] = {}
        try:
            for owner, table, attr, key, names in self._slots:
                slots = owner.__dict__[table]
                if attr not in slots:  # the module changed its slots since: bind the slow way
                    break
                swapped.append((slots, attr, slots[attr], names))
                slots[attr] = copies[key]
            else:
                out = self.module(carry)
                for slots, attr, _, names in swapped:
                    for name in names:
                        after[name] = slots.get(attr)
                return out, after
        finally:
            for slots, attr, own, _ in reversed(swapped):
                slots[attr] = own
        return self._functional(carry, copies)

    def _functional(self, carry: Any, copies: dict[int, torch.Tensor]) -> tuple[Any, dict[str, Any]]:
        state = {name: copies[key] for name, key in self.binding}
        own = {name: t for name, t in self.module.named_parameters(remove_duplicate=False)}
        own.update(self.module.named_buffers(remove_duplicate=False))
        given = dict(state)
        try:
            out = functional_call(self.module, state, (carry,), tie_weights=False, strict=False)
        finally:
            self._put_back(own)
        # a name whose slot functional_call restored twice reads back its own tensor: it was not assigned
        return out, {n: given[n] if t is own.get(n) else t for n, t in state.items()}

    def _put_back(self, own: dict[str, torch.Tensor]) -> None:
        """Every slot holds its own tensor again (functional_call can leave a slot reached twice swapped)."""
        for name, tensor in own.items():
            prefix, _, attr = name.rpartition(".")
            owner = self.module.get_submodule(prefix) if prefix else self.module
            for table in (owner._parameters, owner._buffers):
                if attr in table and table[attr] is not tensor:
                    table[attr] = tensor
