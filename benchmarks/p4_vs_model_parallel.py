"""Usage: .venv/bin/python benchmarks/p4_vs_model_parallel.py [--quick] [--json o.json] [--trace t.json] [--min-shards 2]

P4, shard parallelism vs model parallelism on 2 devices: 4 GPT-2 tasks (seeds 0..3, learning rates 1e-4..3e-3)
submitted at once to hydra_tune on 2 CPU devices, each cut into >= --min-shards shards by a budget (searched as in
P2), against plain model parallelism over the same 2 devices: every model split in two halves (wte+wpe+drop+
first half of the blocks | second half + ln_f + tied lm_head + shifted cross-entropy); half 0 runs on a "device
0" worker thread, half 1 on a "device 1" worker thread (one intra-op thread each); per step: fwd half 0 on thread
0 -> fwd+loss+bwd half 1 on thread 1 -> bwd half 0 on thread 0 -> each half's AdamW step on its own thread (both
at once; the tied wte belongs to half 0); the 4 tasks trained one after another. The split is checked against
the unsplit model on one batch with dropout off (loss and gradient max difference printed).
Runs alternate hydra, model-parallel, ... after one untimed warm-up of each; medians are reported. Headline:
hydra / model-parallel steady-state samples/s. Prints tables, the headline, then one JSON line.
"""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from _common import (SIDE_HEADERS, Batch, Result, Size, Spec, TimedData, alternate, emit, find_budget,
                     gpt2_factory, hydra_run, machine, median, mib, print_table, setup, side_rows, summary,
                     token_batches)

GOAL = 1.8
LRS = (1e-4, 3e-4, 1e-3, 3e-3)


class Halves:
    """A GPT2LMHeadModel run by hand in two halves (the modules stay in the one model: weights are shared)."""

    def __init__(self, model: nn.Module) -> None:
        self.model, t = model, model.transformer
        self.cut = len(t.h) // 2
        self.params0 = [t.wte.weight, t.wpe.weight] + [p for b in t.h[:self.cut] for p in b.parameters()]
        self.params1 = [p for b in t.h[self.cut:] for p in b.parameters()] + list(t.ln_f.parameters())
        assert model.lm_head.weight is t.wte.weight, "expects tied embeddings"
        assert len(self.params0) + len(self.params1) == len(list(model.parameters()))

    def _blocks(self, x: torch.Tensor, blocks: Any) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        pos = torch.arange(x.shape[1]).unsqueeze(0)
        mask = create_causal_mask(config=self.model.config, inputs_embeds=x, attention_mask=None, cache=None,
                                  position_ids=pos)
        for block in blocks:
            out = block(x, None, mask, None, use_cache=False, position_ids=pos)
            x = out[0] if isinstance(out, tuple) else out
        return x

    def forward0(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.model.transformer
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        return self._blocks(t.drop(t.wte(ids) + t.wpe(pos)), t.h[:self.cut])

    def loss1(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        t = self.model.transformer
        logits = self.model.lm_head(t.ln_f(self._blocks(x, t.h[self.cut:])))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def make_device() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(1,))


def mp_train(spec: Spec, data: TimedData, dev0: ThreadPoolExecutor, dev1: ThreadPoolExecutor) -> float:
    """One task, model-parallel over dev0/dev1 (see the module docstring). Returns the last epoch's mean loss."""
    torch.manual_seed(spec.seed)
    model = spec.factory()
    model.train()
    halves = Halves(model)
    opts = [torch.optim.AdamW(ps, lr=spec.lr) for ps in (halves.params0, halves.params1)]

    def last(x: torch.Tensor, labels: torch.Tensor) -> tuple[float, torch.Tensor]:
        loss = halves.loss1(x, labels)
        loss.backward()
        return loss.item(), x.grad  # type: ignore[return-value]

    def step(opt: torch.optim.Optimizer) -> None:
        opt.step()
        opt.zero_grad()

    mean = 0.0
    for _ in range(spec.epochs):
        losses = []
        for batch in data:
            h = dev0.submit(halves.forward0, batch["input_ids"]).result()
            x = h.detach().requires_grad_()
            loss, grad = dev1.submit(last, x, batch["labels"]).result()
            dev0.submit(h.backward, grad).result()
            for f in [dev0.submit(step, opts[0]), dev1.submit(step, opts[1])]:
                f.result()
            losses.append(loss)
        mean = sum(losses) / len(losses)
    return mean


def mp_run(specs: list[Spec]) -> Result:
    datas = [TimedData(s.batches) for s in specs]
    with make_device() as dev0, make_device() as dev1:
        start = machine()
        losses = [mp_train(s, d, dev0, dev1) for s, d in zip(specs, datas)]
        res = summary(datas, specs[0].epochs, start, sequential=True)
    res["final_loss"] = losses
    return res


def check_split(size: Size, batch: Batch) -> dict[str, float]:
    """Max |difference| of loss and gradients: split forward/backward vs the unsplit model, dropout off."""
    torch.manual_seed(0)
    model = gpt2_factory(size, dropout=0.0)()
    model.train()
    ref = model(**batch).loss
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    halves = Halves(model)
    with make_device() as dev0, make_device() as dev1:
        h = dev0.submit(halves.forward0, batch["input_ids"]).result()
        x = h.detach().requires_grad_()
        loss = dev1.submit(lambda: halves.loss1(x, batch["labels"])).result()
        dev1.submit(loss.backward).result()
        dev0.submit(h.backward, x.grad).result()
    grad_diff = max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), ref_grads))
    return {"loss": ref.item(), "loss_diff": abs(loss.item() - ref.item()), "grad_diff": grad_diff}


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--min-shards", type=int, default=2, help="shards hydra's plan must have (default 2)")


def main() -> int:
    t_start = time.perf_counter()
    args = setup(__doc__, options)
    size = args.size = replace(args.size, batches=3 if args.quick else 4)
    specs = [Spec(f"lr{lr:g}", gpt2_factory(size), lr, seed, token_batches(size, seed=seed), size.epochs)
             for seed, lr in enumerate(LRS)]
    print(f"P4 vs model parallel: 4 tasks of {size.label()}, AdamW, dropout 0.1, 2 CPU devices, 1 thread each; "
          f"{args.repeats} runs per side")
    check = check_split(size, specs[0].batches[0])
    print(f"split check (dropout off, one batch): loss {check['loss']:.6f}, |split - unsplit| loss "
          f"{check['loss_diff']:.2e}, grads max {check['grad_diff']:.2e}")
    budget, shards = find_budget(specs[0].factory, specs[0].batches[0], args.min_shards)
    print(f"hydra budget {mib(budget)} per device: {shards} shards per task")

    warm = [replace(s, batches=s.batches[:2], epochs=2) for s in specs]
    hydra_run(warm, 2, budget)
    mp_run(warm)
    label_h, label_m = f"hydra (2 dev, {shards} shards)", "model parallel (2 dev)"
    runs = alternate({label_h: lambda: hydra_run(specs, 2, budget),
                      label_m: lambda: mp_run(specs)}, args.repeats)
    if args.trace:
        hydra_run(specs, 2, budget, trace=args.trace)
    hydra, mp = runs[label_h], runs[label_m]
    print()
    print_table(SIDE_HEADERS, side_rows(runs))
    for plan in sorted({" | ".join("+".join(s) for s in r["plan"]) + f"  kept {r['kept']} offloaded {r['offloaded']}"
                        for r in hydra}):
        print(f"hydra plan: {plan}")
    busy = [[f"cpu:{i}", " ".join(f"{r['devices'][i]['busy_share']:.2f}" for r in hydra),
             mib(max(r["devices"][i]["peak_bytes"] for r in hydra)), mib(budget)] for i in range(2)]
    print_table(("hydra device", "busy share per run", "measured peak", "budget"), busy)
    diff = max(abs(a - b) for h in hydra for m in mp for a, b in zip(h["final_loss"], m["final_loss"]))
    print(f"final-epoch loss |hydra - model parallel| max {diff:.2e} (same init and dropout masks)")
    ratio = median(hydra, "steady_sps") / median(mp, "steady_sps")
    total_ratio = median(hydra, "total_sps") / median(mp, "total_sps")
    print(f"P4 hydra/model-parallel total throughput (incl. build+plan) = {total_ratio:.3f}x")
    print(f"P4 hydra/model-parallel throughput = {ratio:.3f}x (steady state, median of {args.repeats}; "
          f"goal >= {GOAL}x)")
    emit({"benchmark": "p4_vs_model_parallel", "ratio": ratio, "total_ratio": total_ratio, "goal": GOAL,
          "split_check": check, "budget": budget, "shards": shards, "final_loss_max_diff": diff, "runs": runs},
         args, t_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
