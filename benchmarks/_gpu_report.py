"""gpu_check's verdicts: one printer per section, each returning whether its check passed.

    from _gpu_report import report
    ok = report(res)      # res: the dict gpu_check.main builds (exact, copy_gbps, throughput, unit_memory, modes, oom)
"""
from __future__ import annotations

from typing import Any

from hydra_tune.errors import format_bytes

EXACT_TOL = 1e-4  # hydra_tune on CUDA vs plain CUDA: a tolerance, since nothing yet proves CUDA bit-for-bit
OVERLAP_MIN = 0.5  # share of prefetch copy time that must run while the device computes
MODEL_TOL = 0.10  # per-unit memory prediction vs the device's measured peak


def verdict(good: bool) -> str:
    return "PASS" if good else "FAIL"


def exactness(res: dict[str, Any]) -> bool:
    ex = res["exact"]
    print(f"\n(a) exactness, small tied GPT-2 on {res['device']}: max|w| difference after 2 epochs")
    print(f"{'task':<14}{'shards':>7}{'vs plain dev':>14}{'vs plain cpu':>14}{'cpu-vs-dev floor':>18}"
          f"{'loss diff':>11}")
    for name in ("exact-p0.0", "exact-p0.1"):
        r = ex[name]
        print(f"{name:<14}{r['shards']:>7}{r['diff']:>14.3g}{r['diff_vs_cpu']:>14.3g}{r['floor']:>18.3g}"
              f"{r['loss_diff']:>11.3g}")
    exact = ex["exact-p0.0"]["diff"] <= EXACT_TOL
    print(f"dropout off: {verdict(exact)} (tolerance {EXACT_TOL:g}); dropout on is informational")
    under = ex["peak"] <= ex["budget"]
    print(f"\n(b) measured peak {format_bytes(ex['peak'])} vs budget {format_bytes(ex['budget'])} "
          f"(predicted {format_bytes(ex['predicted_peak'])}, still allocated after the tasks "
          f"{format_bytes(ex['resident_after'])}): {verdict(under)}")
    return exact and under


def throughput(res: dict[str, Any]) -> bool:
    ok = True
    if res["copy_gbps"]:
        print("\n(c) copies of 256 MiB: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in res["copy_gbps"].items()))
    tp = res["throughput"]
    print(f"\n(d) {tp['model']}")
    print(f"{'run':<11}{'shards':>7}{'kept':>6}{'samples/s':>11}{'peak':>12}{'budget':>12}{'prefetched':>12}"
          f"{'copy s':>8}{'overlap':>9}")
    for name in ("sharded", "unsharded", "plain"):
        r = tp[name]
        peak = "-" if r["peak"] is None else format_bytes(r["peak"])
        limit = "-" if r["budget"] is None else format_bytes(r["budget"])
        print(f"{name:<11}{r['shards']:>7}{len(r['kept']):>6}{r['samples_per_s']:>11.2f}{peak:>12}{limit:>12}"
              f"{format_bytes(r['prefetched_bytes']):>12}{r['copy_seconds']:>8.2f}{r['overlap']:>9.2f}")
        if r["budget"] is not None and r["peak"] > r["budget"]:
            ok = False
            print(f"FAIL: {name} peak above its budget")
    print(f"sharded / unsharded = {tp['ratio']:.3f}; sharded / plain = "
          f"{tp['sharded']['samples_per_s'] / tp['plain']['samples_per_s']:.3f}")
    return overlap(tp["sharded"]) and ok


def overlap(sh: dict[str, Any]) -> bool:
    if sh["prefetched_bytes"] == 0:  # residency kept every shard's state on the device: nothing to overlap
        print("(e) prefetch copies under compute: n/a (nothing was prefetched: the sharded task's state stayed on "
              "the device)")
        return True
    good = sh["overlap"] >= OVERLAP_MIN
    print(f"(e) prefetch copies under compute (trace): {sh['overlap']:.0%} of {sh['copy_seconds']:.2f} s of "
          f"copies overlapped a unit on the same device (>= {OVERLAP_MIN:.0%}): {verdict(good)}; "
          "traces in gpu_check_*_trace.json")
    return good


def memory_model(rows: list[dict[str, Any]]) -> bool:
    if not rows:
        return True
    errors = [(r["measured"] - r["predicted"]) / r["predicted"] for r in rows]
    good = max(abs(e) for e in errors) <= MODEL_TOL
    print(f"\n(f) memory model per unit ({len(rows)} units, recompute and offload): measured vs predicted "
          f"{min(errors):+.1%} .. {max(errors):+.1%} (within {MODEL_TOL:.0%}: {verdict(good)})")
    for r in rows:
        print(f"    {r['mode']:<9} {r['unit']:<4} predicted {format_bytes(r['predicted']):>11}  measured "
              f"{format_bytes(r['measured']):>11}")
    return good


def backward_modes(bm: dict[str, Any] | None) -> bool:
    if not bm:
        return True
    good = not bm["errors"] and len(bm["vs_recompute"]) == 3 and max(bm["vs_recompute"].values()) == 0.0 \
        and max(bm["vs_plain"].values()) <= EXACT_TOL
    print(f"\n(h) backward modes, every shard but the last forced ({bm['shards']} shards, dropout on): max|w| vs "
          "recompute " + ", ".join(f"{m} {d:.3g}" for m, d in bm["vs_recompute"].items()) + "; vs plain "
          + ", ".join(f"{m} {d:.3g}" for m, d in bm["vs_plain"].items())
          + "".join(f"; {m} FAILED {e}" for m, e in bm["errors"].items()) + f": {verdict(good)}")
    return good


def oom(om: dict[str, Any] | None) -> bool:
    if not om:
        return True
    good = om["replans"] >= 1 and om["diff"] is not None and om["diff"] <= EXACT_TOL
    print(f"\n(g) out-of-memory at {format_bytes(om['limit'])} (60% of the plan's {format_bytes(om['first_peak'])}):"
          f" {om['replans']} re-plans -> {om['shards']} shards, predicted {format_bytes(om['peak'])}; max|w| vs "
          f"plain {om['diff'] if om['diff'] is not None else om['error']}: {verdict(good)}")
    return good


def report(res: dict[str, Any]) -> bool:
    """Print every section's table and verdict; True when all checks pass (every section always prints)."""
    results = [exactness(res), throughput(res), memory_model(res.get("unit_memory") or []),
               backward_modes(res.get("modes")), oom(res.get("oom"))]
    return all(results)
