#!/usr/bin/env python3
"""The PyTorch guard with CUDA tensors, in one run (scripts/gpu-check.d/80-python-guard runs it).

Checks, each a real job on GPU 0 (python/tests/ddp_case.py, fsdp_case.py), run a few at a time:
  1. DDP, world 1 over NCCL: a clean guarded run equals plain DDP bit for bit (losses, weights, Adam
     state); a planted NaN aborts with a report naming the rank, parameter and element; skip keeps
     the weights and Adam state; fp16 autocast with a GradScaler equals the plain GradScaler run.
  2. DDP, 2 ranks sharing GPU 0 over gloo with CUDA tensors: the same clean, NaN and skip cases.
  3. FSDP2 (gradbus.fsdp), 2 ranks sharing GPU 0 over gloo (gradbus.fsdp refuses world 1, where
     FSDP2 reduces nothing; NCCL refuses two ranks on one device): clean bitwise FSDP2 alone,
     planted NaN, skip - each first runs FSDP2 alone, and where torch itself refuses that setting in
     one of the two known ways (`FSDP_NOT_RUN`: gloo's collective timed out, or gloo refused a CUDA
     tensor) the check is NOT RUN, said with torch's message; any other error is FAILED.
  4. the guard's overhead against PyTorch's `allreduce_hook`, world 1 over NCCL, on a model of
     --params-m million parameters (default 100: 6 x Linear(4096, 4096), batch 256, AdamW), wall
     time per update with CUDA synchronised, alternated rounds (measured alone, after the checks):
     a benchmark with the target guard/hook <= 1.02 (2% of an update).

Output: the step contract's lines of scripts/gpu-check.sh - a `ROW` per check as it ends (so that a
run killed over its budget still shows what passed), a `NOTRUN` line instead for a check NOT RUN,
then the overhead's `ROW` and `TARGET`, and `CHECKS n` (the checks that passed) - and a last line.
Exit 0 every check that ran passed (a missed target and the NOTRUN lines are gpu-check.sh's to
judge), 1 a check failed or did not end by --deadline, 3 no GPU.

Usage:
  gpu_check.py                 on a machine with a GPU
  gpu_check.py --cpu           every check on the CPU over gloo (and the overhead on a small model):
                               the whole logic, where there is no GPU (CI runs it)

`import gradbus` must find the package (80-python-guard puts the bundle's wheel on PYTHONPATH). Run
from anywhere: ddp_case is imported from this file's tests/ folder.
"""

import argparse
import concurrent.futures
import multiprocessing
import os
import re
import socket
import statistics
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
# `python python/gpu_check.py` puts python/ first on the path, where the source package (without its
# native core) would shadow the installed one: import gradbus from the installation, ddp_case from tests/.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, os.path.join(HERE, "tests"))

import torch  # noqa: E402

import fsdp_case  # noqa: E402
from ddp_case import run, same_state  # noqa: E402

NAN = {"rank": 0, "step": 2, "param": "mid.weight", "element": 4321, "value": "nan"}
# The overhead's target: the guard's update at most 2% slower than allreduce_hook's.
OVERHEAD_TARGET = 1.02


def clean(world, base, tmp):
    plain = run(world, dict(base, guard=None), os.path.join(tmp, "plain"))
    guarded = run(world, dict(base, guard={"policy": "abort", "replica_every": 1}), os.path.join(tmp, "guarded"))
    for r, (p, g) in enumerate(zip(plain, guarded)):
        assert g["error"] is None, g["error"]
        assert g["verdicts"] == ["proceed"] * base["steps"], g["verdicts"]
        assert g["losses"] == p["losses"], f"rank {r}: losses differ from plain DDP"
        assert g["scales"] == p["scales"], f"rank {r}: loss scales differ"
        assert all(same_state(a, b) for a, b in zip(p["snapshots"], g["snapshots"])), f"rank {r}: state differs"
    return f"{world} rank(s), {base['steps']} updates: bitwise plain DDP"


def planted(world, base, tmp):
    plant = dict(NAN, rank=world - 1)
    run_dir = os.path.join(tmp, "run")
    res = run(world, dict(base, guard={"policy": "abort", "run_dir": run_dir, "scan": "auto"}, plants=[plant]), tmp)
    for r in res:
        rep = r["report"]
        assert rep is not None, f"no report (error: {r['error']})"
        assert (rep["step"], rep["ranks"], rep["param"], rep["element"], rep["nan"]) == (2, [world - 1], "mid.weight", 4321, 1), rep
        assert os.path.exists(os.path.join(run_dir, "report.json")), "no report.json"
    return f"rank {world - 1}'s NaN named on every rank: mid.weight element 4321"


def skip(world, base, tmp):
    res = run(world, dict(base, guard={"policy": "skip"}, plants=[dict(NAN, rank=0)]), tmp)
    for r in res:
        assert r["verdicts"][:4] == ["proceed", "proceed", "skip", "proceed"], r["verdicts"]
        assert same_state(r["snapshots"][2], r["snapshots"][3]), "the skipped update changed the state"
        assert same_state(r["snapshots"][-1], res[0]["snapshots"][-1]), "replicas differ"
    return "update 2 skipped: weights and Adam state kept, replicas identical"


def fp16(world, base, tmp):
    case = dict(base, amp="fp16", scaler={"init_scale": 2.0 ** 24}, steps=8)
    plain = run(world, dict(case, guard=None), os.path.join(tmp, "plain"))
    guarded = run(world, dict(case, guard={"policy": "abort"}), os.path.join(tmp, "guarded"))
    for p, g in zip(plain, guarded):
        assert g["error"] is None, g["error"]
        assert g["scales"] == p["scales"] and g["losses"] == p["losses"], "scales or losses differ from the plain GradScaler run"
        assert all(same_state(a, b) for a, b in zip(p["snapshots"], g["snapshots"])), "state differs"
        assert g["overflows"] == [a == "skip" for a in g["verdicts"]], "an overflow not skipped as the scaler skips"
    skipped = guarded[0]["verdicts"].count("skip")
    assert skipped > 0, "no overflow at an initial scale of 2^24: the check saw nothing to skip"
    return f"{skipped} overflow(s) skipped as the GradScaler skips them, bitwise"


# Element 4000 of mid.lin.weight (67 x 67): in rank 1's shard at 2 ranks.
FSDP_NAN = {"rank": 1, "step": 2, "param": "mid.lin.weight", "element": 4000, "value": "nan"}


class NotRun(Exception):
    """Torch alone refuses the check's setting here, in a way FSDP_NOT_RUN names: NOT RUN (said)."""


# On a GPU, FSDP2's process group gives up after this (a gloo collective on CUDA tensors that never
# returns is then an error, and the check NOT RUN, before the step's budget ends).
FSDP_GPU_TIMEOUT_S = 20
# The only ways FSDP2 alone (no gradbus) may fail on the GPU and leave its checks NOT RUN rather than
# FAILED (docs/gpu.md): torch's own limits with gloo and CUDA tensors, matched in the error that the
# failed rank raised. Anything else - a crash, a CUDA error, an error of the harness - is FAILED.
FSDP_NOT_RUN = (
    # gloo's transport gives up on a collective after the process group's timeout (measured: this is
    # the message of a 2-rank gloo all_reduce that one rank never joins, torch 2.15).
    ("gloo's collective timed out", re.compile(r"Timed out waiting \d+ms for (recv|send) operation to complete")),
    # ProcessGroupGloo refuses a tensor of a device type it has no work for ("ProcessGroupGloo::<op>:
    # unsupported device type cuda"), or torch finds no backend of the group for CUDA tensors.
    ("gloo refuses CUDA tensors", re.compile(r"ProcessGroupGloo::\w+: unsupported device type cuda"
                                             r"|No backend type associated with device type cuda")),
)


def fsdp_alone(base, tmp):
    """FSDP2 without the guard at 2 ranks (every rank's result). On a GPU, where it fails in one of
    the ways of FSDP_NOT_RUN, NotRun with torch's message; any other failure, and every failure on
    the CPU (where FSDP2 alone runs: python/tests/test_fsdp.py), is the check's: raised as it is."""
    try:
        return fsdp_case.run(2, dict(base, guard=None), os.path.join(tmp, "alone"))
    except Exception as e:
        if base["device"] != "cuda":
            raise
        text = str(e)
        for cause, pattern in FSDP_NOT_RUN:
            m = pattern.search(text)
            if m:
                raise NotRun(f"FSDP2 alone, 2 ranks on one device over {base['backend']}: {cause} ({m.group(0)})"[:200]) from e
        raise


def fsdp_clean(base, tmp):
    plain = fsdp_alone(base, tmp)
    guarded = fsdp_case.run(2, dict(base, guard={"policy": "abort"}), os.path.join(tmp, "guarded"))
    for r, (p, g) in enumerate(zip(plain, guarded)):
        assert g["error"] is None, g["error"]
        assert g["verdicts"] == ["proceed"] * base["steps"], g["verdicts"]
        assert g["losses"] == p["losses"], f"rank {r}: losses differ from FSDP2 alone"
        assert all(same_state(a, b) for a, b in zip(p["snapshots"], g["snapshots"])), f"rank {r}: state differs"
    return f"2 ranks, {base['steps']} updates: bitwise FSDP2 alone"


def fsdp_planted(base, tmp):
    fsdp_alone(base, tmp)
    run_dir = os.path.join(tmp, "run")
    for r in fsdp_case.run(2, dict(base, guard={"policy": "abort", "run_dir": run_dir}, plants=[FSDP_NAN]), tmp):
        rep = r["report"]
        assert rep is not None, f"no report (error: {r['error']})"
        assert (rep["step"], rep["ranks"], rep["param"], rep["element"], rep["nan"]) == (2, [1], "mid.lin.weight", 4000, 1), rep
    assert os.path.exists(os.path.join(run_dir, "report.json")), "no report.json"
    return "rank 1's NaN named on every rank: mid.lin.weight element 4000"


def fsdp_skip(base, tmp):
    fsdp_alone(base, tmp)
    for r in fsdp_case.run(2, dict(base, guard={"policy": "skip"}, plants=[dict(FSDP_NAN, step=1)]), tmp):
        assert r["error"] is None, r["error"]
        assert r["verdicts"] == ["proceed", "skip", "proceed", "proceed"], r["verdicts"]
        assert same_state(r["snapshots"][1], r["snapshots"][2]), "the skipped update changed the state"
        assert not same_state(r["snapshots"][2], r["snapshots"][3]), "the next update did not apply"
    return "update 1 skipped on both ranks: weights and Adam state kept"


def checks(cpu):
    """(name, check(tmp) -> detail) of every check, for the CPU (gloo) or GPU 0."""
    dev = "cpu" if cpu else "cuda"
    one = {"steps": 4, "device": dev, "backend": "gloo" if cpu else "nccl"}
    two = {"steps": 4, "device": dev, "backend": "gloo"}
    fsdp = dict(two, timeout_s=120 if cpu else FSDP_GPU_TIMEOUT_S)
    label1 = "world 1, " + ("gloo (--cpu)" if cpu else "NCCL")
    label2 = "2 ranks, one " + ("CPU (--cpu)" if cpu else "GPU") + ", gloo"
    return [
        (f"{label1}: clean run", lambda t: clean(1, one, t)),
        (f"{label1}: planted NaN", lambda t: planted(1, one, t)),
        (f"{label1}: skip", lambda t: skip(1, one, t)),
        (f"{label1}: fp16 + GradScaler", lambda t: fp16(1, one, t)),
        (f"{label2}: clean run", lambda t: clean(2, two, t)),
        (f"{label2}: planted NaN", lambda t: planted(2, two, t)),
        (f"{label2}: skip", lambda t: skip(2, two, t)),
        (f"FSDP2, {label2}: clean run", lambda t: fsdp_clean(fsdp, t)),
        (f"FSDP2, {label2}: planted NaN", lambda t: fsdp_planted(fsdp, t)),
        (f"FSDP2, {label2}: skip", lambda t: fsdp_skip(fsdp, t)),
    ]


def attempt(name, check):
    """(name, passed, detail) of one check, in its own temporary folder; a failure's trace printed.
    passed is None for a check NOT RUN (torch alone refuses its setting here: FSDP_NOT_RUN), with
    the reason as its detail."""
    t0 = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="gradbus-gpu-check-") as tmp:
            return name, True, f"ok: {check(tmp)} ({time.time() - t0:.0f} s)"
    except NotRun as e:
        return name, None, str(e)
    except Exception as e:  # the table says which check failed; the trace goes to the log
        traceback.print_exc()
        first = str(e).splitlines()[0] if str(e) else ""
        return name, False, f"FAILED: {type(e).__name__}: {first}"[:200]


def line(name, passed, detail):
    """The step contract's line of a check's result: `ROW name | detail`, or for a check NOT RUN
    `NOTRUN name | why` (gpu-check.sh counts it, and never as passed)."""
    if passed is None:
        return f"NOTRUN python guard: {name} | {detail}"
    return f"ROW python guard: {name} | {detail}"


def run_all(named, jobs, deadline=None):
    """Every check, `jobs` at a time (each is processes of its own), its line printed as each ends;
    results in the given order. A check still running `deadline` seconds from now is FAILED (its
    thread is left behind: the caller must end the process)."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)
    futures = {pool.submit(attempt, name, check): name for name, check in named}
    done = set()
    try:
        for f in concurrent.futures.as_completed(futures, timeout=deadline):
            print(line(*f.result()), flush=True)
            done.add(f)
    except concurrent.futures.TimeoutError:
        for f, name in futures.items():
            if f not in done:
                print(f"ROW python guard: {name} | FAILED: not ended within {deadline:g} s", flush=True)
    pool.shutdown(wait=False, cancel_futures=True)
    return [f.result() if f in done else (name, False, "FAILED: not ended") for f, name in futures.items()]


def summarize(hook_ms, guard_ms):
    """Medians of the per-round ms of each side, and the per-round ratios guard/hook: their median,
    min and max. Rounds alternate the sides, so a round's ratio compares times taken together."""
    if not hook_ms or len(hook_ms) != len(guard_ms):
        raise ValueError(f"unpaired rounds: {len(hook_ms)} allreduce_hook, {len(guard_ms)} guard")
    ratios = [g / h for g, h in zip(guard_ms, hook_ms)]
    return statistics.median(hook_ms), statistics.median(guard_ms), statistics.median(ratios), min(ratios), max(ratios)


def overhead(device, backend, params_m, batch, iters, rounds):
    """(parameters, per-round ms of allreduce_hook, per-round ms of the guard (policy skip)), world 1."""
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradbus.torch as gbt

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    width = 4096 if device.type == "cuda" else 512
    layers = max(1, -(-int(params_m * 1e6) // (width * (width + 1))))
    x = torch.randn(batch, width, device=device)

    def setup(guard):
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)
        ddp = DDP(net)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-6)
        if guard:
            g = gbt.Guard(policy="skip", names=net)
            ddp.register_comm_hook(g, gbt.allreduce_hook)
            return ddp, gbt.GuardedOptimizer(opt, g)
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        return ddp, opt

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def round_ms(ddp, opt, n):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()
        sync()
        return (time.perf_counter() - t0) * 1e3 / n

    variants = {"allreduce_hook": setup(False), "gradbus guard": setup(True)}
    for ddp, opt in variants.values():
        round_ms(ddp, opt, 3)  # warm-up: DDP's bucket rebuild, allocations, cuBLAS
    ms = {k: [] for k in variants}
    for _ in range(rounds):
        for k, (ddp, opt) in variants.items():
            ms[k].append(round_ms(ddp, opt, iters))
    dist.destroy_process_group()
    return layers * width * (width + 1), ms["allreduce_hook"], ms["gradbus guard"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run every check on the CPU (gloo): this script's whole logic")
    ap.add_argument("--params-m", type=float, help="overhead model, million parameters (GPU 100, --cpu 2)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--jobs", type=int, help="checks run at a time (default: the CPUs, at most 10: all of them at once on the GPU machine)")
    ap.add_argument("--deadline", type=float, help="seconds the checks may take before the overhead (default: no limit)")
    a = ap.parse_args()
    if not a.cpu and not torch.cuda.is_available():
        print("SKIPPED: no CUDA device for the python guard GPU check (torch.cuda.is_available() is False); nothing was checked")
        return 3
    import gradbus

    where = "CPU (--cpu)" if a.cpu else torch.cuda.get_device_name(0)
    print(f"python guard GPU check on {where}: torch {torch.__version__}, gradbus {gradbus.__file__}", flush=True)
    jobs = a.jobs or max(1, min(10, os.cpu_count() or 1))
    results = run_all(checks(a.cpu), jobs, a.deadline)
    passed = sum(ok is True for _, ok, _ in results)
    failed = any(ok is False for _, ok, _ in results)
    if any(detail == "FAILED: not ended" for _, _, detail in results):
        # A check's processes still run (a collective that never returns): end them and here; the
        # rows said it.
        for p in multiprocessing.active_children():
            p.kill()
        print(f"CHECKS {passed}")
        print("python guard GPU check: FAILED", flush=True)
        os._exit(1)
    params_m = a.params_m or (2.0 if a.cpu else 100.0)
    device = torch.device("cpu") if a.cpu else torch.device("cuda", 0)
    try:
        n, hook_ms, guard_ms = overhead(device, "gloo" if a.cpu else "nccl", params_m, a.batch, a.iters, a.rounds)
        hook, guard, ratio, lo, hi = summarize(hook_ms, guard_ms)
        print(f"ROW python guard: overhead, {n / 1e6:.1f}M params, batch {a.batch} | allreduce_hook {hook:.2f} ms, "
              f"guard {guard:.2f} ms per update: guard/hook {ratio:.4f} (rounds {lo:.4f}..{hi:.4f}; target <= {OVERHEAD_TARGET})")
        print(f"TARGET python guard / allreduce_hook time per update, {n / 1e6:.1f}M params | {ratio:.4f} | <= {OVERHEAD_TARGET}")
        passed += 1
    except Exception as e:
        traceback.print_exc()
        print(f"ROW python guard: overhead | FAILED: {type(e).__name__}: {e}"[:240])
        failed = True
    print(f"CHECKS {passed}")
    notrun = sum(ok is None for _, ok, _ in results)
    print("python guard GPU check:", "FAILED" if failed else "every check that ran passed"
          + (f"; {notrun} NOT RUN (NOTRUN lines: not a pass)" if notrun else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
