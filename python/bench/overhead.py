#!/usr/bin/env python3
"""The guard's cost on a real DDP script: bench/pytorch_grpo.py (the GRPO twin, gloo, CPU) with DDP's
built-in all-reduce (no hook), PyTorch's Python `default_hooks.allreduce_hook`, and the gradbus
guard's hook (policy skip; its default agreement, and the table all-gathered every update), alternated `--reps` times in one run, tokens/s side by side (the twin's own definition: steps 1.. of the run,
startup and step 0 excluded), and the CPU seconds each whole run used (user + sys of every process,
startup included), which a busy machine disturbs less than wall time. A benchmark, not a test: it
prints numbers and asserts nothing.

Usage: overhead.py [CONFIG.toml] [--np N] [--reps R] [--set key=value ...]
Run it with the python that has torch and gradbus (target/pyvenv/bin/python after python/test.sh).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


VARIANTS = {
    "built-in": [],
    "allreduce_hook": ["--comm-hook", "allreduce"],
    "gradbus guard": ["--guard", "skip"],
    "guard, table": ["--guard", "skip", "--agreement", "table"],
    "guard + sdc": ["--guard", "skip", "--sdc"],
}
"""The guard with its default agreement (at 2 ranks the rows ride the last bucket's all-reduce), and
with the per-rank table all-gathered every update (the default before issue 31), as a baseline; and
the guard with its silent-data-corruption checks on every update (`sdc=True, replica_every=1`)."""


def one(config, np, sets, extra):
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, os.path.join(ROOT, "bench", "pytorch_grpo.py"), config, "--np", str(np), "--out", out.name]
        cmd += [x for s in sets for x in ("--set", s)]
        cmd += extra
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        r = json.load(open(out.name))
        r["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config", nargs="?", default=os.path.join(ROOT, "examples", "tiny.toml"))
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--set", action="append", default=[])
    a = ap.parse_args()
    rows = {name: [] for name in VARIANTS}
    cpu = {name: [] for name in VARIANTS}
    for rep in range(a.reps):
        for name, extra in VARIANTS.items():
            r = one(a.config, a.np, a.set, extra)
            rows[name].append(r["tokens_per_s"])
            cpu[name].append(r["cpu_s"])
            print(f"rep {rep} {name:15s} {r['tokens_per_s']:8.0f} tokens/s ({r['wall_s']:.2f} s, "
                  f"{r['skipped']} skipped), {r['cpu_s']:.2f} CPU s", flush=True)
    base = rows["allreduce_hook"]
    for name, xs in rows.items():
        ratios = [x / b for x, b in zip(xs, base)]
        print(f"median {name:15s} {statistics.median(xs):8.0f} tokens/s, vs allreduce_hook "
              f"{statistics.median(ratios):.3f} (paired {min(ratios):.3f}..{max(ratios):.3f}); "
              f"CPU {statistics.median(cpu[name]):.2f} s per run")


if __name__ == "__main__":
    main()
