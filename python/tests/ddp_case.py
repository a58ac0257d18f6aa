"""One multi-process DDP training case for the tests (and python/gpu_check.py): `run(world, case,
outdir)` spawns `world` processes (torch.multiprocessing, spawn) that train a small MLP with
DistributedDataParallel (gloo on the CPU unless the case says otherwise), with or without the gradbus
guard, optionally planting a NaN/Inf in one parameter's gradient on one rank, and returns what each
rank saw (per-step losses, verdicts, weights and Adam state around every step, the exception).

A case is a dict:
  steps       number of updates (default 4)
  guard       None (plain DDP) or Guard keyword arguments
  plants      [{"rank", "step", "param", "element", "value": "nan"|"inf"|float, "attempts": [0, ...]}]
  bucket_cap_mb  DDP's bucket cap (default 0.25: several buckets after DDP's first-step rebuild)
  hook        None (DDP's built-in all-reduce; with a guard: gradbus.torch.allreduce_hook), or
              "fp16_compress" / "bf16_compress" (DDP's compression hook, or the guard's)
  amp         None, "fp16" or "bf16": the forward under torch.autocast in that dtype
  scaler      None or torch.amp.GradScaler keyword arguments (fp16): plain DDP runs the usual
              scale/step/update; the guard gets the scaler
  dtype       the parameters' dtype (default "float32"; "bfloat16": bf16 gradients and buckets)
  diverge     {"rank", "step", "param", "element", "delta"}: add delta to one weight on one rank
              before that step (a replica that differs)
  device      "cpu" (default) or "cuda"; backend: "gloo" (default) or "nccl"
  twice       {"step", "call": "backward"|"step"}: at that step a second backward before the verdict,
              or a second opt.step() after it; the guard's RuntimeError ends the run ("misuse")
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import tempfile
from collections import OrderedDict
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

# Input, hidden and output widths: ~330K parameters (1.3 MB), more than DDP's 1 MiB first bucket,
# so there are several buckets to map back to names.
D_IN, D_H, D_OUT = 64, 512, 8


AMP = {"fp16": torch.float16, "bf16": torch.bfloat16}


def model() -> nn.Module:
    torch.manual_seed(1234)  # the same initial weights on every rank, as DDP requires
    return nn.Sequential(
        OrderedDict(
            inp=nn.Linear(D_IN, D_H),
            act=nn.Tanh(),
            mid=nn.Linear(D_H, D_H),
            act2=nn.Tanh(),
            head=nn.Linear(D_H, D_OUT),
        )
    )


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, D_IN, generator=g)
    y = torch.randn(16, D_OUT, generator=g)
    return x, y


def snapshot(net: nn.Module, opt: torch.optim.Optimizer):
    w = {n: p.detach().to("cpu", copy=True) for n, p in net.named_parameters()}
    names = {id(p): n for n, p in net.named_parameters()}
    state = {}
    for p, s in opt.state.items():
        state[names[id(p)]] = {k: (v.to("cpu", copy=True) if torch.is_tensor(v) else v) for k, v in s.items()}
    return {"weights": w, "adam": state}


def same_state(a, b):
    """Bitwise equality of two snapshots (weights and Adam state)."""
    assert a["weights"].keys() == b["weights"].keys()
    for n in a["weights"]:
        if not torch.equal(a["weights"][n], b["weights"][n]):
            return False
    if a["adam"].keys() != b["adam"].keys():
        return False
    for n in a["adam"]:
        for k, v in a["adam"][n].items():
            w = b["adam"][n][k]
            if not (torch.equal(v, w) if torch.is_tensor(v) else v == w):
                return False
    return True


def plant_hook(spec):
    element, value = spec["element"], float(spec["value"])  # float("nan"), float("inf"), or a number

    def hook(g):
        g = g.clone()
        g.view(-1)[element] = value
        return g

    return hook


def worker(rank: int, world: int, port: int, case: dict, outdir: str) -> None:
    import gradbus.torch as gt
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    device = torch.device(case.get("device", "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU (gloo copies through the host)
    dist.init_process_group(case.get("backend", "gloo"), rank=rank, world_size=world, timeout=timedelta(seconds=120))
    out = {"losses": [], "verdicts": [], "snapshots": [], "error": None, "report": None, "buckets": [],
           "scales": [], "overflows": [], "skips": [], "tabled": 0, "paths": [], "row_losses": [],
           "verdict_losses": [], "fast": [], "fast_verdicts": []}
    try:
        net = model().to(device=device, dtype=getattr(torch, case.get("dtype", "float32")))
        ddp = DDP(net, bucket_cap_mb=case.get("bucket_cap_mb", 0.25), gradient_as_bucket_view=case.get("bucket_view", False))
        inner = torch.optim.Adam(ddp.parameters(), lr=1e-2)
        scaler = None if case.get("scaler") is None else torch.amp.GradScaler(device.type, **case["scaler"])
        amp = case.get("amp")
        hook = case.get("hook")
        guard = None
        opt = inner
        if case.get("guard") is not None:
            guard = gt.Guard(names=net, scaler=scaler, **case["guard"])
            ddp.register_comm_hook(guard, getattr(gt, f"{hook}_hook") if hook else gt.allreduce_hook)
            opt = gt.GuardedOptimizer(inner, guard)
        elif hook:
            ddp.register_comm_hook(None, getattr(default_hooks, f"{hook}_hook"))
        params = dict(net.named_parameters())
        for step in range(case.get("steps", 4)):
            x, y = batch(rank, step)
            x, y = x.to(device=device, dtype=next(net.parameters()).dtype), y.to(device)
            d = case.get("diverge")
            if d is not None and d["rank"] == rank and d["step"] == step:
                with torch.no_grad():
                    params[d["param"]].view(-1)[d["element"]] += d["delta"]
            out["snapshots"].append(snapshot(net, inner))
            for attempt in guard.attempts() if guard is not None else [0]:
                opt.zero_grad()
                handles = [
                    params[p["param"]].register_hook(plant_hook(p))
                    for p in case.get("plants", [])
                    if p["rank"] == rank and p["step"] == step and attempt in p.get("attempts", [0])
                ]
                with torch.autocast(device.type, dtype=AMP.get(amp, torch.float16), enabled=amp is not None):
                    loss = nn.functional.mse_loss(ddp(x).float(), y)
                out["losses"].append(loss.item())
                if guard is not None:
                    guard.backward(loss)
                elif scaler is not None:
                    scaler.scale(loss).backward()
                else:
                    loss.backward()
                for h in handles:
                    h.remove()
                twice = case.get("twice")
                twice = twice["call"] if twice is not None and twice["step"] == step else None
                if guard is not None:
                    # Whether every bucket of this backward took the hook's fast path (`Guard._fast`
                    # set, and the general path's agreement not started), and after the step whether
                    # the verdict did (the same ScanPath kept).
                    fast = guard._fast if guard._pending is None else None
                    out["fast"].append(fast is not None)
                if twice == "backward":
                    loss = nn.functional.mse_loss(ddp(x).float(), y)
                    with misuse(out):
                        guard.backward(loss)
                if guard is not None:
                    v = opt.step()
                    out["fast_verdicts"].append(fast is not None and guard._fast is fast)
                    if twice == "step":
                        with misuse(out):
                            opt.step()
                    out["verdicts"].append(v.action)
                    out["overflows"].append(v.overflow)
                    out["buckets"].append(guard.buckets)
                    out["paths"].append(guard.path)
                    out["verdict_losses"].append(v.loss)
                    # Every rank's loss as its row carried it (when the rows were gathered or rode).
                    out["row_losses"].append(None if guard.rows is None else [row.loss for row in guard.rows])
                elif scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                if scaler is not None:
                    out["scales"].append(scaler.get_scale())
        out["snapshots"].append(snapshot(net, inner))
        if guard is not None:
            out["skipped"] = guard.skipped
            out["suspects"] = guard.suspects
            out["skips"] = [(v.step, v.action, v.loss_scale, v.report) for v in guard.skips]
            out["tabled"] = guard.tabled
    except Misuse:
        pass
    except (gt.NonFiniteGradients, gt.ReplicasDiverged) as e:  # the tests inspect it
        out["error"] = str(e)
        out["error_type"] = type(e).__name__
        out["report"] = e.report
        out["after_error"] = snapshot(net, inner)  # the state once the poisoned step has raised
    finally:
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
        dist.destroy_process_group()


class Misuse(Exception):
    """The guard refused a call out of turn (case "twice"): the run ends there."""


@contextlib.contextmanager
def misuse(out: dict):
    """A call out of turn (case "twice"): the guard's RuntimeError in out["misuse"] (None if it did
    not raise), then the run ends."""
    try:
        yield
        out["misuse"] = None
    except RuntimeError as e:
        out["misuse"] = str(e)
    raise Misuse()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _then_exit(rank: int, worker, world: int, port: int, case: dict, outdir: str) -> None:
    """`worker(rank, ...)`, then, once it has returned (its result saved, its process group
    destroyed), the process's exit without the interpreter's teardown, where torch 2.15's gloo
    sometimes aborts a finished worker (SIGABRT, "terminate called without an active exception":
    seen once in the GPU bundle's CPU stand-in, FSDP2's planted NaN). A worker that raises exits
    as before, with its traceback."""
    worker(rank, world, port, case, outdir)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(worker, world: int, case: dict, outdir: str | None = None):
    """Run `worker(rank, world, port, case, outdir)` on `world` spawned processes; the dict each rank
    saved as outdir/rank{r}.pt, in rank order."""
    outdir = outdir or tempfile.mkdtemp(prefix="gradbus-case-")
    os.makedirs(outdir, exist_ok=True)
    for attempt in range(3):
        try:
            mp.start_processes(_then_exit, args=(worker, world, free_port(), case, outdir), nprocs=world, join=True, start_method="spawn")
            break
        except mp.ProcessRaisedException as e:
            # The free port was taken by another job before rank 0 listened on it: a new port.
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise
    return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def run(world: int, case: dict, outdir: str | None = None):
    """Run the case on `world` processes; one result dict per rank."""
    return spawn(worker, world, case, outdir)
