#!/usr/bin/env python3
"""The agreement's cost model beside measurements (docs/agreement.md).

Reads the JSON lines of `gradbus worker --bench-allreduce --agreement --json` (one run per world
size, concatenated) on stdin and prints:
  1. the model's constants calibrated on these rows (to compare with, or to put into,
     `collectives/src/agreement.rs`'s `model`): the latency alpha and the cost per byte beta from the
     2-rank bare all-gathers (2 ranks on 2 cores is the only world this machine runs without
     oversubscription), and each path's CPU cost per byte (least squares through the origin over
     every row of the CPU-only timings);
  2. per row, each path's measured time beside the model's (the constants the binary was built
     with: the `model_*_us` fields) and the model's choice;
  3. the measured and the modelled crossover per bucket count: the smallest world size measured
     (for the model with the fitted constants: of 1..65536) where the summary path is cheaper.
The model (recursive doubling, one exchange per doubling, r = ceil(log2 W)):
  table path:   T = r alpha + (W - 1) row beta + W row cpu_table         (one MPI_Allgather)
  summary path: T = 2 r alpha + r S beta + S cpu_summary                 (two MPI_Allreduce)
"""
import json
import math
import sys

WORDS = 7  # LocalReport::WORDS
LIMBS = 68  # ExactSum::WORDS (67 limbs + the count of terms other than -0.0)
STATS = 6  # the loss and 5 workload values


def row_bytes(b):
    return 8 * (2 + 8 * b + WORDS)


def summary_bytes(b):
    return 8 * ((2 * b + STATS * (3 + LIMBS)) + (8 * b + 4 + 2 * STATS))


def rounds(w):
    return math.ceil(math.log2(w)) if w > 1 else 0


def model(w, b, k):
    """(table us, summary us) for constants k = (alpha, beta, cpu_table, cpu_summary), per byte."""
    alpha, beta, ct, cs = k
    r, row, s = rounds(w), row_bytes(b), summary_bytes(b)
    return r * alpha + (w - 1) * row * beta + w * row * ct, 2 * r * alpha + r * s * beta + s * cs


def through_origin(xs, ys):
    return sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)


rows = [json.loads(line) for line in sys.stdin if line.strip()]
for r in rows:
    assert r["row_bytes"] == row_bytes(r["buckets"]) and r["summary_bytes"] == summary_bytes(r["buckets"]), r
# Two-point calibration on the 2-rank bare all-gathers (one exchange each): alpha from the smallest
# row, beta from the slope to the largest.
two = sorted((r for r in rows if r["world"] == 2), key=lambda r: r["buckets"])
small, large = row_bytes(two[0]["buckets"]), row_bytes(two[-1]["buckets"])
beta = (two[-1]["allgather_us"] - two[0]["allgather_us"]) / (large - small)
alpha = two[0]["allgather_us"] - small * beta
cpu_table = through_origin([r["table_bytes"] for r in rows], [r["table_cpu_us"] for r in rows])
cpu_summary = through_origin([r["summary_bytes"] for r in rows], [r["summary_cpu_us"] for r in rows])
fitted = (alpha, beta, cpu_table, cpu_summary)
print("calibrated on these rows (agreement.rs `model`):")
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
