"""The adoption examples: each plain script and its hydra_tune twin differ in at most 3 lines, and both run.

The Optuna pair runs here (3 trials, 1 epoch, one trial at a time: the TPE sampler then sees the same values
and suggests the same trials, so every trial's parameters, reported accuracies and value must be equal). The Ray
Tune pair runs on the tests' local Ray with 2 trials x 1 epoch (``HYDRA_TUNE_EXAMPLES=1``: 3 trials x 2 epochs, with
ASHA stopping some); the diffs are always checked.
"""
from __future__ import annotations

import difflib
import importlib.util
import os
import sys
from pathlib import Path

import pytest

ADOPT = Path(__file__).resolve().parent.parent / "examples" / "adopt"
PAIRS = [("optuna_simple_plain.py", "optuna_simple_hydra.py"), ("tune_mnist_plain.py", "tune_mnist_hydra.py")]


def changed_lines(plain: Path, hydra: Path) -> list[str]:
    """The lines of ``hydra`` that are not in ``plain`` plus those of ``plain`` replaced or removed, paired."""
    a, b = plain.read_text().splitlines(), hydra.read_text().splitlines()
    changed = 0
    out = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag != "equal":
            changed += max(i2 - i1, j2 - j1)
            out += [f"- {line}" for line in a[i1:i2]] + [f"+ {line}" for line in b[j1:j2]]
    return out if changed else []


@pytest.mark.parametrize("plain,hydra", PAIRS)
def test_adoption_changes_at_most_3_lines(plain, hydra):
    a, b = (ADOPT / plain).read_text().splitlines(), (ADOPT / hydra).read_text().splitlines()
    ops = [op for op in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes() if op[0] != "equal"]
    changed = sum(max(i2 - i1, j2 - j1) for _, i1, i2, j1, j2 in ops)
    assert 1 <= changed <= 3, "\n".join(changed_lines(ADOPT / plain, ADOPT / hydra))
    added = [line for _, _, _, j1, j2 in ops for line in b[j1:j2]]
    assert any("ht.prepare(model, optimizer)" in line for line in added)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"adopt_{name[:-3]}", ADOPT / name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_optuna_example_pair_gives_equal_trials():
    pytest.importorskip("optuna")
    pytest.importorskip("sklearn")
    plain, hydra = _load("optuna_simple_plain.py"), _load("optuna_simple_hydra.py")
    plain.EPOCHS = hydra.EPOCHS = 1
    expected = plain.main(n_trials=3, n_jobs=1)
    got = hydra.main(n_trials=3, n_jobs=1)
    assert got == expected
    assert len({str(t[2]) for t in got}) == 3   # three different trials, compared one by one


def test_tune_example_pair_gives_equal_trials(local_ray):
    pytest.importorskip("sklearn")
    from ray import cloudpickle

    plain, hydra = _load("tune_mnist_plain.py"), _load("tune_mnist_hydra.py")
    for module in (plain, hydra):
        cloudpickle.register_pickle_by_value(module)   # the trial processes cannot import examples/adopt
    big = os.environ.get("HYDRA_TUNE_EXAMPLES") == "1"   # the larger search; by default 2 trials x 1 epoch
    samples, epochs = (3, 2) if big else (2, 1)
    expected = plain.main(num_samples=samples, epochs=epochs, max_concurrent=1)
    got = hydra.main(num_samples=samples, epochs=epochs, max_concurrent=1)
    # ASHA may stop a trial at a different epoch when reports arrive in another order: compare what both reported
    assert [(lr, m) for lr, m, _ in got] == [(lr, m) for lr, m, _ in expected]
    for (_, _, acc), (_, _, ref) in zip(got, expected):
        n = min(len(acc), len(ref))
        assert n >= 1 and acc[:n] == ref[:n]
