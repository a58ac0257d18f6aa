#!/usr/bin/env python3
"""Run gradbus and the PyTorch twin (bench/pytorch_grpo.py) side by side on one config and print
tokens/s and the ratio. Called by scripts/bench-workload.sh; needs torch only for the PyTorch side.

Both sides are timed the same way, from outside, on rank 0's progress lines: gradbus's launcher
relays `[rank 0] step K done` (flushed per line), the twin prints `step K done` (flushed); the
driver stamps each line with time.perf_counter() as it arrives.
  wall     = stamp(step S-1 done) - stamp(step 0 done): startup (process spawn, bus/rendezvous
             setup, imports) and the warm-up step 0 are excluded; the rollout (sampling with the
             rollout weights), rewards, old/ref log-probs and all updates of steps 1..S-1 are in;
  tokens   = (S - 1) x epochs x minibatches x (per-rank minibatch sequences x T) x ranks,
             T = response_len + 1;
  tokens/s = tokens / wall;
  tokens per CPU-second = tokens / (CPU time of every rank's process between the same two stamps,
             from /proc): on a loaded machine, where each side gets a varying share of the cores,
             the ratio that changes least (spin-waits in barriers count as work).
Repetitions alternate the sides (gradbus first in even reps, PyTorch first in odd ones) so that
drifting background load hits both alike. Reported: the median over reps and min..max, and the
ratio of the medians with the min..max of the per-rep paired ratios.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload_config import load_config, tokens_per_update, updates_per_step  # noqa: E402

STEP_LINE = re.compile(r"^(?:\[rank 0\] )?step (\d+) done")


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def tree_cpu_s(root, seen):
    """CPU seconds (user + system) used so far by `root` and its descendants, from /proc; `seen`
    keeps each process's last reading, so one that has exited still counts."""
    ticks = os.sysconf("SC_CLK_TCK")
    stats = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(d)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks)
    tree, grew = {root}, True
    while grew:
        new = {pid for pid, (ppid, _) in stats.items() if ppid in tree and pid not in tree}
        tree |= new
        grew = bool(new)
    for pid in tree:
        if pid in stats:
            seen[pid] = stats[pid][1]
    return sum(seen.values())


def timed_run(cmd, steps, env=None):
    """Run cmd, stamping rank 0's `step K done` lines with the time and with the CPU time of the
    process tree (every rank) so far. Returns ({K: time}, {K: cpu s}, output tail, total wall)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)
    stamps, cpu, tail, seen = {}, {}, [], {}
    for line in p.stdout:
        now = time.perf_counter()
        m = STEP_LINE.match(line)
        if m:
            stamps[int(m.group(1))] = now
            cpu[int(m.group(1))] = tree_cpu_s(p.pid, seen)
        tail = (tail + [line])[-20:]
    rc = p.wait()
    total = time.perf_counter() - t0
    if rc != 0 or 0 not in stamps or steps - 1 not in stamps:
        sys.exit(f"benchmark run failed (rc {rc}): {' '.join(cmd)}\n" + "".join(tail))
    return stamps, cpu, "".join(tail), total


def run_gradbus(args, cfg, ranks, sets):
    run_dir = tempfile.mkdtemp(prefix="gradbus-bench-")
    try:
        cmd = [args.gradbus, "run", "--np", str(ranks), "--run-dir", run_dir, args.config]
        for s in sets:
            cmd += ["--set", s]
        stamps, cpu, _, total = timed_run(cmd, args.steps)
        upd_ms = 0.0
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            for line in f:
                m = json.loads(line)
                if m["step"] >= 1:
                    upd_ms += m["time_update_ms"]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return stamps, cpu, total, upd_ms / 1e3


def run_pytorch(args, cfg, ranks, sets):
    cmd = [args.python, os.path.join(os.path.dirname(os.path.abspath(__file__)), "pytorch_grpo.py"), args.config,
           "--np", str(ranks)]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    stamps, cpu, _, total = timed_run(cmd, args.steps, env)
    return stamps, cpu, total, None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="examples/tiny.toml")
    ap.add_argument("--steps", type=int, default=30, help="RL steps per run (step 0 is warm-up, not timed)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ranks", default="2,1", help="comma-separated rank counts")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override for BOTH sides")
    ap.add_argument("--gradbus", default="target/release/gradbus")
    ap.add_argument("--python", default=sys.executable, help="python with torch, for the PyTorch side")
    ap.add_argument("--json", help="write all runs and the summary here")
    args = ap.parse_args()
    if args.steps < 2:
        sys.exit("--steps must be at least 2 (step 0 is not timed)")

    sets = [f"steps={args.steps}", "checkpoint.every=0"] + args.set
    cfg = load_config(args.config, sets)
    ranks_list = [int(r) for r in args.ranks.split(",")]
    runs = []
    print(f"config {args.config} {' '.join('--set ' + s for s in sets)}", flush=True)
    print(f"load average at start: {loadavg()}", flush=True)
    for rep in range(args.reps):
        for ranks in ranks_list:
            tokens = (args.steps - 1) * updates_per_step(cfg) * tokens_per_update(cfg, ranks)
            sides = [("gradbus", run_gradbus), ("pytorch", run_pytorch)]
            if rep % 2:
                sides.reverse()
            for side, fn in sides:
                la = loadavg()
                stamps, cpu, total, upd_s = fn(args, cfg, ranks, sets)
                wall = stamps[args.steps - 1] - stamps[0]
                cpu_s = cpu[args.steps - 1] - cpu[0]
                r = {"side": side, "ranks": ranks, "rep": rep, "steps": args.steps, "tokens": tokens,
                     "wall_s": wall, "tokens_per_s": tokens / wall, "process_wall_s": total, "loadavg": la,
                     "cpu_s": cpu_s, "tokens_per_cpu_s": tokens / cpu_s}
                if upd_s is not None:
                    r["update_s"] = upd_s  # gradbus metrics: sum of time_update_ms over steps 1..S-1 (rank 0)
                runs.append(r)
                extra = f", updates {100 * upd_s / wall:.0f}% of it" if upd_s is not None else ""
                print(f"rep {rep} {side:8s} ranks {ranks}: {r['tokens_per_s']:9.0f} tokens/s "
                      f"(timed {wall:.2f} s{extra}; {r['tokens_per_cpu_s']:.0f} tokens per CPU-second; "
                      f"process {total:.1f} s; load {la})", flush=True)

    print(f"load average at end: {loadavg()}")
    summary = table(runs, ranks_list, args.steps, "tokens_per_s", "tokens/s median")
    # The same per CPU-second of every rank between the two stamps: what a loaded machine (where
    # each side gets a varying share of the cores) changes least. Spinning waits count as work.
    table(runs, ranks_list, args.steps, "tokens_per_cpu_s", "tokens/CPU-s median")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "sets": sets, "runs": runs, "summary": summary}, f, indent=1)


def table(runs, ranks_list, steps, key, title):
    """Print, per world size, each side's median and range of `key` over the repetitions and the
    gradbus/PyTorch ratio of the medians (with the range of the paired ratios); return the rows."""
    rows, w = [], len(title) + 1
    print()
    print(f"{'side':8s} {'ranks':>5s} {'steps':>5s} {title:>{w}s} {'min..max':>17s} {'gradbus/PyTorch':>22s}")
    for ranks in ranks_list:
        per = {s: [r for r in runs if r["side"] == s and r["ranks"] == ranks] for s in ("gradbus", "pytorch")}
        med = {s: statistics.median(r[key] for r in per[s]) for s in per}
        paired = [g[key] / p[key] for g, p in zip(per["gradbus"], per["pytorch"])]
        ratio = med["gradbus"] / med["pytorch"]
        for s in ("gradbus", "pytorch"):
            v = [r[key] for r in per[s]]
            rtxt = f"{ratio:.1f}x ({min(paired):.1f}..{max(paired):.1f})" if s == "gradbus" else ""
            print(f"{s:8s} {ranks:5d} {steps:5d} {med[s]:{w}.0f} {min(v):8.0f}..{max(v):<8.0f} {rtxt:>22s}")
        rows.append({"ranks": ranks, "median": med, "ratio": ratio, "paired_ratios": paired})
    return rows


if __name__ == "__main__":
    main()
