#!/usr/bin/env python3
"""The guard's cost on a real DDP script: bench/pytorch_grpo.py (the GRPO twin, gloo, CPU) with
PyTorch's default all-reduce hook and with the gradbus guard's hook (policy skip), alternated
`--reps` times in one run, tokens/s side by side (the twin's own definition: steps 1.. of the run,
startup and step 0 excluded). A benchmark, not a test: it prints numbers and asserts nothing.

Usage: overhead.py [CONFIG.toml] [--np N] [--reps R] [--set key=value ...]
Run it with the python that has torch and gradbus (target/pyvenv/bin/python after python/test.sh).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def one(config, np, sets, guard):
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, os.path.join(ROOT, "bench", "pytorch_grpo.py"), config, "--np", str(np), "--out", out.name]
        cmd += [x for s in sets for x in ("--set", s)]
        if guard:
            cmd += ["--guard", "skip"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.load(open(out.name))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config", nargs="?", default=os.path.join(ROOT, "examples", "tiny.toml"))
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--set", action="append", default=[])
    a = ap.parse_args()
    rows = {"default hook": [], "gradbus guard": []}
    for rep in range(a.reps):
        for name, guard in (("default hook", False), ("gradbus guard", True)):
            r = one(a.config, a.np, a.set, guard)
            rows[name].append(r["tokens_per_s"])
            print(f"rep {rep} {name:14s} {r['tokens_per_s']:10.0f} tokens/s ({r['wall_s']:.2f} s)", flush=True)
    base = statistics.median(rows["default hook"])
    guarded = statistics.median(rows["gradbus guard"])
    ratios = [g / d for d, g in zip(rows["default hook"], rows["gradbus guard"])]
    print(f"median: default hook {base:.0f} tokens/s, gradbus guard {guarded:.0f} tokens/s, "
          f"guard/default {guarded / base:.3f} (paired {min(ratios):.3f}..{max(ratios):.3f})")


if __name__ == "__main__":
    main()
