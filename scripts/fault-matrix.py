#!/usr/bin/env python3
"""Run gradbus's fault matrix and print one table: fault, phase, ranks, expected, observed, seconds to
end, leftovers. Every case launches the real `gradbus run` on examples/tiny.toml with a fault plan in
GRADBUS_FAULTS (see worker/src/faults.rs) or a bad input, then checks the exit code, that no process of
the job survives and that no /dev/shm segment of the job is left. Then the corruption rows: damage
an artifact of a finished run (a checkpoint's state.bin or DONE, a dump, report.json, a metrics
line) and check that `--resume`, `gradbus replay` or `gradbus report` refuses it (or skips it, for a
newer checkpoint than one that verifies), naming each damaged file, and that nothing of either job
is left behind. Every column is measured; a row passes only when everything it shows is as expected,
and the script exits 1 if any row does not (scripts/test.sh runs it in CI).

"data lost" is measured: where a fault should lose nothing (no fault, a transient NaN rerun, a kill
during a checkpoint write then --resume, a corrupt newest checkpoint then --resume, a transient or
repaired bit flip), the final weights' checksum (the last metrics.jsonl line) and every rank's
weights as read back after the last update (its log's `final weights checksum`) are compared with
an uninterrupted run's.

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


def flip_fault(target, bit, **kw):
    # Step 2: the outlier rule judges once its history holds `sdc.warmup` updates (4 of SHORT's 12).
    return fault("bitflip", step=2, target=target, param="head.weight", element=5, bit=bit, **kw)


# name, phase, np, extra args, fault plan, expected exit code, note
CASES = [
    ("none", "-", 4, [], "", 0),
    ("nan, policy abort", "backward", 4, [], fault("nan"), 3),
    ("inf, policy abort", "backward", 4, [], fault("inf"), 3),
    ("nan, policy skip", "backward", 4, ["--set", "policy=skip"], fault("nan"), 0),
    ("nan transient, policy rerun", "backward", 4, ["--set", "policy=rerun"], fault("nan", transient=True), 0),
    ("nan persistent, policy rerun", "backward", 4, ["--set", "policy=rerun"], fault("nan"), 3),
    ("scale 1e300 on every rank (sum overflows)", "backward", 2, [], fault("scale", rank=0, factor=1e300) + fault("scale", rank=1, factor=1e300), 3),
    ("scale 1e300 on one rank (f32 norm overflows)", "backward", 2, [], fault("scale", factor=1e300), 0),
    ("kill -9", "forward", 4, [], fault("kill", phase="forward"), 4),
    ("kill -9", "backward", 4, [], fault("kill", phase="backward"), 4),
    ("kill -9", "reduce", 4, [], fault("kill", phase="reduce"), 4),
    ("kill -9", "between_buckets", 4, [], fault("kill", phase="between_buckets"), 4),
    ("kill -9", "checkpoint", 2, [], fault("kill", rank=0, step=2, minibatch=0, phase="checkpoint"), 4),
    ("exit 9", "forward", 3, [], fault("exit", code=9), 4),
    ("stall > deadline", "forward", 3, ["--set", "collective_timeout_s=2"], fault("stall", seconds=30.0), 5),
    # Silent data corruption (docs/reliability.md, "Silent data corruption"): a flipped bit, finite.
    ("bitflip grad exponent bit 30, transient", "backward", 2, [], flip_fault("grad", 30, transient=True), 0),
    ("bitflip grad exponent bit 30, persistent", "backward", 2, [], flip_fault("grad", 30), 3),
    ("bitflip reduced sign bit, repaired", "reduce", 2, [], flip_fault("reduced", 31), 0),
    ("bitflip weight exponent bit 30, repaired", "update", 2, [], flip_fault("weight", 30), 0),
    ("unknown config key", "start", 2, ["--set", "no_such_key=1"], "", 2),
    ("malformed hostfile", "start", None, ["--hostfile", "HOSTFILE"], "", 2),
    ("missing config", "start", 2, ["CONFIG=missing.toml"], "", 2),
]


def job_id(run_dir):
    """The job id the launcher recorded in RUN_DIR/launch.json (None when nothing was launched)."""
    try:
        return json.load(open(os.path.join(run_dir, "launch.json"))).get("job_id")
    except (OSError, ValueError):
        return None


def leftovers(jobs, run_dir):
    """Segments of the jobs and processes that carry a job id in their environment or the run
    directory in their command line (workers, launchers, replay, report), other than this script."""
    jobs = [j for j in jobs if j]
    segs = [n for n in os.listdir("/dev/shm") if any(n.startswith(f"gradbus-{j}-") for j in jobs)]
    marks = [f"GRADBUS_JOB_ID={j}".encode() for j in jobs]
    procs = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] in "ZX"
        except (OSError, IndexError):
            continue
        if not zombie and (any(m in env for m in marks) or run_dir.encode() in cmd):
            procs.append(pid)
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
    segs, procs = leftovers([job_id(run_dir)], run_dir)
    ok = p.returncode == want and not segs and not procs
    lost = "-"
    if name == "none" or "transient" in name or "repaired" in name:
        lost = data_lost(run_dir, np_)
        ok = ok and lost == "none"
    extra_check = ""
    if "checkpoint" == phase:
        # A kill during a checkpoint write must not leave a checkpoint that --resume would load half-written.
        r = subprocess.run([GB, "run", "--np", str(np_), "--resume", run_dir, config] + SHORT, cwd=ROOT,
                           env=dict(os.environ, GRADBUS_FAULTS=""), capture_output=True, text=True, timeout=120)
        extra_check = f"; resume exit {r.returncode}"
        more_segs, more_procs = leftovers([job_id(run_dir)], run_dir)
        segs, procs = segs + more_segs, procs + more_procs
        lost = data_lost(run_dir, np_)
        ok = ok and r.returncode == 0 and not segs and not procs and lost == "none"
    last = (p.stderr.strip().splitlines() or [""])[-1][:70]
    ranks = np_ if np_ is not None else "-"
    return name, phase, ranks, want, p.returncode, secs, len(segs) + len(procs), lost, ok, last + extra_check


REFERENCE = {}


def final_checksum(run_dir):
    """The checksum of the weights after the last update, from the last metrics line."""
    try:
        lines = open(os.path.join(run_dir, "metrics.jsonl")).read().split("\n")
        return json.loads([l for l in lines if l.strip()][-1])["checksum"]
    except (OSError, ValueError, IndexError, KeyError):
        return None


def data_lost(run_dir, np_):
    """'none' when the run ended with the weights of an uninterrupted run of the same size, else 'YES'."""
    if np_ not in REFERENCE:
        ref = tempfile.mkdtemp(prefix="gradbus-fm-ref-")
        subprocess.run([GB, "run", "--np", str(np_), "--run-dir", ref, "examples/tiny.toml"] + SHORT, cwd=ROOT,
                       env=dict(os.environ, GRADBUS_FAULTS=""), capture_output=True, text=True, timeout=120)
        REFERENCE[np_] = final_checksum(ref)
    got = final_checksum(run_dir)
    # Every rank's weights as it read them back after the last update (rank 0's metrics line holds
    # the checksum its optimizer wrote): a replica the guard left damaged is data lost too.
    replicas = final_replicas(run_dir, np_)
    odd = [r for r in replicas if r != REFERENCE[np_]]
    if got is not None and got == REFERENCE[np_] and not odd:
        return "none"
    return f"YES ({got}, replicas {replicas} vs {REFERENCE[np_]})"


def final_replicas(run_dir, np_):
    """Each rank's last 'final weights checksum' log line (the replica check after the last update)."""
    out = []
    for k in range(np_):
        try:
            log = open(os.path.join(run_dir, f"rank-{k}.log")).read()
        except OSError:
            continue
        # The last one: a resumed run appends to the log of the run it resumes.
        out += [l.split("checksum ")[1].split()[0] for l in log.splitlines() if "final weights checksum" in l][-1:]
    return out


def flip(path, at=None):
    b = bytearray(open(path, "rb").read())
    b[len(b) // 2 if at is None else at] ^= 0x10
    open(path, "wb").write(bytes(b))


def truncate(path):
    b = open(path, "rb").read()
    open(path, "wb").write(b[: len(b) - 7])


def ckpt(run_dir, step, name):
    return os.path.join(run_dir, "checkpoints", f"step-{step:06d}", name)


def ckpt_file(step, name):
    return f"checkpoints/step-{step:06d}/{name}"


# name, what is damaged, how, the damaged files (as a refusal must name them, relative to the run
# directory), what reads it, expected exit, whether it should lose nothing
CORRUPT = [
    ("flipped byte", "newest checkpoint state.bin", lambda d: flip(ckpt(d, 2, "state.bin")),
     [ckpt_file(2, "state.bin")], "resume", 0, True),
    ("truncated", "newest checkpoint state.bin", lambda d: truncate(ckpt(d, 2, "state.bin")),
     [ckpt_file(2, "state.bin")], "resume", 0, True),
    ("flipped byte", "newest checkpoint DONE", lambda d: flip(ckpt(d, 2, "DONE"), 20),
     [ckpt_file(2, "DONE")], "resume", 0, True),
    ("missing DONE", "newest checkpoint", lambda d: os.remove(ckpt(d, 2, "DONE")),
     [ckpt_file(2, "DONE")], "resume", 0, True),
    ("flipped byte", "every checkpoint state.bin", lambda d: [flip(ckpt(d, s, "state.bin")) for s in (1, 2)],
     [ckpt_file(1, "state.bin"), ckpt_file(2, "state.bin")], "resume", 2, False),
    ("flipped byte", "dumps/rank-1.bin", lambda d: flip(os.path.join(d, "dumps", "rank-1.bin")),
     ["dumps/rank-1.bin"], "replay", 2, False),
    ("flipped byte", "report.json", lambda d: flip(os.path.join(d, "report.json")),
     ["report.json"], "report", 2, False),
    ("flipped byte", "metrics.jsonl line 1", lambda d: flip(os.path.join(d, "metrics.jsonl"), 30),
     ["metrics.jsonl:1"], "report", 2, False),
]


def run_corrupt(tmp, case):
    how, what, damage, damaged, reader, want, lossless = case
    run_dir = os.path.join(tmp, "c" + str(abs(hash(how + what))))
    np_ = 2
    # A finished run to damage: 2 steps with a checkpoint after each, or an abort (for dump and report).
    plan = fault("nan", step=1, minibatch=1) if reader in ("replay", "report") else ""
    first = subprocess.run([GB, "run", "--np", str(np_), "--run-dir", run_dir, "examples/tiny.toml"] + SHORT
                           + ["--set", "steps=2"], cwd=ROOT, env=dict(os.environ, GRADBUS_FAULTS=plan),
                           capture_output=True, text=True, timeout=120)
    first_job = job_id(run_dir)
    damage(run_dir)
    t0 = time.monotonic()
    if reader == "resume":
        args = [GB, "run", "--np", str(np_), "--resume", run_dir, "examples/tiny.toml"] + SHORT
    elif reader == "replay":
        args = [GB, "replay", os.path.join(run_dir, "dumps", "rank-1.bin")]
    else:
        args = [GB, "report", run_dir]
    p = subprocess.run(args, cwd=ROOT, env=dict(os.environ, GRADBUS_FAULTS=""), capture_output=True, text=True,
                       timeout=120)
    secs = time.monotonic() - t0
    out = p.stdout + p.stderr
    refusals = [l for l in out.splitlines() if "checksum mismatch" in l or "truncated" in l or "no DONE" in l]
    # Each damaged file is named by a refusal (an error, or the warning of a skipped checkpoint).
    unnamed = [f for f in damaged if not any(os.path.join(run_dir, f) in l for l in refusals)]
    reader_job = job_id(run_dir) if reader == "resume" else None
    segs, procs = leftovers([first_job, reader_job], run_dir)
    lost = data_lost(run_dir, np_) if lossless else "-"
    ok = (first.returncode in (0, 3) and p.returncode == want and not unnamed and not segs and not procs
          and lost in ("none", "-"))
    last = (refusals or [""])[0].split("] ")[-1].replace(run_dir, "RUN").replace("`", "'").strip()[:100]
    if unnamed:
        last = f"NOT NAMED: {', '.join(unnamed)}; {last}"
    return f"{how}: {what}", reader, np_, want, p.returncode, secs, len(segs) + len(procs), lost, ok, last


def main():
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    if sys.argv[1:]:
        print(f"every case with: {' '.join(sys.argv[1:])}\n")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_case(tmp, c) for c in CASES] + [run_corrupt(tmp, c) for c in CORRUPT]
    print("| fault | phase / reader | ranks | expected | observed | seconds to end | leftovers | data lost | ok | last line |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, phase, n, want, got, secs, left, lost, ok, last in rows:
        print(f"| {name} | {phase} | {n} | {want} | {got} | {secs:.1f} | {left} | {lost} | {'yes' if ok else 'NO'} | `{last}` |")
    survived = sum(r[8] for r in rows)
    measured = [r for r in rows if r[7] != "-"]
    lost = [r for r in measured if r[7] != "none"]
    print(f"\nfaults tried: {len(rows)}, ended as expected with nothing left behind: {survived}; data lost "
          f"(final weights' checksum vs an uninterrupted run, {len(measured)} rows that should lose nothing): "
          f"{'none' if not lost else f'{len(lost)} rows'}")
    return 0 if survived == len(rows) and not lost else 1


if __name__ == "__main__":
    sys.exit(main())
