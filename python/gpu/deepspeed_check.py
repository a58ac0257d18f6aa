#!/usr/bin/env python3
"""gradbus.deepspeed on a GPU: the checks the CPU tests (python/tests/test_deepspeed.py, 2 ranks over
gloo) cannot make - the scans in bf16 and fp16 on the device, ZeRO 3's reduce stream, NCCL. One
process, world size 1 over NCCL on GPU 0 (NCCL refuses two ranks on one device; naming one rank
among several is what the CPU tests show), deepspeed as bundled (0.19.8, built with DS_BUILD_OPS=0),
the small transformer of python/examples/deepspeed_guard.py, deterministic algorithms on:

  clean     ZeRO 1, 2, 3 x fp32, bf16, fp16: the guarded run equals DeepSpeed alone bitwise (losses,
            fp32 master partitions, Adam state, weights, skipped_steps, learning rates, loss scales);
            a second unguarded ZeRO 2 run per precision is the control (when it differs, the GPU is
            not deterministic here and the row says so: a failure all the same)
  abort     a NaN in one gradient element (ZeRO 2 bf16, ZeRO 3 bf16): NonFiniteGradients from
            engine.step() names the parameter, the element, rank 0 and the step, before DeepSpeed's
            optimizer ran; report.json written
  skip      ZeRO 2 bf16: the poisoned update leaves the state bitwise unchanged, skipped_steps
            [0, 1, 1, 1], the learning rates one update behind DeepSpeed's clean run
  bf16-inf  DeepSpeed #8035: bf16 without DeepSpeed's overflow check, +inf in one element: alone the
            state turns non-finite; guarded it stays finite and the update is skipped
  fp16      ZeRO 2 and 3, dynamic loss scale: an Inf is DeepSpeed's overflow: guarded equals alone
            bitwise (scale 256 -> 128), and the guard's report says loss-scale, the parameter, the
            element

Prints `ROW <check> | <result>` per check and `CHECKS <n>` (scripts/gpu-check.sh's step contract);
exit 0 all passed, 1 a check failed, 3 no CUDA device. `--cpu` runs the same on the CPU over gloo (a
dry run of this script's logic).
"""

import argparse
import os
import sys
import tempfile
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
# deepspeed_case, ddp_case, deepspeed_guard and example_cli: beside us in the bundle, or in
# python/tests and python/examples.
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests"), os.path.join(HERE, "..", "examples")]

import torch  # noqa: E402

PARAM, ELEMENT = "layers.0.linear1.weight", 77
STEPS = 4


def plant(step, value="nan"):
    return {"rank": 0, "step": step, "param": PARAM, "element": ELEMENT, "value": value, "micro": 0}


def case(zero, precision, guard=None, plants=(), **kw):
    return dict(zero=zero, precision=precision, guard=guard, plants=list(plants), steps=STEPS, **kw)


def cases(run_dir):
    abort = {"policy": "abort", "run_dir": run_dir}
    skip = {"policy": "skip"}
    nocheck = {"bf16": {"check_grad_overflow": False}}
    c = {}
    for z in (1, 2, 3):
        for p in ("fp32", "bf16", "fp16"):
            c[f"plain-z{z}-{p}"] = case(z, p)
            c[f"guarded-z{z}-{p}"] = case(z, p, abort)
    for p in ("fp32", "bf16", "fp16"):
        c[f"control-z2-{p}"] = case(2, p)
    for z in (2, 3):
        c[f"abort-z{z}-bf16"] = case(z, "bf16", abort, [plant(1)])
        c[f"fp16-plain-z{z}"] = case(z, "fp16", None, [plant(1, "inf")])
        c[f"fp16-guarded-z{z}"] = case(z, "fp16", abort, [plant(1, "inf")])
    c["skip-z2-bf16"] = case(2, "bf16", skip, [plant(1)])
    c["bf16-inf-plain"] = case(2, "bf16", None, [plant(1, "inf")], ds=nocheck)
    c["bf16-inf-guarded"] = case(2, "bf16", skip, [plant(1, "inf")], ds=nocheck)
    return c


def equal_runs(a, b):
    """'' when two single-rank results are the same run bitwise, else what differs."""
    from deepspeed_case import same

    for key in ("error", "losses", "skipped_steps", "lrs", "scales"):
        if a[key] != b[key]:
            return f"{key} differ: {a[key]} vs {b[key]}"
    for s, (x, y) in enumerate(zip(a["snapshots"], b["snapshots"])):
        if not same(x, y):
            return f"state differs before update {s}"
    return "" if len(a["snapshots"]) == len(b["snapshots"]) else "snapshot counts differ"


def checks(res, run_dir):
    """(name, passed, detail) per check."""
    from deepspeed_case import finite, same

    out = []
    for z in (1, 2, 3):
        for p in ("fp32", "bf16", "fp16"):
            why = equal_runs(res[f"guarded-z{z}-{p}"], res[f"plain-z{z}-{p}"])
            if why and z == 2 and equal_runs(res[f"control-z2-{p}"], res[f"plain-z2-{p}"]):
                why += " (and two unguarded runs differ too: not deterministic here)"
            ok = not why and res[f"guarded-z{z}-{p}"]["skipped_steps"] == [0] * STEPS
            out.append((f"clean ZeRO {z} {p}: bitwise DeepSpeed alone", ok, why or "bitwise equal, no skip"))
    for z in (2, 3):
        r = res[f"abort-z{z}-bf16"]
        rep = r["report"] or {}
        ok = (r["error"] or "").startswith("NonFiniteGradients") and (rep.get("step"), rep.get("ranks"), rep.get("param"), rep.get("element")) == (
            1, [0], PARAM, ELEMENT) and len(r["snapshots"]) == 2 and finite(r["snapshots"][-1]) and os.path.exists(
            os.path.join(run_dir, "report.json"))
        out.append((f"abort ZeRO {z} bf16: NaN named before the step", ok, (r["error"] or "no error")[:160]))
    r, plain = res["skip-z2-bf16"], res["plain-z2-bf16"]
    snaps = r["snapshots"]
    ok = (r["error"] is None and same(snaps[1], snaps[2]) and not same(snaps[2], snaps[3]) and r["skipped_steps"] == [0, 1, 1, 1]
          and r["skipped"] == 1 and r["lrs"] == [plain["lrs"][0]] + plain["lrs"][:3])
    out.append(("skip ZeRO 2 bf16: state kept, skipped_steps, LR held", ok, f"skipped_steps {r['skipped_steps']}, lrs {r['lrs']}, error {r['error']}"))
    a, g = res["bf16-inf-plain"], res["bf16-inf-guarded"]
    ok = (a["error"] is None and not finite(a["snapshots"][-1]) and g["error"] is None and all(finite(s) for s in g["snapshots"])
          and g["skipped_steps"] == [0, 1, 1, 1])
    out.append(("bf16 +inf without DeepSpeed's check (#8035): stopped before Adam", ok,
                f"alone finite: {finite(a['snapshots'][-1])}; guarded finite: {all(finite(s) for s in g['snapshots'])}, skipped_steps {g['skipped_steps']}"))
    for z in (2, 3):
        p, g = res[f"fp16-plain-z{z}"], res[f"fp16-guarded-z{z}"]
        why = equal_runs(g, p)
        skips = g["skips"]
        ok = (not why and p["scales"] == [256.0, 128.0, 128.0, 128.0] and len(skips) == 1 and skips[0][1]["classification"] == "loss-scale"
              and (skips[0][1]["param"], skips[0][1]["element"]) == (PARAM, ELEMENT))
        out.append((f"fp16 ZeRO {z}: an Inf is DeepSpeed's loss-scale overflow, reported", ok, why or f"scales {g['scales']}, skips {len(skips)}"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU over gloo (a dry run)")
    a = ap.parse_args()
    device = "cpu" if a.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("ROW gradbus.deepspeed on the GPU | SKIPPED: no CUDA device")
        return 3
    from deepspeed_case import run

    tmp = tempfile.mkdtemp(prefix="gradbus-ds-gpu-")
    run_dir = os.path.join(tmp, "run")
    named = cases(run_dir)
    try:
        res = run(1, list(named.values()), os.path.join(tmp, "out"), device)
    except Exception:
        traceback.print_exc()
        print("ROW gradbus.deepspeed: the run | FAILED: it raised (above)")
        return 1
    res = {n: r[0] for n, r in zip(named, res)}
    results = checks(res, run_dir)
    for name, ok, detail in results:
        print(f"ROW {name} | {'passed' if ok else 'FAILED'}: {detail}")
    print(f"CHECKS {len(results)}")
    failed = [n for n, ok, _ in results if not ok]
    print(f"deepspeed_check: {len(results) - len(failed)} of {len(results)} passed on {device}" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
