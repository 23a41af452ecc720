"""Shared pieces of the speed benchmarks p1..p4: GPT-2 factory, data, plain loop, hydra runs, timing, output.

    args = setup(__doc__)            # torch.set_num_threads(1); --quick, --json, --trace, --repeats; args.size
    spec = Spec("a", gpt2_factory(args.size), 1e-3, 0, token_batches(args.size), args.size.epochs)
    runs = alternate({"hydra": lambda: hydra_run([spec], 1, None), "plain": lambda: plain_run([spec])}, 3)

Timing. Every run gets its own ``TimedData`` per task: a list of batches that stamps ``time.perf_counter()`` each
time the training loop fetches a batch, one list per pass. Two numbers per run:
  * total: all samples of all tasks / wall time of the whole run (runtime start, model build, planning, every
    epoch, shutdown; for the plain loop model build + every epoch);
  * steady: samples/s after the first epoch, from the fetch stamps. One task: (batches fetched after the first
    batch of epoch 2) / (time from that fetch to the last fetch): whole batches (incl. optimizer step) only.
    Concurrent tasks: the window from the moment every task has started epoch 2 to the moment the first task
    fetches its last batch (all tasks running), batches fetched inside it, summed over tasks. Tasks run one
    after another (``sequential=True``): per-task steady batches summed over per-task windows summed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn

import hydra_tune as ht

Batch = dict[str, torch.Tensor]
Result = dict[str, Any]


@dataclass(frozen=True)
class Size:
    n_layer: int
    n_embd: int
    n_head: int
    vocab: int
    seq: int
    batch: int
    batches: int = 6   # per epoch
    epochs: int = 3    # epoch 1 is the in-run warm-up; steady state is measured over the rest

    def label(self) -> str:
        return (f"GPT-2 {self.n_layer}x{self.n_embd} (heads {self.n_head}, vocab {self.vocab}), seq {self.seq}, "
                f"batch {self.batch}, {self.batches} batches x {self.epochs} epochs")


DEFAULT = Size(4, 256, 4, 4096, 128, 8)
QUICK = Size(4, 128, 4, 2048, 64, 8, batches=4, epochs=3)


def setup(doc: str, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """One intra-op thread (one core per CPU device, baselines too), then the common command line."""
    torch.set_num_threads(1)
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small model and few batches (a smoke test, < 40 s)")
    p.add_argument("--json", metavar="PATH", help="also write the final JSON line to PATH")
    p.add_argument("--trace", metavar="PATH", help="after the timed runs, run hydra once more and save its trace "
                   "(Chrome/Perfetto JSON; needs Runtime.trace)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per side (default 3, --quick 2)")
    if extra:
        extra(p)
    args = p.parse_args()
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.size = QUICK if args.quick else DEFAULT
    args.loadavg = os.getloadavg()
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs; per run below: "
          "cores = this process's CPU s / wall, others = other processes' busy cores (/proc/stat)")
    return args


def gpt2_factory(size: Size, dropout: float = 0.1) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.utils import logging

        logging.set_verbosity_error()
        return GPT2LMHeadModel(GPT2Config(
            n_layer=size.n_layer, n_embd=size.n_embd, n_head=size.n_head, vocab_size=size.vocab,
            n_positions=size.seq, bos_token_id=0, eos_token_id=0,
            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout))
    return make


def token_batches(size: Size, seed: int = 0) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, size.vocab, (size.batches, size.batch, size.seq), generator=g)
    return [{"input_ids": b.clone(), "labels": b.clone()} for b in ids]


def adamw(lr: float) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return lambda model: torch.optim.AdamW(model.parameters(), lr=lr)


class TimedData:
    """The batches, iterable once per epoch; records when each batch is fetched (one list per pass)."""

    def __init__(self, batches: Sequence[Batch]) -> None:
        self.batches: list[Batch] = list(batches)
        self.passes: list[list[float]] = []

    def __iter__(self) -> Iterator[Batch]:
        stamps: list[float] = []
        self.passes.append(stamps)
        for b in self.batches:
            stamps.append(time.perf_counter())
            yield b

    def __len__(self) -> int:
        return len(self.batches)


@dataclass(frozen=True)
class Spec:
    """One training job: the same on every side of a comparison."""

    name: str
    factory: Callable[[], nn.Module]
    lr: float
    seed: int
    batches: list[Batch]
    epochs: int

    def task(self, data: TimedData) -> ht.ModelTask:
        return ht.ModelTask(self.factory, adamw(self.lr), data, epochs=self.epochs, seed=self.seed, name=self.name)


def steady_rate(datas: Sequence[TimedData], epochs: int, sequential: bool = False) -> float:
    """Samples/s after epoch 1 (see the module docstring). Needs epochs >= 2."""
    passes = [d.passes[-epochs:] for d in datas]  # hydra's planner fetches one sample batch first: skip it
    size = datas[0].batches[0]["input_ids"].shape[0]
    if not sequential:
        t_a, t_b = max(p[1][0] for p in passes), min(p[-1][-1] for p in passes)
        if t_b > t_a:
            n = sum(1 for p in passes for stamps in p[1:] for s in stamps if t_a < s <= t_b)
            return n * size / (t_b - t_a)
    n = sum(sum(len(s) for s in p[1:]) - 1 for p in passes)
    return n * size / sum(p[-1][-1] - p[1][0] for p in passes)


Clock = tuple[float, float, int, int]


def machine() -> Clock:
    """Now: wall, this process's CPU seconds, the machine's busy and total jiffies (/proc/stat; 0, 0 if absent)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        v = [0] * 5
    return time.perf_counter(), time.process_time(), sum(v) - v[3] - v[4], sum(v)


def summary(datas: Sequence[TimedData], epochs: int, start: Clock, sequential: bool = False) -> Result:
    """cores: this process's CPU seconds / wall; others: the other processes' busy cores over the run."""
    end = machine()
    wall, cores = end[0] - start[0], (end[1] - start[1]) / (end[0] - start[0])
    samples = sum(len(d) * d.batches[0]["input_ids"].shape[0] * epochs for d in datas)
    busy = (end[2] - start[2]) / max(end[3] - start[3], 1) * (os.cpu_count() or 1)
    return {"wall_s": wall, "samples": samples, "total_sps": samples / wall, "cores": cores,
            "others": max(0.0, busy - cores), "steady_sps": steady_rate(datas, epochs, sequential)}


def plain_train(spec: Spec, data: TimedData) -> float:
    """The plain PyTorch loop (tests/reference.py's plain_train): seed, build, AdamW, fwd, bwd, step, zero_grad.
    Returns the last epoch's mean loss."""
    torch.manual_seed(spec.seed)
    model = spec.factory()
    model.train()
    opt = adamw(spec.lr)(model)
    losses: list[float] = []
    for _ in range(spec.epochs):
        losses = []
        for batch in data:
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return sum(losses) / len(losses)


def plain_run(specs: Sequence[Spec], threads: int = 1) -> Result:
    """The specs trained with the plain loop: one after another in this thread, or dealt round-robin to
    ``threads`` threads (each trains its share one after another; steady = sum of the threads' steady rates)."""
    datas = [TimedData(s.batches) for s in specs]
    losses: list[float] = [0.0] * len(specs)

    def train(idx: list[int]) -> None:
        for i in idx:
            losses[i] = plain_train(specs[i], datas[i])

    shares = [list(range(t, len(specs), threads)) for t in range(threads)]
    pool = [threading.Thread(target=train, args=(idx,)) for idx in shares[1:]]
    start = machine()
    for th in pool:
        th.start()
    train(shares[0])  # the first share in this thread
    for th in pool:
        th.join()
    res = summary(datas, specs[0].epochs, start, sequential=True)
    res["steady_sps"] = sum(steady_rate([datas[i] for i in idx], specs[0].epochs, True) for idx in shares)
    res["final_loss"] = losses
    return res


def make_runtime(devices: int, budget: int | None) -> ht.Runtime:
    try:
        return ht.Runtime(devices=["cpu"] * devices, device_memory=budget, policy="lrtf")
    except Exception:  # a runtime without the "lrtf" policy: its default
        return ht.Runtime(devices=["cpu"] * devices, device_memory=budget)


def hydra_run(specs: Sequence[Spec], devices: int, budget: int | None, trace: str | None = None) -> Result:
    """All specs submitted at once to one runtime with ``devices`` CPU devices and ``budget`` bytes each."""
    datas = [TimedData(s.batches) for s in specs]
    start = machine()
    with make_runtime(devices, budget) as rt:
        handles = [rt.submit(s.task(d)) for s, d in zip(specs, datas)]
        t_planned = time.perf_counter() - start[0]
        finals = [h.result() for h in handles]
        stats = rt.stats()
        if trace and hasattr(rt, "trace"):
            rt.trace().save(trace)
    res = summary(datas, specs[0].epochs, start)
    first = stats["tasks"][specs[0].name]
    res.update(submit_s=t_planned, final_loss=[m["train_loss"] for m in finals], plan=first["shards"],
               shards=[len(stats["tasks"][s.name]["shards"]) for s in specs],
               predicted_peak=first.get("predicted_peak"), kept=first.get("kept"), offloaded=first.get("offloaded"),
               devices=[{"units": d.get("units"), "busy_seconds": d["busy_seconds"], "peak_bytes": d["peak_bytes"],
                         "budget": d["budget"], "busy_share": d["busy_seconds"] / res["wall_s"]}
                        for d in stats["devices"]])
    return res


def alternate(sides: dict[str, Callable[[], Result]], repeats: int) -> dict[str, list[Result]]:
    """Run every side ``repeats`` times in A B B A A B ... order (drift hits both sides alike)."""
    out: dict[str, list[Result]] = {k: [] for k in sides}
    names = list(sides)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            res = sides[name]()
            out[name].append(res)
            print(f"  {name:<24} run {r + 1}: steady {res['steady_sps']:7.2f} samples/s, total {res['total_sps']:7.2f}"
                  f" samples/s, wall {res['wall_s']:6.2f} s, cores {res['cores']:.2f} (others {res['others']:.2f})",
                  flush=True)
    busy = max(median(rs, "others") for rs in out.values())
    if busy > 0.25:
        print(f"note: other processes kept {busy:.2f} of {os.cpu_count()} cores busy during one side's runs (median):"
              " these numbers are contended, rerun on a quiet machine")
    return out


def median(runs: Sequence[Result], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(headers, widths))))
    for r in cells:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))


def side_rows(runs: dict[str, list[Result]]) -> list[list[Any]]:
    """One table row per side: medians of steady and total samples/s, wall, and every run's steady value."""
    return [[name, *(median(rs, k) for k in ("steady_sps", "total_sps", "wall_s", "cores", "others")),
             " ".join(f"{r['steady_sps']:.1f}" for r in rs)] for name, rs in runs.items()]


SIDE_HEADERS = ("side", "steady sps", "total sps", "wall s", "cores used", "others' cores", "steady per run")


def find_budget(factory: Callable[[], nn.Module], batch: Batch, min_shards: int, steps: int = 7) -> tuple[int, int]:
    """-> (budget, shards): by bisection, a budget whose plan has >= min_shards shards while a budget 1/2**steps of
    the unsharded peak larger has fewer (the largest such if shards fall as the budget grows; hydra_tune's planner
    need not be monotone), else the smallest budget that plans at all. Probes via submit + stats()."""

    def probe(budget: int | None) -> tuple[int, int] | None:  # (shards, predicted peak), None: no plan fits
        with make_runtime(1, budget) as rt:
            try:
                h = rt.submit(ht.ModelTask(factory, adamw(1e-3), [batch], epochs=1, seed=0, name="probe"))
            except ht.PlanError:
                return None
            st = rt.stats()["tasks"]["probe"]
            h.cancel()
            return len(st["shards"]), int(st["predicted_peak"])

    whole = probe(None)
    assert whole is not None
    fail, few, few_shards = 0, whole[1], 1  # no plan fits at `fail`; `few` plans < min_shards shards
    good, shards = 0, 0                     # `good` plans >= min_shards shards (0: none found yet)
    while few - max(fail, good) > whole[1] >> steps:
        b = (good + few) // 2 if good else int(few * 0.7) if not fail else (fail + few) // 2
        got = probe(b)
        if got is None:
            fail = b
        elif got[0] >= min_shards:
            good, shards = b, got[0]
        else:
            few, few_shards = b, got[0]
    if not good:
        print(f"note: at most {few_shards} shards (< {min_shards}) for any budget; using {mib(few)}")
        return few, few_shards
    return good, shards


def emit(results: Result, args: argparse.Namespace, t_start: float) -> None:
    """The final line: every raw number as JSON (also to --json)."""
    results["meta"] = {"size": asdict(args.size), "quick": args.quick, "repeats": args.repeats, "cpus": os.cpu_count(),
                       "torch": torch.__version__, "threads": torch.get_num_threads(), "loadavg_at_start": args.loadavg,
                       "loadavg_at_end": os.getloadavg(), "script_wall_s": time.perf_counter() - t_start}
    write_line(results, args.json)


def write_line(results: dict, path: str | None, total_s: float | None = None) -> None:
    """Print ``results`` as one JSON line (after ``total N s`` when ``total_s`` is given), also to ``path``."""
    line = json.dumps(results, default=str)
    if path:
        with open(path, "w") as f:
            f.write(line + "\n")
    if total_s is not None:
        print(f"\ntotal {total_s:.0f} s")
    print(line)
