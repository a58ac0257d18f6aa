"""Multi-process DeepSpeed ZeRO training cases for the tests (and python/gpu/deepspeed_check.py):
`run(world, cases, outdir, device)` spawns `world` processes (torch.multiprocessing, spawn) that join
one process group (gloo on the CPU, NCCL on GPU 0) and then run every case in turn, each with a fresh `deepspeed.initialize` of a small transformer (python/examples/
deepspeed_guard.py's `model`) on DeepSpeed's CPU accelerator, with or without the gradbus guard,
optionally planting a NaN/Inf in one parameter's gradient on one rank; one process group for all
the cases keeps the run short (DeepSpeed's import and its process start cost seconds each).

A case is a dict:
  zero       ZeRO stage 1, 2 or 3
  precision  "fp32", "bf16" or "fp16" (dynamic loss scale from 2^8)
  steps      updates (default 4)
  gas        gradient accumulation steps (default 1)
  guard      None (DeepSpeed alone) or gradbus.deepspeed.guard keyword arguments
  plants     [{"rank", "step", "param", "element", "value": "nan"|"inf"|float, "micro": 0}]
  diverge    {"rank", "step", "param", "element", "delta"}: add delta to one weight of the model on
             one rank before that update (ZeRO 1/2: a replica that differs)
  ds         extra DeepSpeed config, merged key by key into the sections (e.g.
             {"zero_optimization": {"reduce_bucket_size": 3000}, "bf16": {"check_grad_overflow": False}})

Per case and rank the result dict holds: losses, skipped_steps, lrs and loss scales after every
update, snapshots (the inner torch optimizer's parameters - ZeRO's fp32 master partitions - and its
state, and the rank's copy of the model's weights) before every update and after the last, the
guard's skipped count, skips and spans, and the error and report of an exception.
"""

from __future__ import annotations

import gc
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ddp_case import plant_hook, spawn

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from deepspeed_guard import batch, cpu_fp16, ds_config, model  # noqa: E402


def _merge(base: dict, extra: dict) -> dict:
    for k, v in extra.items():
        base[k] = _merge(dict(base.get(k, {})), v) if isinstance(v, dict) else v
    return base


def snapshot(engine) -> dict:
    """Copies, on the host, of the inner optimizer's parameters (ZeRO's fp32 master partitions) and
    state, and of the rank's weights (ZeRO 3: its partition)."""
    inner = engine.optimizer.optimizer

    def host(t):
        return t.detach().to("cpu", copy=True)

    params = [p for group in inner.param_groups for p in group["params"]]
    state = [{k: (host(v) if torch.is_tensor(v) else v) for k, v in inner.state.get(p, {}).items()} for p in params]
    weights = {n: host(p.ds_tensor if hasattr(p, "ds_tensor") else p) for n, p in engine.module.named_parameters()}
    return {"master": [host(p) for p in params], "adam": state, "weights": weights}


def same(a, b) -> bool:
    """Bitwise equality of two snapshots."""
    if len(a["master"]) != len(b["master"]) or not same_weights(a, b):
        return False
    if not all(torch.equal(x, y) for x, y in zip(a["master"], b["master"])):
        return False
    for sa, sb in zip(a["adam"], b["adam"]):
        if sa.keys() != sb.keys():
            return False
        for k in sa:
            x, y = sa[k], sb[k]
            if torch.is_tensor(x) != torch.is_tensor(y) or (torch.equal(x, y) if torch.is_tensor(x) else x == y) is False:
                return False
    return True


def same_weights(a, b) -> bool:
    """The ranks' copies of the model's weights in two snapshots are bitwise equal (ZeRO 1 and 2 keep
    a full copy on every rank)."""
    return a["weights"].keys() == b["weights"].keys() and all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"])


def finite(snap) -> bool:
    tensors = snap["master"] + list(snap["weights"].values()) + [v for s in snap["adam"] for v in s.values() if torch.is_tensor(v)]
    return all(bool(torch.isfinite(t.float()).all()) for t in tensors)


def one_case(rank: int, case: dict) -> dict:
    import deepspeed

    import gradbus.deepspeed as gds

    out = {"losses": [], "skipped_steps": [], "lrs": [], "scales": [], "snapshots": [], "error": None, "report": None,
           "skipped": None, "skips": [], "spans": [], "optimizer": None}
    cfg = _merge(ds_config(case["zero"], case["precision"], case.get("gas", 1)), case.get("ds", {}))
    net = model()
    engine, _, _, sched = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    out["optimizer"] = type(engine.optimizer).__name__
    guard = None
    try:
        if case.get("guard") is not None:
            guard = gds.guard(engine, **case["guard"])
        params = dict(engine.module.named_parameters())
        gas = case.get("gas", 1)
        for step in range(case.get("steps", 4)):
            d = case.get("diverge")
            if d is not None and (d["rank"], d["step"]) == (rank, step):
                with torch.no_grad():
                    params[d["param"]].view(-1)[d["element"]] += d["delta"]
            out["snapshots"].append(snapshot(engine))
            for micro in range(gas):
                handles = [
                    params[p["param"]].register_hook(plant_hook(p))
                    for p in case.get("plants", [])
                    if p["rank"] == rank and p["step"] == step and p.get("micro", 0) == micro
                ]
                x = batch(rank, step * gas + micro).to(engine.device)
                loss = engine(x, labels=x)
                engine.backward(loss)
                for h in handles:
                    h.remove()
                engine.step()
                out["losses"].append(loss.item())
            out["skipped_steps"].append(engine.skipped_steps)
            out["lrs"].append(sched.get_last_lr()[0])
            out["scales"].append(float(engine.optimizer.loss_scale))
            if guard is not None:
                out["spans"].append(guard.spans)
        out["snapshots"].append(snapshot(engine))
    except Exception as e:  # the tests inspect it
        out["error"] = f"{type(e).__name__}: {e}"
        out["report"] = getattr(e, "report", None)
    if guard is not None:
        out["skipped"] = guard.skipped
        out["skips"] = [(v.action, v.report, v.loss_scale) for v in guard.skips]
    engine.destroy()
    del engine
    gc.collect()
    return out


def worker(rank: int, world: int, port: int, job: tuple, outdir: str) -> None:
    cases, device = job
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    # DeepSpeed's CPU accelerator JIT-builds its shm op with ninja from the venv's bin/ at initialize.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    if device == "cuda":
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        # The bitwise checks compare two runs; an op without a deterministic kernel warns (and the
        # GPU check's control run shows whether two unguarded runs agree) rather than stopping it.
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.cuda.set_device(0)
    else:
        os.environ["DS_ACCELERATOR"] = "cpu"
        torch.set_num_threads(1)
    import deepspeed

    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=180))
    deepspeed.init_distributed(dist_backend=backend)
    cpu_fp16()  # on a CPU without AVX512-FP16 (this machine's AMD EPYC): the example's stand-in
    results = []
    try:
        for case in cases:
            results.append(one_case(rank, case))
    finally:
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def run(world: int, cases: list, outdir: str | None = None, device: str = "cpu"):
    """Run the cases on `world` processes on `device` ("cpu", or "cuda": every rank on GPU 0, so
    world 1 with NCCL); per case, one result dict per rank."""
    per_rank = spawn(worker, world, (cases, device), outdir)
    return [[per_rank[r][c] for r in range(world)] for c in range(len(cases))]
