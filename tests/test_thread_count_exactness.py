"""The runtime's threads compute with the process's intra-op thread count (device/threads.py adopt_thread_count).
OpenMP's count is per thread: a thread the runtime started kept the library's default (every core) for MKL's FFT,
which torch does not start through its own parallel loops, and a two-thread FFT rounds otherwise than the plain
loop's one-thread FFT (the test session runs at one thread, tests/conftest.py)."""
from __future__ import annotations

import threading

import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, plain_train

import hydra_tune as ht
from hydra_tune.device.threads import adopt_thread_count


class Spectral(nn.Module):
    """A learned filter in the frequency domain (FNO-style): rfft, a complex weight, irfft."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width
        self.weight = nn.Parameter(torch.randn(width // 2 + 1, dtype=torch.cfloat) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.irfft(torch.fft.rfft(x, dim=-1) * self.weight, n=self.width, dim=-1) + x


def _task() -> ht.ModelTask:
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(3)]
    return ht.ModelTask(lambda: nn.Sequential(nn.Linear(16, 64), Spectral(64), nn.GELU(), nn.Linear(64, 4)),
                        lambda m: torch.optim.SGD(m.parameters(), lr=0.1), data,
                        loss=lambda out, b: F.cross_entropy(out, b[1]), epochs=1, seed=3, name="spectral")


def test_an_fft_model_trains_as_the_plain_loop_in_every_runtime():
    # before: the first runtime of a process matched, later ones ended 1e-8 off (their device threads' first FFT
    # ran at OpenMP's default count)
    want, _ = plain_train(_task())
    for _ in range(3):
        with ht.Runtime(devices=["cpu"]) as rt:
            handle = rt.submit(_task())
            handle.result()
        assert max_param_diff(want, handle.model()) == 0.0


def test_a_new_thread_takes_the_process_count_for_its_fft():
    x = torch.randn(32, 64)
    want = torch.fft.rfft(x, dim=-1)
    got: dict[str, torch.Tensor] = {}

    def run() -> None:
        adopt_thread_count()
        got["fft"] = torch.fft.rfft(x, dim=-1)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert torch.get_num_threads() == 1 and torch.equal(got["fft"], want)
