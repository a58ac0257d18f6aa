#!/usr/bin/env python3
"""Where the silent-data-corruption guard's CPU time goes (issue 29 item 5), part by part: the same
2-rank tiny run as bench/sdc-cost.py with the checks on and off, each under `perf record`, runs
alternated (on, off, off, on, ...; with several binaries, each binary's pair in turn), and per part
of the guard (its functions, grouped below) the median over the runs of the CPU it took, in us per
update and rank, on, off and on - off. A profile counts the process's own CPU, so a change of the
machine's load moves it far less than it moves the wall-clock ratio that sdc-cost.py prints; the
end-to-end question stays sdc-cost.py's. A benchmark: it prints numbers. Needs `perf` (Debian:
linux-perf) and perf_event_paranoid <= 2.

    bench/sdc-profile.py                                  # builds release first; 4 runs per mode
    bench/sdc-profile.py --runs 8 --bin /tmp/old/gradbus --bin target/release/gradbus
"""
import argparse, collections, importlib.util, json, os, re, shutil, statistics, subprocess, sys, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("sdc_cost", os.path.join(ROOT, "bench/sdc-cost.py"))
sdc_cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sdc_cost)
# The guard's parts: a regular expression over the profile's function names. The optimizer's group
# is the whole optimizer (its hash runs inside AdamW's loop, so it has no function of its own;
# before 2026-12-02 a scaling pass hashed, `absorb_and_scale`). The lane hash's row holds AdamW's hash
# of the weights it writes too, which runs in both modes (its off column).
PARTS = {
    "the optimizer (scale, AdamW, their hashes)":
        r"ops::scale::|adamw|absorb_and_scale|scale_and_checksum|update_and_scale|absorb_groups",
    "the lane hash (weights read in backward and written by AdamW, reducers' sums)": r"checksum::lanes::absorb(::|$)",
    "the peaks' search (largest)": r"health::largest",
    "the folds (finish_all)": r"checksum::finish_all",
    "the reduce's loop and bookkeeping": r"reduce::reduce$|reduce_chunk|fused::sum_block",
    "the outlier rule (OutlierDetector)": r"OutlierDetector",
    "the kernels' level dispatch": r"simd::process_level",
}
SAMPLE = re.compile(r"\s*[\d.]+%\s+(\d+)\s+\[.\]\s+(.*?)\s*$")
# One sample per PERIOD ns of the process's CPU (a fixed period: a frequency can be lowered by the
# kernel, perf_event_max_sample_rate, without a word).
PERIOD = 100_000


def profile(binary, mode, steps, tmp):
    """CPU us per update and rank of each function, and of the whole process."""
    data, run_dir = os.path.join(tmp, "perf.data"), os.path.join(tmp, "run")
    shutil.rmtree(run_dir, ignore_errors=True)
    args = [binary, "run", "--np", "2", "--run-dir", run_dir, "examples/tiny.toml", "--set", f"steps={steps}",
            "--set", "checkpoint.every=0"] + (sdc_cost.OFF if mode == "off" else [])
    p = subprocess.run(["perf", "record", "-q", "-e", "cpu-clock", "-c", str(PERIOD), "-o", data, "--"] + args, cwd=ROOT,
                       env=dict(os.environ, GRADBUS_FAULTS=""), capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"sdc-profile: perf record {' '.join(args)} exited {p.returncode}:\n{p.stderr[-2000:]}\n"
                 "(hint: perf_event_paranoid must be <= 2: sysctl kernel.perf_event_paranoid=2)")
    rep = subprocess.run(["perf", "report", "-i", data, "-n", "--no-children", "--sort", "symbol", "--stdio"],
                         capture_output=True, text=True, check=True).stdout
    lines = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if l.strip()]
    updates = 2 * sum(1 for l in lines if "time_update_ms" in l)  # rank 0's lines, 2 ranks
    us = PERIOD / 1e3 / updates
    funcs = collections.Counter()
    for line in rep.splitlines():
        m = SAMPLE.match(line)
        if m and not line.startswith("#"):
            funcs[m[2]] += int(m[1]) * us
    return funcs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=4, help="runs per binary and mode (default 4)")
    ap.add_argument("--steps", type=int, default=300, help="RL steps per run (16 updates each; default 300)")
    ap.add_argument("--bin", action="append", help="a gradbus binary (repeatable; default target/release/gradbus)")
    a = ap.parse_args()
    if shutil.which("perf") is None:
        sys.exit("sdc-profile: no `perf` on PATH (hint: apt-get install linux-perf)")
    bins = [os.path.abspath(b) for b in a.bin] if a.bin else [sdc_cost.GB]
    if not a.bin:
        subprocess.run(["cargo", "build", "--release", "--quiet", "--bin", "gradbus"], cwd=ROOT, check=True)
    cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    print(f"CPU: {cpu}, {os.cpu_count()} cores; load average at the start {sdc_cost.load()}")
    tmp = tempfile.mkdtemp(prefix="gradbus-sdc-profile-")
    got = {(b, m): [] for b in bins for m in ("on", "off")}
    try:
        for run in range(a.runs):
            for b in bins if run % 2 == 0 else reversed(bins):
                for mode in ("on", "off") if run % 2 == 0 else ("off", "on"):
                    got[(b, mode)].append(profile(b, mode, a.steps, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"load average at the end {sdc_cost.load()}; {a.runs} runs per binary and mode, tiny, 2 ranks, "
          f"{a.steps} steps; medians over the runs, us of CPU per update and rank")
    print()
    print("| part (functions) | " + " | ".join(f"{b} {c}" for b in bins
                                             for c in ("on", "off", "on - off")) + " |")
    print("| --- |" + " --- |" * (3 * len(bins)))
    rows = list(PARTS.items()) + [("the whole process", None)]
    for part, rx in rows:
        cells = []
        for b in bins:
            med = {m: statistics.median(sum(v for f, v in funcs.items() if rx is None or re.search(rx, f))
                                        for funcs in got[(b, m)]) for m in ("on", "off")}
            cells += [f"{med['on']:.1f}", f"{med['off']:.1f}", f"{med['on'] - med['off']:+.1f}"]
        print(f"| {part} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
