#!/usr/bin/env python3
"""The agreement's cost model beside measurements (docs/agreement.md).

Reads the JSON lines of `gradbus worker --bench-allreduce --agreement --json` (one run per world
size, concatenated) on stdin, fits the latency-bandwidth model's alpha and beta to the 2-rank rows
(least squares; 2 ranks on 2 cores is the only world this machine runs without oversubscription),
and prints, per row, the measured time beside the model's prediction, then the model's bytes at
1k and 16k ranks. The model (recursive doubling, one exchange per doubling):
  table path:   T = ceil(log2 W) * alpha + (W - 1) * row * beta          (one MPI_Allgather)
  summary path: T = 2 ceil(log2 W) * alpha + ceil(log2 W) * S * beta     (two MPI_Allreduce)
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


def loads(r):
    """(latency terms, bytes into a rank) of each path."""
    w, b = r["world"], r["buckets"]
    return (rounds(w), (w - 1) * row_bytes(b)), (2 * rounds(w), rounds(w) * summary_bytes(b))


rows = [json.loads(l) for l in sys.stdin if l.strip()]
for r in rows:
    assert r["row_bytes"] == row_bytes(r["buckets"]) and r["summary_bytes"] == summary_bytes(r["buckets"]), r
# Two-point calibration on the 2-rank table rows (one exchange each): alpha from the smallest row,
# beta from the slope to the largest. (A least-squares fit over every 2-rank row came out with a
# negative alpha on the loaded development machine.)
two = sorted((r for r in rows if r["world"] == 2), key=lambda r: r["buckets"])
(_, small), (_, large) = loads(two[0])[0], loads(two[-1])[0]
beta = (two[-1]["allgather_us"] - two[0]["allgather_us"]) / (large - small)
alpha = two[0]["allgather_us"] - small * beta
print(f"calibrated on the 2-rank table rows: alpha = {alpha:.2f} us, beta = {beta * 1e3:.4f} us/KB")
print()
print("| world | buckets | table: bytes in | allgather measured us | model us | summary: bytes in | all-reduce measured us | model us |")
print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for r in rows:
    (n1, b1), (n2, b2) = loads(r)
    print(f"| {r['world']} | {r['buckets']} | {b1} | {r['allgather_us']:.1f} | {n1 * alpha + b1 * beta:.1f} "
          f"| {b2} | {r['summary_us']:.1f} | {n2 * alpha + b2 * beta:.1f} |")
print()
print("| world | buckets | table row B | table: bytes into each rank | summary B | summary: bytes into each rank | exchanges table / summary | model us table / summary |")
print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for w, b in [(8, 7), (1024, 100), (1024, 1750), (16384, 100), (16384, 1750)]:
    (n1, b1), (n2, b2) = loads({"world": w, "buckets": b})
    print(f"| {w} | {b} | {row_bytes(b)} | {b1:,} | {summary_bytes(b):,} | {b2:,} | {n1} / {n2} "
          f"| {n1 * alpha + b1 * beta:,.0f} / {n2 * alpha + b2 * beta:,.0f} |")
