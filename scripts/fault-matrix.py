#!/usr/bin/env python3
"""Run gradbus's fault matrix and print one table: fault, phase, ranks, expected, observed, seconds to
end, leftovers. Every case launches the real `gradbus run` on examples/tiny.toml with a fault plan in
GRADBUS_FAULTS (see worker/src/faults.rs) or a bad input, then checks the exit code, that no process of
the job survives and that no /dev/shm segment of the job is left.

    scripts/fault-matrix.py                           # builds release first; ~1-2 minutes on 2 cores
    scripts/fault-matrix.py --set 'overlap="on"'      # extra --set overrides for every case
"""
import json, os, signal, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = os.path.join(ROOT, "target/release/gradbus")
SHORT = ["--set", "steps=3", "--set", "rl.epochs=2", "--set", "rl.minibatches=2", "--set", "checkpoint.every=1"]
SHORT += sys.argv[1:]


def fault(kind, rank=1, step=1, minibatch=1, **kw):
    fields = {"kind": kind, "rank": rank, "step": step, "minibatch": minibatch, **kw}
    body = "\n".join(f"{k} = {json.dumps(v)}" for k, v in fields.items())
    return "[[faults]]\n" + body + "\n"


# name, phase, np, extra args, fault plan, expected exit code, note
CASES = [
    ("none", "-", 4, [], "", 0),
    ("nan, policy abort", "backward", 4, [], fault("nan"), 3),
    ("inf, policy abort", "backward", 4, [], fault("inf"), 3),
    ("nan, policy skip", "backward", 4, ["--set", "policy=skip"], fault("nan"), 0),
    ("nan transient, policy rerun", "backward", 4, ["--set", "policy=rerun"], fault("nan", transient=True), 0),
    ("nan persistent, policy rerun", "backward", 4, ["--set", "policy=rerun"], fault("nan"), 3),
    ("kill -9", "forward", 4, [], fault("kill", phase="forward"), 4),
    ("kill -9", "backward", 4, [], fault("kill", phase="backward"), 4),
    ("kill -9", "reduce", 4, [], fault("kill", phase="reduce"), 4),
    ("kill -9", "between_buckets", 4, [], fault("kill", phase="between_buckets"), 4),
    ("kill -9", "checkpoint", 2, [], fault("kill", rank=0, step=2, minibatch=0, phase="checkpoint"), 4),
    ("exit 9", "forward", 3, [], fault("exit", code=9), 4),
    ("stall > deadline", "forward", 3, ["--set", "collective_timeout_s=2"], fault("stall", seconds=30.0), 5),
    ("unknown config key", "start", 2, ["--set", "no_such_key=1"], "", 2),
    ("malformed hostfile", "start", 0, ["--hostfile", "HOSTFILE"], "", 2),
    ("missing config", "start", 2, ["CONFIG=missing.toml"], "", 2),
]


def leftovers(job):
    segs = [n for n in os.listdir("/dev/shm") if n.startswith(f"gradbus-{job}")] if job else []
    procs = subprocess.run(["pgrep", "-f", f"GRADBUS_JOB_ID={job}"], capture_output=True, text=True).stdout.split() if job else []
    # Workers carry the job id in their environment; pgrep -f only sees argv, so also scan /proc.
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if f"GRADBUS_JOB_ID={job}".encode() in f.read():
                        procs.append(pid)
            except OSError:
                pass
    return segs, sorted(set(procs))


def run_case(tmp, case):
    name, phase, np_, extra, plan, want = case
    run_dir = os.path.join(tmp, str(abs(hash(name + phase))))
    config = "examples/tiny.toml"
    args = [GB, "run", "--run-dir", run_dir]
    if np_:
        args += ["--np", str(np_)]
    for a in extra:
        if a == "HOSTFILE":
            hf = os.path.join(tmp, "bad-hostfile")
            open(hf, "w").write("localhost slots=2\nlocalhost slots=two\n")
            args.append(hf)
        elif a.startswith("CONFIG="):
            config = a.split("=", 1)[1]
        else:
            args.append(a)
    args += [config] + SHORT
    env = dict(os.environ, GRADBUS_FAULTS=plan)
    t0 = time.monotonic()
    p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    secs = time.monotonic() - t0
    job = None
    try:
        job = json.load(open(os.path.join(run_dir, "launch.json"))).get("job_id")
    except (OSError, ValueError):
        pass
    segs, procs = leftovers(job)
    ok = p.returncode == want and not segs and not procs
    extra_check = ""
    if "checkpoint" == phase:
        # A kill during a checkpoint write must not leave a checkpoint that --resume would load half-written.
        r = subprocess.run([GB, "run", "--np", str(np_), "--resume", run_dir, config] + SHORT, cwd=ROOT,
                           env=dict(os.environ, GRADBUS_FAULTS=""), capture_output=True, text=True, timeout=120)
        extra_check = f"; resume exit {r.returncode}"
        ok = ok and r.returncode == 0
    last = (p.stderr.strip().splitlines() or [""])[-1][:70]
    return name, phase, np_ or 2, want, p.returncode, secs, len(segs) + len(procs), ok, last + extra_check


def main():
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    if sys.argv[1:]:
        print(f"every case with: {' '.join(sys.argv[1:])}\n")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_case(tmp, c) for c in CASES]
    print(f"| fault | phase | ranks | expected | observed | seconds to end | leftovers | ok | last line |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, phase, n, want, got, secs, left, ok, last in rows:
        print(f"| {name} | {phase} | {n} | {want} | {got} | {secs:.1f} | {left} | {'yes' if ok else 'NO'} | `{last}` |")
    survived = sum(r[7] for r in rows)
    print(f"\nfaults tried: {len(rows)}, ended as expected with nothing left behind: {survived}, data lost: "
          f"{'none' if survived == len(rows) else 'see rows marked NO'}")
    return 0 if survived == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
