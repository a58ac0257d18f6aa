#!/usr/bin/env python3
"""What the silent-data-corruption guard costs a healthy update (issue 29 item 5): the same 2-rank
run with the guard's checks on (the default) and off (`sdc.replicas=false`, `sdc.outliers=false`:
no weight read-back, no peaks or chunk hashes in the reduce, an optimizer that hashes nothing it
reads, no decisions), in the same invocation, alternated run by run (on, off, off, on, ...) so that a change of the machine's
load falls on both alike. At the tiny size (examples/tiny.toml, 103,168 parameters) and at 3.2M
(model.channels=256, model.layers=4). Per run: rank 0's `time_update_ms` of every update after the
first step (its first updates warm the caches); per size: the median over all runs' updates of each
mode, the ratio on/off and the difference per update, and the ratio of the runs' medians' medians.
Both modes give the same bits (the guard only reads); the script checks that the runs' final
weights' checksums agree. A benchmark: it prints numbers, asserts only that the runs ran.

    bench/sdc-cost.py                    # builds release first; 3 runs per mode and size
    bench/sdc-cost.py --reps 5 --steps 6 --big-steps 3
    bench/sdc-cost.py --reps 10 --steps 8 --split   # and each check alone: a second table
"""
import argparse, atexit, json, os, re, shutil, statistics, subprocess, sys, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = os.path.join(ROOT, "target/release/gradbus")
OFF = ["--set", "sdc.replicas=false", "--set", "sdc.outliers=false"]
# --split: each check alone (the reduce's peaks and chunk hashes run with either).
HALVES = {"replicas": ["--set", "sdc.outliers=false"], "outliers": ["--set", "sdc.replicas=false"]}
BIG = ["--set", "model.channels=256", "--set", "model.layers=4"]


def run(run_dir, steps, sets):
    args = [GB, "run", "--np", "2", "--run-dir", run_dir, "examples/tiny.toml", "--set", f"steps={steps}",
            "--set", "checkpoint.every=0"] + sets
    p = subprocess.run(args, cwd=ROOT, env=dict(os.environ, GRADBUS_FAULTS=""), capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"sdc-cost: {' '.join(args)} exited {p.returncode}:\n{p.stderr[-2000:]}")
    lines = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if l.strip()]
    params = re.search(r"(\d+) parameters in", p.stderr)[1]
    times = [l["time_update_ms"] for l in lines if l["step"] > 0]
    return params, times, lines[-1]["checksum"]


def load():
    return open("/proc/loadavg").read().split()[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="runs per mode and size (default 3)")
    ap.add_argument("--steps", type=int, default=4, help="steps of the tiny runs (16 updates each; default 4)")
    ap.add_argument("--big-steps", type=int, default=2, help="steps of the 3.2M runs (default 2)")
    ap.add_argument("--split", action="store_true", help="also run each check alone (a second table)")
    a = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "--quiet", "--bin", "gradbus"], cwd=ROOT, check=True)
    cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    print(f"CPU: {cpu}, {os.cpu_count()} cores; load average at the start {load()}")
    print()
    print("| size | params | updates per mode | on: median ms | off: median ms | on / off | on - off, ms "
          "| on / off of the runs' medians | load |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    tmp = tempfile.mkdtemp(prefix="gradbus-sdc-cost-")
    atexit.register(shutil.rmtree, tmp, True)  # the run directories go with the script
    halves = []
    for size, steps, sets in [("tiny", a.steps, []), ("3.2M", a.big_steps, BIG)]:
        modes = {"on": [], "off": OFF, **(HALVES if a.split else {})}
        times = {m: [] for m in modes}
        medians = {m: [] for m in modes}
        sums, params, loads = set(), "?", [load()]
        for rep in range(a.reps):
            for mode in (list(modes) if rep % 2 == 0 else list(reversed(modes))):
                d = os.path.join(tmp, f"{size}-{mode}-{rep}")
                params, t, checksum = run(d, steps, sets + modes[mode])
                times[mode] += t
                medians[mode].append(statistics.median(t))
                sums.add(checksum)
        loads.append(load())
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        mm = statistics.median(medians["on"]) / statistics.median(medians["off"])
        same = "" if len(sums) == 1 else " (final weights DIFFER between runs)"
        print(f"| {size} | {params} | {len(times['on'])} | {on:.3f} | {off:.3f} | {on / off:.4f} | {on - off:+.3f} "
              f"| {mm:.4f} | {'-'.join(loads)} |{same}")
        for half in HALVES if a.split else {}:
            h = statistics.median(times[half])
            halves.append(f"| {size} | {half} only | {h:.3f} | {off:.3f} | {h / off:.4f} | {h - off:+.3f} |")
    if halves:
        print()
        print("| size | check | median ms | off: median ms | ratio | difference, ms |")
        print("| --- | --- | --- | --- | --- | --- |")
        print("\n".join(halves))
    print()
    print("on: the default (sdc.replicas, sdc.outliers); off: both false. ms: rank 0's time_update_ms "
          "(forward, backward, reduce, agreement, optimizer) of the updates after each run's first step.")


if __name__ == "__main__":
    main()
