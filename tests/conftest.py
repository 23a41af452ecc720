"""Shared fixtures: tiny real models (transformers GPT-2 with random init) and their data."""
from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)  # each CPU device uses one core, as the runtime's workers do


def gpt2_config(**overrides):
    from transformers import GPT2Config

    kw = dict(n_layer=4, n_embd=32, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0,
              resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    kw.update(overrides)
    return GPT2Config(**kw)


def make_gpt2(**overrides):
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    return GPT2LMHeadModel(gpt2_config(**overrides))


def lm_batches(n: int, batch: int = 4, seq: int = 16, vocab: int = 128, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


@contextlib.contextmanager
def node_sandbox(prefix: str, linger: str, pids: list[int] | None = None):
    """A private directory for a test's node servers (``HYDRA_TUNE_NODE_DIR``, in /tmp: socket paths are limited
    to 107 bytes) with ``HYDRA_TUNE_NODE_LINGER`` = ``linger``; yields (directory, ``pids``), the list the test
    adds its servers' pids to. After: each of those still alive gets SIGTERM, all must be gone within 15 s, and
    the directory goes."""
    import shutil
    import signal
    import tempfile
    import time

    base, pids = tempfile.mkdtemp(prefix=prefix, dir="/tmp"), pids if pids is not None else []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HYDRA_TUNE_NODE_DIR", base)
        mp.setenv("HYDRA_TUNE_NODE_LINGER", linger)
        yield base, pids
    for pid in pids:
        if process_alive(pid):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    shutil.rmtree(base, ignore_errors=True)
    assert not any(process_alive(p) for p in pids), "a node server outlived the tests"


def process_alive(pid: int) -> bool:
    """The process runs (exists and is not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(autouse=True)
def _quiet_transformers():
    try:
        from transformers.utils import logging
    except ImportError:
        return
    logging.set_verbosity_error()


# -- `make test` runs the suite on 2 workers (pytest-xdist, --dist loadgroup), then the `serial` tests alone ----------
# A test whose assertion depends on having the machine to itself (a measured makespan, thread counts against the
# cores) carries `pytest.mark.serial`: the Makefile runs those in a second pytest call, after the parallel one.
# Every Ray test joins the xdist group "ray": one worker runs them all, one after another, on one local Ray; the
# other tests are grouped by file.
SERIAL_REASON = "needs the machine to itself: `make test` runs it alone, after the parallel run"


class _Groups:
    """Puts every test that takes `local_ray` or carries `pytest.mark.ray` in the xdist group "ray", and every other
    test in its file's group: a file's tests run on one worker in their order, as in a plain run (module fixtures
    such as test_node.py's node server are shared by them, and set up once)."""

    @pytest.hookimpl(tryfirst=True)   # before xdist names the groups (and before -m deselects)
    def pytest_collection_modifyitems(self, items):
        for item in items:
            if "local_ray" in getattr(item, "fixturenames", ()) or item.get_closest_marker("ray"):
                item.add_marker(pytest.mark.xdist_group("ray"))
            else:
                item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def pytest_configure(config):
    config.addinivalue_line("markers", f"serial: {SERIAL_REASON}")
    config.addinivalue_line("markers", "ray: starts a Ray cluster of its own; runs in the xdist group of the Ray tests")
    if not config.pluginmanager.hasplugin("xdist"):   # pytest -p no:xdist, or xdist not installed
        config.addinivalue_line("markers", "xdist_group(name): the tests pytest-xdist runs on one worker")
    config.pluginmanager.register(_Groups(), "hydra_tune_xdist_groups")


# -- one local Ray for every test that asks for it ------------------------------------------------------------
# Starting a local Ray costs 5-14 s on 2 busy cores: the Ray tests of all modules share one, run one after another
# (the collection hook below groups them), and it is shut down as soon as the last of them ends.
_LAST_RAY_TEST = pytest.StashKey[str]()


def _xdist_group_ids(items) -> None:
    """pytest-xdist (3.8) names a test's group by appending "@group" to ``item._nodeid``, which pytest >= 9 no longer
    reads (its node ids live in ``item._id``): without this, --dist loadgroup sends every test alone, the Ray tests
    to both workers (two local Rays on 2 cores). A no-op where xdist's renaming took (older pytest) or did not run."""
    from _pytest.nodeid import coerce_node_id

    for item in items:
        meant = item.__dict__.get("_nodeid")
        if isinstance(meant, str) and meant != item.nodeid and hasattr(item, "_id"):
            item._id = coerce_node_id(meant)


@pytest.hookimpl(trylast=True)   # after -k/-m deselection: the last Ray test is one that runs
def pytest_collection_modifyitems(config, items):
    if config.getvalue("loadgroup") if hasattr(config.option, "loadgroup") else False:   # an xdist worker
        _xdist_group_ids(items)
    ray_tests = [item for item in items if "local_ray" in getattr(item, "fixturenames", ())]
    if not ray_tests:
        return
    grouped = {id(item) for item in ray_tests}
    first = next(i for i, item in enumerate(items) if id(item) in grouped)
    rest = [item for item in items if id(item) not in grouped]
    items[:] = rest[:first] + ray_tests + rest[first:]
    config.stash[_LAST_RAY_TEST] = ray_tests[-1].nodeid


@pytest.fixture(scope="session")
def _ray_session():
    ray = pytest.importorskip("ray")
    yield ray
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def local_ray(_ray_session, request):
    """A local Ray with 2 CPUs, started by the first test that needs it and shared by the next ones; started again
    after a test that ran a cluster of its own (it shuts the shared one down first)."""
    ray = _ray_session
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if request.node.nodeid == request.config.stash.get(_LAST_RAY_TEST, None):
        ray.shutdown()
