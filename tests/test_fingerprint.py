"""training/fingerprint.py: keys are exact (one differing value, type, class or tie gives another key; equal
models give equal keys) and compact (a memo of keys of large models holds little)."""
from __future__ import annotations

import enum
import sys

import pytest
import torch
import torch.nn as nn

from hydra_tune.training.fingerprint import Keyer, Unkeyable


def _key(*values):
    return Keyer().key(*values)


def _mlp(width: int = 16, p: float = 0.1) -> nn.Module:
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Dropout(p), nn.Linear(width, 2))


class Color(enum.IntEnum):
    RED = 1


def _tagged(value) -> nn.Module:
    m = _mlp()
    m[2].tag = value
    return m


def test_equal_models_built_apart_get_equal_keys_and_hashes():
    a, b = _key(_mlp()), _key(_mlp())
    assert a == b and hash(a) == hash(b)


BIG = 10 ** 5000   # an int past the 4300 digits that ``repr`` refuses


@pytest.mark.parametrize("one, other", [
    (1, True), (1, 1.0), (0.0, -0.0), (1, Color.RED), ("1", b"1"), ((1, 2), [1, 2]), ({1: 2}, {1: 3}),
    (BIG, BIG + 1), (float("inf"), 1e308), (torch.float32, torch.float64), ({1, 2}, {1, 3}),
], ids=lambda v: type(v).__name__)
def test_values_that_python_calls_equal_or_that_differ_in_type_get_other_keys(one, other):
    assert _key(_tagged(one)) != _key(_tagged(other))
    assert _key(_tagged(one)) == _key(_tagged(one))


def test_two_classes_of_one_name_and_a_tie_are_told_apart():
    def make_class():
        class Block(nn.Linear):
            pass
        return Block

    first, second = make_class(), make_class()
    assert _key(nn.Sequential(first(4, 4))) != _key(nn.Sequential(second(4, 4)))
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    assert _key(tied) != _key(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))


def test_functions_are_keyed_by_code_and_captured_values():
    def scaled(k):
        return lambda x: x * k

    assert _key(scaled(2)) == _key(scaled(2))
    assert _key(scaled(2)) != _key(scaled(3))
    assert _key(scaled(2)) != _key(lambda x: x * 2)


def test_a_value_that_cannot_be_keyed_exactly_raises():
    class Opaque:
        __slots__ = ()

    with pytest.raises(Unkeyable):
        _key(_tagged(Opaque()))


def _held_bytes(value, seen: set[int]) -> int:
    if id(value) in seen:
        return 0
    seen.add(id(value))
    size = sys.getsizeof(value)
    if isinstance(value, (tuple, list, frozenset, set)):
        size += sum(_held_bytes(x, seen) for x in value)
    return size


def test_a_key_of_a_large_model_holds_a_digest_and_its_few_anchors():
    """A full walk of 120 modules was ~0.1 MiB of tuples held by every memo entry; the key keeps ~2 KiB."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Dropout(0.1)) for _ in range(40)])
    key = _key(model)
    assert _held_bytes(key, set()) < 4096, _held_bytes(key, set())
    digest, anchors = key
    assert isinstance(digest, bytes) and len(anchors) < 16
