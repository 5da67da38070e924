"""Merge two `python -m moe_book.bench kda` runs of one device lease into one results/bench_kda.json.

Used when a run was cut short: on a fresh machine fla autotunes on its first call of each shape (79 s for the first
row on 2026-12-07), so the full five-implementation run outlasted one device command. Each summary ratio is taken
from a run that timed both of its implementations (the second run where it has both, else the first), so every
ratio stays a same-process ratio; `ratio_sources` says which run gave which. The rows (for the figure and the
tables) are every measured row of the second run, then the first run's measured rows that the second lacks. Both
runs are kept whole under `runs`, errors included.

    python tools/merge_bench_kda.py FIRST.json SECOND.json results/bench_kda.json
"""
import json
import sys
from pathlib import Path

from moe_book.bench.kda import IMPLS, plot, summarize


def _key(r):
    return r["impl"], r["B"], r["T"], r["pass"]


def merge(first: dict, second: dict) -> dict:
    for field in ("device", "versions", "launch"):
        if first.get(field) != second.get(field):
            raise SystemExit(f"the runs differ in {field} ({first.get(field)!r} vs {second.get(field)!r}): not one "
                             f"device and code, so not mergeable")
    rows = [r for r in second["rows"] if r["ms"] is not None]
    have = {_key(r) for r in rows}
    rows += [r for r in first["rows"] if r["ms"] is not None and _key(r) not in have]
    shapes = sorted({(r["B"], r["T"]) for r in rows}, key=lambda s: s[1])
    per_run = [summarize(d["rows"], shapes) for d in (first, second)]   # a null row gives a None ratio
    summary, sources = {}, {}
    for name in per_run[0]:
        summary[name], sources[name] = {}, {}
        for key in per_run[0][name]:
            run = 1 if per_run[1][name][key] is not None else 0
            summary[name][key] = per_run[run][name][key]
            sources[name][key] = None if summary[name][key] is None else second["date"] if run else first["date"]
    untimed = [impl for impl in IMPLS if not any(r["impl"] == impl for r in rows)]
    out = {k: v for k, v in second.items() if k not in ("rows", "summary", "errors")}
    out.update(rows=rows, summary=summary, ratio_sources=sources, untimed=untimed,
               note=f"merged by tools/merge_bench_kda.py from two runs of one lease on one device ({first['date']}, "
                    f"{second['date']}); each ratio from the run that timed both of its rows (ratio_sources); "
                    f"not timed in either run: {untimed or 'none'}",
               runs=[{"date": d["date"], "errors": d.get("errors", []), "rows": d["rows"], "summary": d["summary"]}
                     for d in (first, second)])
    return out


if __name__ == "__main__":
    first, second, dest = sys.argv[1:4]
    merged = merge(json.loads(Path(first).read_text()), json.loads(Path(second).read_text()))
    Path(dest).write_text(json.dumps(merged, indent=1) + "\n")
    plot(merged, Path(dest).with_suffix(".png"))
    print(json.dumps({"summary": merged["summary"], "ratio_sources": merged["ratio_sources"]}, indent=1))
