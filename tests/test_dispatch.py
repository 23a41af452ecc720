"""The task RNG stream and the CPU devices' memory accounting."""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from hydra_tune.device.dispatch import MemoryAccount, UnitMode, paused_accounting


def _draws() -> list[torch.Tensor]:
    x = torch.ones(64, 64)
    return [F.dropout(x, 0.3), torch.randn(5), torch.rand_like(x[0]), torch.randperm(10).float(),
            torch.empty(3).normal_(), torch.multinomial(torch.ones(10), 4).float()]


def test_task_stream_equals_manual_seed_and_leaves_global_alone():
    torch.manual_seed(7)
    expected = _draws()
    torch.manual_seed(123)
    global_before = torch.default_generator.get_state()
    with UnitMode(torch.Generator().manual_seed(7)):
        got = _draws()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert torch.equal(torch.default_generator.get_state(), global_before)


def test_threads_draw_from_their_own_streams_concurrently():
    torch.manual_seed(1)
    expected = [_draws() for _ in range(20)]
    results: dict[int, list] = {}

    def worker(i: int) -> None:
        with UnitMode(torch.Generator().manual_seed(1)):
            results[i] = [_draws() for _ in range(20)]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(3):
        for exp, got in zip(expected, results[i]):
            assert all(torch.equal(a, b) for a, b in zip(exp, got))


def test_accounting_counts_new_storages_until_freed():
    acct = MemoryAccount()
    host = torch.ones(1000)
    with UnitMode(torch.Generator(), acct) as mode:
        a = host.clone()                 # 4000 bytes
        view = a[:10]                    # no new storage
        a.add_(1)                        # in place: nothing new
        b = a * 2                        # 4000 more
        with paused_accounting(mode):
            c = a + 1                    # host memory: not the device's
        assert acct.current == 8000
        del b
        assert acct.current == 4000
    del a, view, c
    assert acct.current == 0 and acct.peak == 8000
