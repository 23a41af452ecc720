"""gpu_all.sh's last step: the three GPU scripts' results in one JSON object and one table (torch-free).

    python benchmarks/_gpu_summary.py OUT.json gpu_check.log gpu_gil.json gpu_perf.json CHECK_RC GIL_RC PERF_RC SECONDS

Each row is one check or measurement: its section, what it measured, the figure and PASS/FAIL where there is a goal
(gpu_perf's goals are reported, not asserted: "goal" rows say met / not met). A script that wrote nothing is one
row that says so.
"""
from __future__ import annotations

import json
import sys
from typing import Any


def last_json(path: str) -> Any:
    try:
        with open(path) as f:
            lines = [line for line in f if line.startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def _mib(n: Any) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def check_rows(c: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows = []
    ex = c.get("exact") or {}
    if ex:
        d = ex.get("exact-p0.0", {}).get("diff")
        rows.append(("check a", "exactness, dropout off: max|w| vs plain", f"{d:.3g}" if d is not None else "-",
                     "PASS" if d is not None and d <= 1e-4 else "FAIL"))
        rows.append(("check b", "measured peak vs budget", f"{_mib(ex.get('peak'))} / {_mib(ex.get('budget'))}",
                     "PASS" if ex.get("peak", 1) <= ex.get("budget", 0) else "FAIL"))
    tp = c.get("throughput") or {}
    if tp:
        rows.append(("check d", "sharded / unsharded samples/s", f"{tp.get('ratio', float('nan')):.3f}", "-"))
        sh = tp.get("sharded", {})
        ov = sh.get("overlap")
        if not sh.get("prefetched_bytes"):
            rows.append(("check e", "prefetch overlapped with compute", "nothing prefetched (state resident)", "n/a"))
        else:
            rows.append(("check e", "prefetch overlapped with compute", f"{ov:.0%}" if ov is not None else "-",
                         "PASS" if ov is not None and ov >= 0.5 else "FAIL"))
    um = c.get("unit_memory") or []
    if um:
        errs = [(r["measured"] - r["predicted"]) / r["predicted"] for r in um]
        rows.append(("check f", f"memory model, {len(um)} units", f"{min(errs):+.1%} .. {max(errs):+.1%}",
                     "PASS" if max(abs(e) for e in errs) <= 0.10 else "FAIL"))
    bm = c.get("modes")
    if bm:
        diffs = bm.get("vs_recompute", {})
        ok = not bm.get("errors") and len(diffs) == 3 and max(diffs.values()) == 0.0
        rows.append(("check h", "keep/offload vs recompute max|w|",
                     ", ".join(f"{m} {d:.3g}" for m, d in diffs.items()) or "; ".join(bm.get("errors", {})),
                     "PASS" if ok else "FAIL"))
    om = c.get("oom")
    if om:
        ok = om.get("replans", 0) >= 1 and om.get("diff") is not None and om["diff"] <= 1e-4
        rows.append(("check g", "real OOM: re-plans, max|w| vs plain", f"{om.get('replans')}, {om.get('diff')}",
                     "PASS" if ok else "FAIL"))
    return rows


def gil_rows(g: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows = []
    for r in g.get("rows", []):
        what = f"GIL ms/minibatch, {r['model']} {r['precision']}"
        if "error" in r:
            rows.append(("gil", what, r["error"][:40], "FAIL"))
        else:
            rows.append(("gil", what, f"{r['gil_ms']:.1f} of {r['device_ms']:.1f} device ms: feeds {r['feeds']}",
                         "-"))
    return rows


def perf_rows(p: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows = []
    for r in p.get("results", []):
        goal = r.get("goal")
        verdict = "-" if not goal else ("met" if r["ratio"] >= goal else "not met")
        rows.append((f"perf {r['section']}", f"{r['case']} vs {r['sides'][0]}", f"{r['ratio']:.3f}x"
                     + (f" (goal {goal})" if goal else ""), verdict))
        if r.get("output_bytes_per_step") is not None:  # (e): the prepared model's output moved by the runtime
            rows.append((f"perf {r['section']}", "output + its gradient moved a step",
                         f"{r['output_bytes_per_step'] / 2**20:.1f} MiB", "-"))
    rows += [("perf", f"skipped: {s}", "-", "-") for s in p.get("skipped", [])]
    rows += [("perf", f"failed: {s[:50]}", "-", "FAIL") for s in p.get("failed", [])]
    return rows


def main(argv: list[str]) -> int:
    out, check_log, gil_json, perf_json, check_rc, gil_rc, perf_rc, seconds = argv
    result = {"gpu_check": last_json(check_log), "gpu_gil": last_json(gil_json), "gpu_perf": last_json(perf_json),
              "exit": {"gpu_check": int(check_rc), "gpu_gil": int(gil_rc), "gpu_perf": int(perf_rc)},
              "seconds": int(seconds)}
    with open(out, "w") as f:
        json.dump(result, f)
    rows: list[tuple[str, str, str, str]] = []
    for name, part, make in (("gpu_check", result["gpu_check"], check_rows), ("gpu_gil", result["gpu_gil"], gil_rows),
                             ("gpu_perf", result["gpu_perf"], perf_rows)):
        if not isinstance(part, dict) or isinstance(part.get("skipped"), str):  # no output, or "no CUDA device"
            rows.append((name, "no result" if not isinstance(part, dict) else f"skipped: {part['skipped']}", "-", "-"))
        else:
            rows += make(part)
    width = max(len(r[1]) for r in rows)
    print(f"\n{'section':<10}{'what':<{width + 2}}{'figure':<44}result")
    for sec, what, fig, verdict in rows:
        print(f"{sec:<10}{what:<{width + 2}}{fig:<44}{verdict}")
    print(f"gpu_all: wrote {out} (exit: gpu_check {check_rc}, gpu_gil {gil_rc}, gpu_perf {perf_rc}; {seconds} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
