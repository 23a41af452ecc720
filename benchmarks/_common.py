"""Shared pieces of the speed benchmarks p1..p4: GPT-2 factory, data, plain loop, hydra runs, timing, output.

    from _common import setup, DEFAULT, gpt2_factory, token_batches, hydra_run, plain_run, alternate, emit
    args = setup(__doc__)            # torch.set_num_threads(1); --quick, --json, --trace, --repeats

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
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn as nn

import hydra_tune as ht

LOAD_AT_IMPORT = os.getloadavg()
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
    p.add_argument("--trace", metavar="PATH", help="save the last timed hydra run's trace (if the runtime has one)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per side (default 3, --quick 2)")
    if extra:
        extra(p)
    args = p.parse_args()
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.size = QUICK if args.quick else DEFAULT
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs (others' work "
          "shows here; 'cores used' below is this process's CPU seconds / wall)")
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
        self.batches, self.passes = list(batches), []  # type: list[Batch], list[list[float]]

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


def _summary(datas: Sequence[TimedData], epochs: int, wall: float, cpu: float, sequential: bool = False) -> Result:
    """``cpu``: this process's CPU seconds over the run; cores = cpu / wall shows what the machine let us use."""
    samples = sum(len(d) * d.batches[0]["input_ids"].shape[0] * epochs for d in datas)
    return {"wall_s": wall, "samples": samples, "total_sps": samples / wall, "cores": cpu / wall,
            "steady_sps": steady_rate(datas, epochs, sequential)}


def plain_train(spec: Spec, data: TimedData) -> list[float]:
    """The plain PyTorch loop (as tests/reference.py's plain_train): seed, build, AdamW, fwd/bwd/step/zero_grad."""
    torch.manual_seed(spec.seed)
    model = spec.factory()
    model.train()
    opt = adamw(spec.lr)(model)
    history = []
    for _ in range(spec.epochs):
        losses = []
        for batch in data:
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        history.append(sum(losses) / len(losses))
    return history


def plain_run(specs: Sequence[Spec], threads: int = 1) -> Result:
    """The specs trained with the plain loop: one after another in this thread, or dealt round-robin to
    ``threads`` threads (each trains its share one after another; steady = sum of the threads' steady rates)."""
    datas = [TimedData(s.batches) for s in specs]
    losses: list[float] = [0.0] * len(specs)

    def train(idx: list[int]) -> None:
        for i in idx:
            losses[i] = plain_train(specs[i], datas[i])[-1]

    shares = [list(range(t, len(specs), threads)) for t in range(threads)]
    t0, c0 = time.perf_counter(), time.process_time()
    if threads == 1:
        train(shares[0])
    else:
        pool = [threading.Thread(target=train, args=(idx,)) for idx in shares]
        for th in pool:
            th.start()
        for th in pool:
            th.join()
    res = _summary(datas, specs[0].epochs, time.perf_counter() - t0, time.process_time() - c0, sequential=True)
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
    t0, c0 = time.perf_counter(), time.process_time()
    with make_runtime(devices, budget) as rt:
        handles = [rt.submit(s.task(d)) for s, d in zip(specs, datas)]
        t_planned = time.perf_counter()
        finals = [h.result() for h in handles]
        stats = rt.stats()
        if trace and hasattr(rt, "trace"):
            rt.trace().save(trace)
    wall = time.perf_counter() - t0
    res = _summary(datas, specs[0].epochs, wall, time.process_time() - c0)
    res.update(submit_s=t_planned - t0, final_loss=[m["train_loss"] for m in finals],
               shards=[len(stats["tasks"][s.name]["shards"]) for s in specs],
               plan=stats["tasks"][specs[0].name]["shards"],
               predicted_peak=stats["tasks"][specs[0].name].get("predicted_peak"),
               devices=[{k: d.get(k) for k in ("units", "busy_seconds", "peak_bytes", "budget")}
                        for d in stats["devices"]])
    for d in res["devices"]:
        d["busy_share"] = d["busy_seconds"] / wall
    return res


def alternate(sides: dict[str, Callable[[], Result]], repeats: int) -> dict[str, list[Result]]:
    """Run every side ``repeats`` times in A B B A A B ... order (drift hits both sides alike)."""
    out: dict[str, list[Result]] = {k: [] for k in sides}
    names = list(sides)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            out[name].append(sides[name]())
            print(f"  {name:<22} run {r + 1}: steady {out[name][-1]['steady_sps']:7.2f} samples/s, "
                  f"total {out[name][-1]['total_sps']:7.2f} samples/s, wall {out[name][-1]['wall_s']:6.2f} s, "
                  f"cores {out[name][-1]['cores']:.2f}",
                  flush=True)
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
    return [[name, median(rs, "steady_sps"), median(rs, "total_sps"), median(rs, "wall_s"), median(rs, "cores"),
             " ".join(f"{r['steady_sps']:.1f}" for r in rs)] for name, rs in runs.items()]


SIDE_HEADERS = ("side", "steady sps", "total sps", "wall s", "cores used", "steady per run")


def find_budget(factory: Callable[[], nn.Module], batch: Batch, min_shards: int, steps: int = 7) -> tuple[int, int]:
    """The largest budget (bytes, to ~1/2**steps of the unsharded peak) whose plan has >= ``min_shards`` shards,
    found through the public API (submit, read ``stats()``); else the budget with the most shards. -> (budget,
    shards)."""

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
    fail, few, few_shards = 0, whole[1], 1   # no plan fits at `fail`; `few` plans < min_shards shards
    good, shards = None, 0
    for _ in range(3 * steps):               # find any budget with >= min_shards shards
        b = int(few * 0.7) if fail == 0 else (fail + few) // 2
        got = probe(b)
        if got is None:
            fail = b
        elif got[0] >= min_shards:
            good, shards = b, got[0]
            break
        else:
            few, few_shards = b, got[0]
        if few - fail < few >> steps:
            break
    if good is None:
        print(f"note: at most {few_shards} shards (< {min_shards}) for any budget; using {mib(few)}")
        return few, few_shards
    for _ in range(steps):                   # the largest such budget: bisect between good and few
        mid = (good + few) // 2
        got = probe(mid)
        if got is not None and got[0] >= min_shards:
            good, shards = mid, got[0]
        else:
            few = mid
    return good, shards


def emit(results: Result, args: argparse.Namespace, t_start: float) -> None:
    """The final line: every raw number as JSON (also to --json)."""
    results["meta"] = {"loadavg_at_start": LOAD_AT_IMPORT, "size": asdict(args.size), "quick": args.quick, "repeats": args.repeats,
                       "torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                       "loadavg_at_end": os.getloadavg(), "script_wall_s": time.perf_counter() - t_start}
    line = json.dumps(results)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    print(line)


__all__ = ["Size", "DEFAULT", "QUICK", "setup", "gpt2_factory", "token_batches", "adamw", "TimedData", "Spec",
           "steady_rate", "plain_train", "plain_run", "hydra_run", "make_runtime", "alternate", "median", "mib",
           "print_table", "side_rows", "SIDE_HEADERS", "find_budget", "emit", "replace"]
