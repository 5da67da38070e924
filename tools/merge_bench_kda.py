"""Merge two `python -m moe_book.bench kda` runs of one device lease into one results/bench_kda.json.

Used when a run was cut short: on a fresh machine fla autotunes on its first call of each shape (79 s for the first
row on 2026-12-07), so the full five-implementation run outlasted one device command. The second run repeats
ours_bounded beside fla, so every fla ratio stays a same-process ratio. The merged rows are the second run's rows
plus the first run's rows of implementations the second did not time; the summary is `summarize` over them (the
ratios against ours_unbounded and SDPA then use the second run's ours_bounded, which the JSON's `runs` lets anyone
check against the first's). Both runs are kept whole under `runs`.

    python tools/merge_bench_kda.py FIRST.json SECOND.json results/bench_kda.json
"""
import json
import sys
from pathlib import Path

from moe_book.bench.kda import plot, summarize


def merge(first: dict, second: dict) -> dict:
    if first["device"] != second["device"]:
        raise SystemExit(f"runs on different devices ({first['device']!r} vs {second['device']!r}): not mergeable")
    timed = {r["impl"] for r in second["rows"]}
    rows = list(second["rows"]) + [r for r in first["rows"] if r["impl"] not in timed]
    shapes = sorted({(r["B"], r["T"]) for r in rows}, key=lambda s: s[1])
    out = {k: v for k, v in second.items() if k not in ("rows", "summary", "errors")}
    out.update(rows=rows, summary=summarize(rows, shapes),
               note=f"merged by tools/merge_bench_kda.py: {second['date']} run (its rows) + {first['date']} run "
                    f"(rows of {sorted({r['impl'] for r in first['rows']} - timed)}), one lease of one device",
               runs=[{"date": d["date"], "errors": d.get("errors", []), "rows": d["rows"],
                      "summary": d["summary"]} for d in (first, second)])
    return out


if __name__ == "__main__":
    first, second, dest = sys.argv[1:4]
    merged = merge(json.loads(Path(first).read_text()), json.loads(Path(second).read_text()))
    Path(dest).write_text(json.dumps(merged, indent=1) + "\n")
    plot(merged, Path(dest).with_suffix(".png"))
    print(json.dumps(merged["summary"], indent=1))
