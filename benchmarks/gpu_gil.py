"""How many GPUs one runtime process can keep busy: the Python time per minibatch that holds the GIL, per device.

    python benchmarks/gpu_gil.py                 # one CUDA device: GPT-2 small and medium, fp32 and bf16
    python benchmarks/gpu_gil.py --cpu           # dry run: small GPT-2s on a CPU stand-in (< 1 min)
    python benchmarks/gpu_gil.py --json gil.json

One runtime feeds every device of a node from Python threads that share one GIL: a device's worker launches its
kernels from Python, its copy thread issues copies, each task's host thread steps and reads data. For each model
(GPT-2 small 12x768 and medium 24x1024, seq 512, fp32 and bf16; --cpu: 2x64 and 4x128, seq 32) it measures on one
device, after warm-up minibatches:

* ``gil_ms``: CPU time of the runtime's Python threads (hydra-*: worker, copy, host threads) per minibatch, read
  from each thread's CPU clock while it runs. Python bytecode and kernel launches run with the GIL held; the CUDA
  autograd engine's backward thread is a C++ thread and not counted (it takes the GIL only for Python hooks), so
  this is the GIL-held time per minibatch, up to the few C++ calls that release it;
* ``device_ms``: the plain PyTorch loop's time per minibatch on the device, the device time one minibatch needs;
* ``feeds``: how many such devices one process keeps busy (>= 90% of their time). From ``hydra_tune.simulate``:
  D devices with D tasks of 20 minibatches of ``device_ms`` each give the devices' makespan; the GIL serialises
  D x 20 x ``gil_ms`` of Python time, and a device cannot run faster than max(device_ms, gil_ms) per minibatch;
  the largest D (up to 16) whose makespan is within 10% of the GIL-bound one is printed ("0 (GIL)": the Python
  time of one device's minibatch alone exceeds its device time, so not even one device is kept busy).

On a CPU stand-in the "device" time is itself CPU time in the same process, so the numbers show the structure,
not a GPU's answer. Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any

import torch
from _common import Size, write_line
from _perf import Case, Steps, TimedData, adamw, batches, clean, gpt2_factory, plain_loop, steady_sps

import hydra_tune as ht
from hydra_tune.sim.simulator import SimTask, SimUnit

GPU_SIZES = {"small": Size(12, 768, 12, 50257, 512, 8), "medium": Size(24, 1024, 16, 50257, 512, 4)}
CPU_SIZES = {"2x64": Size(2, 64, 2, 256, 32, 2), "4x128": Size(4, 128, 4, 512, 32, 2)}
BUSY = 0.90     # a device counts as kept busy at this share of its time
MAX_DEVICES = 16
SIM_STEPS = 20  # minibatches per simulated task


class ThreadClocks:
    """Samples the CPU clocks of this process's threads whose name starts with ``prefix`` (every ``every`` s), so
    a thread that ended (a task's host thread) still counts with its last reading."""

    def __init__(self, prefix: str = "hydra", every: float = 0.01) -> None:
        self.prefix, self.every = prefix, every
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gil-sampler", daemon=True)

    def _sample(self) -> None:
        for t in threading.enumerate():
            if t.name.startswith(self.prefix) and t.ident is not None:
                try:
                    self._last[t.ident] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
                except (OSError, ProcessLookupError):  # ended between enumerate and the read
                    pass

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def total(self) -> float:
        """CPU seconds of the sampled threads so far."""
        self._sample()
        return sum(self._last.values())

    def __enter__(self) -> ThreadClocks:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def hydra_gil(case: Case, device: str, steps: Steps) -> dict[str, float]:
    """One task on one device: Python-thread CPU seconds and wall seconds per steady minibatch."""
    clean(device)
    with ht.Runtime(devices=[device], device_memory=None) as rt, ThreadClocks() as clocks:
        warm = TimedData(batches(case.size, Steps(steps.warm, 0), 1))
        rt.submit(ht.ModelTask(gpt2_factory(case.size, case.dropout), adamw, warm, seed=1,
                               precision=case.precision, name="warm")).result()
        data = TimedData(batches(case.size, Steps(0, steps.steady), 2))
        cpu0, t0 = clocks.total(), time.perf_counter()
        rt.submit(ht.ModelTask(gpt2_factory(case.size, case.dropout), adamw, data, seed=2,
                               precision=case.precision, name="measured")).result()
        cpu1, t1 = clocks.total(), time.perf_counter()
    # the measured task's build (in this thread) is outside the sampled threads; its wall time is not
    first = data.passes[-1][0] if data.passes and data.passes[-1] else t0
    n = steps.steady
    return {"gil_s": (cpu1 - cpu0) / n, "wall_s": (t1 - first) / n}


def plain_seconds(case: Case, device: str, steps: Steps) -> float:
    clean(device)
    stamps = plain_loop(case, device, batches(case.size, steps, 3), 3, time.perf_counter)
    sps = steady_sps([stamps], steps.warm, case.size.batch)
    return case.size.batch / sps


def devices_fed(gil_s: float, device_s: float) -> tuple[int, list[dict[str, float]]]:
    """The largest device count one process keeps >= BUSY busy, from ``simulate`` (module docstring)."""
    rows, fed = [], 0
    for d in range(1, MAX_DEVICES + 1):
        tasks = [SimTask(f"t{i}", tuple(SimUnit("L", 0, device_s, segment=s) for s in range(SIM_STEPS)))
                 for i in range(d)]
        devices_only = ht.simulate(tasks, devices=d).makespan
        with_gil = max(devices_only, d * SIM_STEPS * gil_s, SIM_STEPS * max(device_s, gil_s))
        busy = devices_only / with_gil
        rows.append({"devices": d, "busy": busy})
        if busy >= BUSY:
            fed = d
    return fed, rows


def measure(device: str, cpu: bool, steps: Steps) -> list[dict[str, Any]]:
    sizes = CPU_SIZES if cpu else GPU_SIZES
    out = []
    for label, size in sizes.items():
        for precision in ("fp32", "bf16"):
            case = Case(f"{label} {precision}", size, precision, dropout=0.1)
            print(f"  {case.name}: {size.label()}", flush=True)
            try:
                hydra = hydra_gil(case, device, steps)
                device_s = plain_seconds(case, device, steps)
            except Exception as exc:  # noqa: BLE001  (reported; the other models still run)
                out.append({"model": label, "precision": precision, "error": f"{type(exc).__name__}: {exc}"[:300]})
                print(f"    FAILED {out[-1]['error']}")
                continue
            fed, _rows = devices_fed(hydra["gil_s"], device_s)
            out.append({"model": label, "precision": precision, "gil_ms": 1e3 * hydra["gil_s"],
                        "hydra_ms": 1e3 * hydra["wall_s"], "device_ms": 1e3 * device_s,
                        "gil_share": hydra["gil_s"] / device_s, "feeds": fed})
    return out


def report(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'model':<8} {'prec':<5} {'GIL ms/mb':>10} {'hydra ms/mb':>12} {'device ms/mb':>13} {'GIL/device':>11} "
          f"{'GPUs fed':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<8} {r['precision']:<5} failed: {r['error'][:60]}")
            continue
        fed = {0: "0 (GIL)", MAX_DEVICES: f">={MAX_DEVICES}"}.get(r["feeds"], str(r["feeds"]))  # 0: not even one
        print(f"{r['model']:<8} {r['precision']:<5} {r['gil_ms']:>10.1f} {r['hydra_ms']:>12.1f} "
              f"{r['device_ms']:>13.1f} {r['gil_share']:>11.2f} {fed:>9}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="dry run on a CPU stand-in, small sizes")
    p.add_argument("--warm", type=int, default=3, help="warm-up minibatches (default 3)")
    p.add_argument("--steps", type=int, default=None, help="measured minibatches (default 10; --cpu 6)")
    p.add_argument("--json", metavar="PATH", help="also write the JSON line to PATH")
    args = p.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: skipped (use --cpu for a dry run)")
        print(json.dumps({"benchmark": "gpu_gil", "skipped": "no CUDA device"}))
        return 0
    if args.cpu:
        torch.set_num_threads(1)
    device = "cpu" if args.cpu else "cuda:0"
    steps = Steps(args.warm, args.steps or (6 if args.cpu else 10))
    t0 = time.perf_counter()
    name = "CPU stand-in" if args.cpu else torch.cuda.get_device_name(0)
    print(f"gpu_gil on {name}: torch {torch.__version__}, hydra_tune {ht.__version__}; {steps.warm} warm-up + "
          f"{steps.steady} measured minibatches per model")
    rows = measure(device, args.cpu, steps)
    report(rows)
    out = {"benchmark": "gpu_gil", "device": device, "device_name": name, "torch": torch.__version__,
           "rows": rows, "busy": BUSY, "seconds": time.perf_counter() - t0}
    write_line(out, args.json, out["seconds"])
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
