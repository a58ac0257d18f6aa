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
The row's and the summary's sizes are read off the rows themselves (`row_bytes`, `summary_bytes`:
the binary's own codec, collectives/src/wire.rs and agreement/codec.rs), as lines in the bucket
count through the measured bucket counts (at least two), so that this script holds no copy of the
codec's layout. The model (recursive doubling, one exchange per doubling, r = ceil(log2 W)):
  table path:   T = r alpha + (W - 1) row beta + W row cpu_table         (one MPI_Allgather)
  summary path: T = 2 r alpha + r S beta + S cpu_summary                 (two MPI_Allreduce)
"""
import json
import math
import sys

class Sizes:
    """Bytes of a rank's row and of the summary as lines in the bucket count b, through the rows'
    own `row_bytes` and `summary_bytes` (one value count per input): exact, since the codec gives
    every bucket the same words; checked on every row."""

    def __init__(self, rows):
        by_b = {r["buckets"]: (r["row_bytes"], r["summary_bytes"]) for r in rows}
        if len(by_b) < 2:
            sys.exit("agreement-cost: rows of at least two bucket counts are needed (hint: --buckets 7,100)")
        (b0, (r0, s0)), (b1, (r1, s1)) = sorted(by_b.items())[0], sorted(by_b.items())[-1]
        self.row = (r0, (r1 - r0) / (b1 - b0), b0)
        self.summary = (s0, (s1 - s0) / (b1 - b0), b0)
        for r in rows:
            assert (r["row_bytes"], r["summary_bytes"]) == (self.row_bytes(r["buckets"]), self.summary_bytes(r["buckets"])), r

    @staticmethod
    def _at(line, b):
        base, per, b0 = line
        return round(base + per * (b - b0))

    def row_bytes(self, b):
        return self._at(self.row, b)

    def summary_bytes(self, b):
        return self._at(self.summary, b)


def rounds(w):
    return math.ceil(math.log2(w)) if w > 1 else 0


def model(w, b, k):
    """(table us, summary us) for constants k = (alpha, beta, cpu_table, cpu_summary), per byte."""
    alpha, beta, ct, cs = k
    r, row, s = rounds(w), sizes.row_bytes(b), sizes.summary_bytes(b)
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
sizes = Sizes(rows)
# Two-point calibration on the 2-rank bare all-gathers (one exchange each): alpha from the smallest
# row, beta from the slope to the largest.
two = sorted((r for r in rows if r["world"] == 2), key=lambda r: r["buckets"])
small, large = two[0]["row_bytes"], two[-1]["row_bytes"]
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
    w = next((w for w in range(1, 65537) if model(w, b, fitted)[1] < model(w, b, fitted)[0]), None)
    print(f"| {b} | {mtxt} | {w} |")
print()
print("| world | buckets | table row B | table: bytes into each rank | summary B | summary: bytes into each rank "
      "| exchanges table / summary | model us table / summary (constants fitted above) |")
print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for w, b in [(8, 7), (1024, 100), (1024, 1750), (16384, 100), (16384, 1750)]:
    t, s = model(w, b, fitted)
    rb, sb = sizes.row_bytes(b), sizes.summary_bytes(b)
    print(f"| {w} | {b} | {rb} | {(w - 1) * rb:,} | {sb:,} "
          f"| {rounds(w) * sb:,} | {rounds(w)} / {2 * rounds(w)} | {t:,.0f} / {s:,.0f} |")
