#!/usr/bin/env python3
"""The guard's agreement alone, per update: the O(buckets) summary (two int64 all-reduces, SUM and
MAX; the default) against the per-rank table's all-gather (`agreement="table"`, the guard before
the summary), side by side in the same processes. W processes over gloo on the CPU; each round
runs the guard's own code from the last bucket to the verdict - the row, the contribution, the
collectives, the decision - on synthetic healthy cells of B buckets, `--iters` times per path,
alternating the paths, and rank 0 prints microseconds per update - wall time, and its own CPU
time (process time, which a busy machine disturbs less) - the medians of the rounds, and the wall
ratio. A benchmark: asserts nothing.

Then it fits the runtime's cost model (collectives/src/choice/cost.rs, `Calibration`) to the
2-rank times (see `fit`): the latency of one exchange (alpha), the cost of a byte moved into a rank
(beta) and the summary's CPU cost per byte, with the model's bytes and exchanges from the native
core (`_core.agreement_cost`: the row codec's length, the summary's words), and prints them as
`Calibration::GLOO` takes them:
  table path:   T = r alpha + (W - 1) row beta + W row cpu_table         (one all-gather)
  summary path: T = 2 r alpha + r S beta + S cpu_summary                 (two all-reduces)

Usage: exchange.py [--world 2,4,8] [--buckets 7,100] [--iters 200] [--rounds 5]
       (the fit: --world 2 --buckets 1,7,30,100)
"""

import argparse
import os
import socket
import statistics
import time
from datetime import timedelta

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import gradbus.torch as gbt  # noqa: E402


def one_update(guard, buckets, layout):
    for b in range(buckets):
        guard.record(b, layout[b], (0.0, 0.0, 1.0 + b, -1.0))
    guard.set_loss(0.5)
    guard.exchange(buckets)
    return guard.verdict()


def worker(rank, world, port, buckets, iters, rounds, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    layout = [[(f"p{b}", 1000)] for b in range(buckets)]
    guards = {path: gbt.Guard(policy="abort", agreement=path) for path in ("table", "summary")}
    us = {path: [] for path in guards}
    cpu = {path: [] for path in guards}
    for g in guards.values():
        for _ in range(5):  # warm-up
            one_update(g, buckets, layout)
    for _ in range(rounds):
        for path, g in guards.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(iters):
                v = one_update(g, buckets, layout)
            us[path].append((time.perf_counter() - t0) * 1e6 / iters)
            cpu[path].append((time.process_time() - c0) * 1e6 / iters)
            assert v.proceeded and g.tabled == (iters * len(us[path]) + 5 if path == "table" else 0)
    if rank == 0:
        out.put({p: (statistics.median(us[p]), statistics.median(cpu[p])) for p in us})
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", default="2,4,8")
    ap.add_argument("--buckets", default="7,100")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    print(f"{'world':>5} {'buckets':>7} {'table words':>11} {'summary words':>13} {'table us':>9} {'summary us':>10} "
          f"{'summary/table':>13} {'table CPU us':>12} {'summary CPU us':>14}")
    rows = []
    for world in map(int, a.world.split(",")):
        for buckets in map(int, a.buckets.split(",")):
            q = ctx.Queue()
            for attempt in range(3):  # a free port may be taken by another job before rank 0 listens
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                try:
                    mp.start_processes(worker, args=(world, port, buckets, a.iters, a.rounds, q), nprocs=world,
                                       join=True, start_method="spawn")
                    break
                except mp.ProcessRaisedException as e:
                    if "EADDRINUSE" not in str(e) or attempt == 2:
                        raise
            r = q.get()
            c = gbt._core.agreement_cost(world, buckets)
            (tw, tc), (sw, sc) = r["table"], r["summary"]
            rows.append((c, tw, sw))
            print(f"{world:>5} {buckets:>7} {c['table_bytes'] // 8:>11} {c['summary_bytes'] // 8:>13} {tw:>9.1f} {sw:>10.1f} "
                  f"{sw / tw:>13.2f} {tc:>12.1f} {sc:>14.1f}", flush=True)
    fit(rows)


def fit(rows):
    """The model's constants from the 2-rank rows (2 processes on 2 cores: the only world this
    machine runs without oversubscription, as for MPI's calibration): the table path's intercept and
    slope over the bucket counts give alpha and beta (its CPU per byte folded into beta), then the
    summary path's CPU per byte by least squares through the origin on what alpha and beta leave of
    its times. Rows of other worlds are printed beside the model's times, not fitted."""
    two = [(c, tw, sw) for c, tw, sw in rows if c["rounds"] == 1]
    if len({c["row_bytes"] for c, _, _ in two}) < 2:
        print("fit: needs 2-rank rows of at least two bucket counts")
        return
    xs = [c["table_bytes"] - c["row_bytes"] for c, _, _ in two]
    ys = [tw for _, tw, _ in two]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    beta = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs))
    alpha = my - beta * mx
    left = [(c["summary_bytes"], sw - 2 * alpha - c["summary_bytes_in"] * beta) for c, _, sw in two]
    cpu_summary = max(0.0, sum(s * r for s, r in left) / sum(s * s for s, _ in left))
    print(f"fitted on {len(two)} 2-rank rows: alpha_us: {alpha:.4g}, beta_us_per_byte: {beta:.4g}, "
          f"table_cpu_us_per_byte: 0, summary_cpu_us_per_byte: {cpu_summary:.4g}")
    for c, tw, sw in rows:
        r = c["rounds"]
        mt = r * alpha + (c["table_bytes"] - c["row_bytes"]) * beta
        ms = 2 * r * alpha + c["summary_bytes_in"] * beta + c["summary_bytes"] * cpu_summary
        print(f"  {r} rounds, row {c['row_bytes']} B: table {tw:.0f} us (model {mt:.0f}), summary {sw:.0f} us (model {ms:.0f})")


if __name__ == "__main__":
    main()
