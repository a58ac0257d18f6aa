#!/usr/bin/env python3
"""The agreement's cost model beside measurements (docs/agreement.md).

Reads the JSON lines of `gradbus worker --bench-allreduce --agreement --json` (runs per world size,
concatenated; repeated runs of one world size give each time as the best of them) on stdin and
prints:
  1. the model's constants calibrated on these rows (to compare with, or to put into,
     `collectives/src/choice/cost.rs`'s `Calibration::MPI`): the latency alpha and the cost per byte beta from the
     2-rank bare all-gathers (2 ranks on 2 cores is the only world this machine runs without
     oversubscription), and each path's CPU cost per byte (least squares through the origin over
     every row of the CPU-only timings);
  2. per row, each path's measured time beside the model's (the constants the binary was built
     with: the `model_*_us` fields) and the model's choice;
  3. the measured and the modelled crossover per bucket count: the smallest world size measured
     (for the model with the fitted constants: of 1..65536) where the summary path is cheaper;
  4. the model at the sizes of issue 18 (8 to 16k ranks).
The rows' value count (the "values" field: the worker's workload values) sizes the row and the
summary. The model (recursive doubling, one exchange per doubling, r = ceil(log2 W)):
  table path:   T = r alpha + (W - 1) row beta + W row cpu_table         (one MPI_Allgather)
  summary path: T = 2 r alpha + r S beta + S cpu_summary                 (two MPI_Allreduce)
"""
import json
import math
import sys

LIMBS = 68  # ExactSum::WORDS (67 limbs + the count of terms other than -0.0)


def row_bytes(b, v):
    """A rank's row with v workload values (LocalScalars::words(v) = 2 + v)."""
    return 8 * (2 + 8 * b + 2 + v)


def summary_bytes(b, v):
    stats = 1 + v  # the loss and the workload values
    return 8 * ((2 * b + stats * (3 + LIMBS)) + (8 * b + 4 + 2 * stats))


def rounds(w):
    return math.ceil(math.log2(w)) if w > 1 else 0


def model(w, b, v, k):
    """(table us, summary us) for constants k = (alpha, beta, cpu_table, cpu_summary), per byte."""
    alpha, beta, ct, cs = k
    r, row, s = rounds(w), row_bytes(b, v), summary_bytes(b, v)
    return r * alpha + (w - 1) * row * beta + w * row * ct, 2 * r * alpha + r * s * beta + s * cs


def through_origin(xs, ys):
    return sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)


# Several runs may be concatenated: per (world, buckets) each time is the best of them (a shared
# machine's interference only ever adds time).
best = {}
for line in sys.stdin:
    if not line.strip():
        continue
    r = json.loads(line)
    key = (r["world"], r["buckets"])
    if key in best:
        for k in ("allgather_us", "table_us", "summary_us", "table_cpu_us", "summary_cpu_us"):
            best[key][k] = min(best[key][k], r[k])
        best[key]["runs"] += 1
    else:
        best[key] = dict(r, runs=1)
rows = sorted(best.values(), key=lambda r: (r["world"], r["buckets"]))
values = {r["values"] for r in rows}
assert len(values) == 1, f"runs with different value counts: {sorted(values)}"
v = values.pop()
for r in rows:
    assert r["row_bytes"] == row_bytes(r["buckets"], v) and r["summary_bytes"] == summary_bytes(r["buckets"], v), r
# Two-point calibration on the 2-rank bare all-gathers (one exchange each): alpha from the smallest
# row, beta from the slope to the largest.
two = sorted((r for r in rows if r["world"] == 2), key=lambda r: r["buckets"])
small, large = row_bytes(two[0]["buckets"], v), row_bytes(two[-1]["buckets"], v)
beta = (two[-1]["allgather_us"] - two[0]["allgather_us"]) / (large - small)
alpha = two[0]["allgather_us"] - small * beta
cpu_table = through_origin([r["table_bytes"] for r in rows], [r["table_cpu_us"] for r in rows])
cpu_summary = through_origin([r["summary_bytes"] for r in rows], [r["summary_cpu_us"] for r in rows])
fitted = (alpha, beta, cpu_table, cpu_summary)
print(f"calibrated on these rows ({v} workload values; choice/cost.rs `Calibration::MPI`):")
print(f"  ALPHA_US = {alpha:.2f}; BETA_US_PER_BYTE = {beta * 1e3:.4f}e-3 (= {beta * 1e3:.4f} us/KB)")
print(f"  TABLE_CPU_US_PER_BYTE = {cpu_table * 1e3:.4f}e-3; SUMMARY_CPU_US_PER_BYTE = {cpu_summary * 1e3:.4f}e-3")
print()
print("| world | buckets | table: bytes in | measured us (cpu) | model us | summary: bytes in | measured us (cpu) "
      "| model us | model's choice | cheaper measured |")
print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
for r in rows:
    measured = "summary" if r["summary_us"] < r["table_us"] else "table"
    print(f"| {r['world']} | {r['buckets']} | {r['table_bytes'] - r['row_bytes']} "
          f"| {r['table_us']:.1f} ({r['table_cpu_us']:.1f}) | {r['model_table_us']:.1f} "
          f"| {r['summary_bytes_in']} | {r['summary_us']:.1f} ({r['summary_cpu_us']:.1f}) "
          f"| {r['model_summary_us']:.1f} | {r['model_choice']} | {measured} |")
print()
print("| buckets | measured crossover (world) | the model's crossover (world), constants fitted above |")
print("| ---: | --- | ---: |")
by_buckets = {}
for r in rows:
    by_buckets.setdefault(r["buckets"], []).append(r)
for b in sorted(by_buckets):
    measured = sorted(by_buckets[b], key=lambda r: r["world"])
    cheaper = [r["world"] for r in measured if r["summary_us"] < r["table_us"]]
    worlds = ", ".join(str(r["world"]) for r in measured)
    mtxt = f"{cheaper[0]} (measured {worlds})" if cheaper else f"none (measured {worlds})"
    w = next((w for w in range(1, 65537) if model(w, b, v, fitted)[1] < model(w, b, v, fitted)[0]), None)
    print(f"| {b} | {mtxt} | {w} |")
print()
print("| world | buckets | table row B | table: bytes into each rank | summary B | summary: bytes into each rank "
      "| exchanges table / summary | model us table / summary (constants fitted above) |")
print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for w, b in [(8, 7), (1024, 100), (1024, 1750), (16384, 100), (16384, 1750)]:
    t, s = model(w, b, v, fitted)
    print(f"| {w} | {b} | {row_bytes(b, v)} | {(w - 1) * row_bytes(b, v):,} | {summary_bytes(b, v):,} "
          f"| {rounds(w) * summary_bytes(b, v):,} | {rounds(w)} / {2 * rounds(w)} | {t:,.0f} / {s:,.0f} |")
