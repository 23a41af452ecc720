"""The pieces of gpu_perf.py: one side's run (plain PyTorch in this process, hydra_tune through a Runtime, or plain
PyTorch in separate processes started together), steady samples/s from batch fetch stamps, peaks, counters.

    case = Case("12x768 fp32", FULL)
    res = run_plain(case, "cuda:0", Steps(5, 20))            # one task, this process
    res = run_hydra(case, "cuda:0", Steps(5, 20), budget)   # case.tasks tasks on one Runtime device
    res = run_prepared(case, "cuda:0", Steps(5, 20), budget) # the plain loop after hydra_tune.prepare
    res = run_processes(case, "cuda:0", Steps(5, 20), 4)     # 4 plain processes side by side
    res["steady_sps"], res["peak"], res["counters"]

Steady samples/s: every task trains warm + steady batches in one epoch; its fetch stamps (one per batch) after the
warm-up ones time whole steps (each step reads its loss, so the host waits for the device). Several tasks: the
window from the moment every task has begun its steady batches to the moment the first one fetched its last,
batches fetched inside it summed over tasks. Processes: the same over wall-clock stamps, all processes released
together once each has built its model and warmed up.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn
from _common import Size

import hydra_tune as ht

Batch = dict[str, torch.Tensor]
Result = dict[str, Any]
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
COUNTER_WORDS = ("bytes", "sync", "step", "evict", "resident", "path", "moved")


@dataclass(frozen=True)
class Steps:
    warm: int = 5
    steady: int = 20

    @property
    def total(self) -> int:
        return self.warm + self.steady


@dataclass(frozen=True)
class Case:
    """One configuration measured on both sides. ``tasks``: trained at once (hydra: one runtime; processes: one
    each). ``shards``: a device budget is chosen whose plan has this many shards; ``budget``: a fixed one."""

    name: str
    size: Size
    precision: str = "fp32"
    tasks: int = 1
    shards: int | None = None
    budget: int | None = None
    dropout: float = 0.1


def gpt2_factory(size: Size, dropout: float) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.utils import logging

        logging.set_verbosity_error()
        return GPT2LMHeadModel(GPT2Config(
            n_layer=size.n_layer, n_embd=size.n_embd, n_head=size.n_head, vocab_size=size.vocab,
            n_positions=max(size.seq, 64), bos_token_id=0, eos_token_id=0,
            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout))
    return make


def model_label(size: Size) -> str:
    return f"GPT-2 {size.n_layer}x{size.n_embd} (vocab {size.vocab}), seq {size.seq}, batch {size.batch}"


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def batches(size: Size, steps: Steps, seed: int) -> list[Batch]:
    """``steps.total`` batches cycling through 4 distinct ones (host memory stays small for large batches)."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, size.vocab, (size.batch, size.seq), generator=g) for _ in range(4)]
    return [{"input_ids": ids[i % 4], "labels": ids[i % 4]} for i in range(steps.total)]


class TimedData:
    """The batches, iterable once per epoch; stamps each fetch (one list per pass; the planner's peek is one)."""

    def __init__(self, data: Sequence[Batch]) -> None:
        self.data = list(data)
        self.passes: list[list[float]] = []

    def __iter__(self) -> Iterator[Batch]:
        stamps: list[float] = []
        self.passes.append(stamps)
        for b in self.data:
            stamps.append(time.perf_counter())
            yield b

    def __len__(self) -> int:
        return len(self.data)


def steady_sps(stamps: Sequence[Sequence[float]], warm: int, batch: int) -> float:
    """Aggregate samples/s of tasks with these fetch stamps, after ``warm`` batches each (module docstring)."""
    t_a, t_b = max(s[warm] for s in stamps), min(s[-1] for s in stamps)
    if t_b <= t_a:
        return float("nan")
    n = sum(1 for s in stamps for t in s[warm:] if t_a < t <= t_b)
    return n * batch / (t_b - t_a)


def cuda(device: str) -> bool:
    return device.startswith("cuda")


def clean(device: str) -> None:
    gc.collect()
    if cuda(device):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak(device: str) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if cuda(device) else None


# -- plain PyTorch ------------------------------------------------------------------------------------------
def plain_loop(case: Case, device: str, data: Sequence[Batch], seed: int, stamp: Callable[[], float],
               prepare: Callable[[nn.Module, torch.optim.Optimizer], Any] | None = None) -> list[float]:
    """The user's own loop on ``device``: AdamW, autocast for bf16/fp16 (a GradScaler for fp16); fetch stamps.
    ``prepare(model, optimizer) -> (model, optimizer)``: the loop over what it returns (``hydra_tune.prepare``: the
    model stays where it was built, and the precision is prepare's, not an autocast in the loop: a prepared model
    refuses a forward inside one it was not given)."""
    torch.manual_seed(seed)
    model = gpt2_factory(case.size, case.dropout)()
    if prepare is None:
        model = model.to(device)
    model.train()
    opt = adamw(model)
    dtype = AUTOCAST[case.precision]
    if prepare is not None:
        model, opt = prepare(model, opt)
        dtype = None
    scaler = torch.amp.GradScaler(device.split(":")[0]) if case.precision == "fp16" else None
    stamps = []
    for batch in data:
        stamps.append(stamp())
        batch = {k: t.to(device) for k, t in batch.items()}
        with torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype is not None):
            loss = model(**batch).loss
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        loss.item()
    return stamps


def run_plain(case: Case, device: str, steps: Steps, seed: int = 0) -> Result:
    clean(device)
    t0 = time.perf_counter()
    stamps = plain_loop(case, device, batches(case.size, steps, seed), seed, time.perf_counter)
    return {"steady_sps": steady_sps([stamps], steps.warm, case.size.batch), "peak": peak(device),
            "wall_s": time.perf_counter() - t0}


# -- hydra_tune ---------------------------------------------------------------------------------------------
def run_hydra(case: Case, device: str, steps: Steps, budget: int | None, seed: int = 0) -> Result:
    """``case.tasks`` tasks (seeds seed, seed+1, ...) submitted together to one runtime on ``device``."""
    clean(device)
    datas = [TimedData(batches(case.size, steps, seed + i)) for i in range(case.tasks)]
    t0 = time.perf_counter()
    with ht.Runtime(devices=[device], device_memory=budget) as rt:
        handles = [rt.submit(ht.ModelTask(gpt2_factory(case.size, case.dropout), adamw, d, epochs=1, seed=seed + i,
                                          precision=case.precision, name=f"t{i}")) for i, d in enumerate(datas)]
        for h in handles:
            h.result()
        stats = rt.stats()
        trace = rt.trace()
    first = stats["tasks"]["t0"]
    dev = stats["devices"][0]
    return {"steady_sps": steady_sps([d.passes[-1] for d in datas], steps.warm, case.size.batch),
            "peak": peak(device) if cuda(device) else dev.get("peak_bytes"), "wall_s": time.perf_counter() - t0,
            "shards": len(first["shards"]), "predicted_peak": first.get("predicted_peak"),
            "overlap": trace.overlap()[0], "copy_s": sum(e.seconds for e in trace.copies()),
            "prefetched_bytes": dev.get("prefetched_bytes"), "steps": steps.total * case.tasks,
            **state_moves([stats["tasks"][f"t{i}"].get("residency") or {} for i in range(case.tasks)]),
            "counters": {"device": counters(dev), "tasks": [counters(stats["tasks"][f"t{i}"])
                                                            for i in range(case.tasks)]}}


def run_prepared(case: Case, device: str, steps: Steps, budget: int | None, seed: int = 0) -> Result:
    """``plain_loop`` after ``hydra_tune.prepare`` (issue 16's drop-in) on a runtime of ``device``.
    ``output_bytes_per_step``: what the runtime's copier moved of activations a step; with the task in one shard,
    the model's output carried to host memory by its F unit and its gradient to the device by its B unit."""
    clean(device)
    t0 = time.perf_counter()
    with ht.Runtime(devices=[device], device_memory=budget) as rt:
        prepared: list[Any] = []

        def prepare(model: nn.Module, opt: torch.optim.Optimizer) -> list[Any]:
            prepared.extend(ht.prepare(model, opt, seed=seed, precision=case.precision, runtime=rt, name="prepared"))
            return prepared

        stamps = plain_loop(case, device, batches(case.size, steps, seed), seed, time.perf_counter, prepare)
        stats = rt.stats()
        prepared[0].release()
    task, dev = stats["tasks"]["prepared"], stats["devices"][0]
    copies = (task.get("residency") or {}).get("copies", {})
    moved = sum(copies.get(way, {}).get("activations", 0) for way in ("h2d", "d2h"))
    return {"steady_sps": steady_sps([stamps], steps.warm, case.size.batch),
            "peak": peak(device) if cuda(device) else dev.get("peak_bytes"), "wall_s": time.perf_counter() - t0,
            "shards": len(task["shards"]), "steps": steps.total, "output_bytes_per_step": moved / steps.total,
            **state_moves([task.get("residency") or {}]),
            "counters": {"device": counters(dev), "tasks": [counters(task)]}}


def state_moves(residency: list[dict[str, Any]]) -> dict[str, int]:
    """Over the tasks: state bytes moved both ways after each one's first step (``state_moved``: the first
    step's move-in and the final write-back not counted) and their entries' predicted device bytes
    (``entry_bytes``); nothing when this runtime does not report them."""
    after = [r.get("state_bytes_after_first_step") for r in residency]
    out = {"state_moved": sum(after)} if after and None not in after else {}
    if all("entry_bytes" in r for r in residency):
        out["entry_bytes"] = sum(sum(r["entry_bytes"]) for r in residency)
    return out


def counters(stats: dict[str, Any]) -> dict[str, Any]:
    """The runtime's counters, whatever this version reports: numeric leaves whose names speak of bytes,
    synchronisations, steps, evictions, residency or the step path (flattened as a.b.c)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, (int, float, str)) and not isinstance(value, bool) and \
                any(w in prefix.lower() for w in COUNTER_WORDS):
            out[prefix] = value

    walk("", {k: v for k, v in stats.items() if k not in ("host_footprint", "shards", "kept", "offloaded")})
    return out


def pick(found: dict[str, Any], *words: str) -> Any:
    """The first counter whose name holds every word (None: this runtime does not report it)."""
    for key, value in found.items():
        if all(w in key.lower() for w in words):
            return value
    return None


# -- plain PyTorch in separate processes ----------------------------------------------------------------------
def run_processes(case: Case, device: str, steps: Steps, n: int, seed: int = 0) -> Result:
    """``n`` plain processes on ``device`` (as Ray Tune's fractional GPUs run trials), released together."""
    clean(device)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        go = os.path.join(tmp, "go")
        spec = json.dumps({"case": {**asdict(case), "size": asdict(case.size)}, "device": device,
                           "steps": asdict(steps), "go": go})
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
        procs = [subprocess.Popen([sys.executable, __file__, spec, str(seed + i), os.path.join(tmp, f"ready{i}")],
                                  stdout=subprocess.PIPE, text=True, env=env) for i in range(n)]
        deadline = time.time() + 600
        while not all(os.path.exists(os.path.join(tmp, f"ready{i}")) for i in range(n)):
            if time.time() > deadline or any(p.poll() not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError("a plain process failed before it was ready")
            time.sleep(0.01)
        open(go, "w").close()
        outs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    stamps = [o["stamps"] for o in outs]
    peaks = [o["peak"] for o in outs if o["peak"] is not None]
    return {"steady_sps": steady_sps(stamps, steps.warm, case.size.batch), "peak": max(peaks) if peaks else None,
            "per_process_sps": [steady_sps([s], steps.warm, case.size.batch) for s in stamps],
            "wall_s": time.perf_counter() - t0}


def _child(spec_json: str, seed: int, ready: str) -> None:
    """One plain process: build, warm up once (CUDA context, kernels), say ready, wait for go, train, print."""
    spec = json.loads(spec_json)
    case = Case(**{**spec["case"], "size": Size(**spec["case"]["size"])})
    steps, device = Steps(**spec["steps"]), spec["device"]
    torch.set_num_threads(1)
    plain_loop(case, device, batches(case.size, Steps(0, 2), seed), seed, time.time)
    clean(device)
    open(ready, "w").close()
    while not os.path.exists(spec["go"]):
        time.sleep(0.001)
    stamps = plain_loop(case, device, batches(case.size, steps, seed), seed, time.time)
    print(json.dumps({"stamps": stamps, "peak": peak(device)}), flush=True)


if __name__ == "__main__":  # a process of run_processes
    _child(sys.argv[1], int(sys.argv[2]), sys.argv[3])
