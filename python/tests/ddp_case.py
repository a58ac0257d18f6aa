"""One multi-process DDP training case for the tests: `run(world, case, outdir)` spawns `world`
processes (torch.multiprocessing, spawn) that train a small MLP with DistributedDataParallel over
gloo on the CPU, with or without the gradbus guard, optionally planting a NaN/Inf in one parameter's
gradient on one rank, and returns what each rank saw (per-step losses, verdicts, weights and Adam
state around every step, the exception on abort).

A case is a dict:
  steps       number of updates (default 4)
  guard       None (plain DDP, PyTorch's default hook) or Guard keyword arguments
  plants      [{"rank", "step", "param", "element", "value": "nan"|"inf", "attempts": [0, ...]}]
  bucket_cap_mb  DDP's bucket cap (default 0.25: several buckets after DDP's first-step rebuild)
"""

from __future__ import annotations

import os
import socket
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
    w = {n: p.detach().clone() for n, p in net.named_parameters()}
    names = {id(p): n for n, p in net.named_parameters()}
    state = {}
    for p, s in opt.state.items():
        state[names[id(p)]] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
    return {"weights": w, "adam": state}


def plant_hook(spec):
    element, value = spec["element"], float(spec["value"])

    def hook(g):
        g = g.clone()
        g.view(-1)[element] = value
        return g

    return hook


def worker(rank: int, world: int, port: int, case: dict, outdir: str) -> None:
    import gradbus.torch as gt

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    out = {"losses": [], "verdicts": [], "snapshots": [], "error": None, "report": None, "buckets": []}
    try:
        net = model()
        ddp = DDP(net, bucket_cap_mb=case.get("bucket_cap_mb", 0.25))
        inner = torch.optim.Adam(ddp.parameters(), lr=1e-2)
        guard = None
        opt = inner
        if case.get("guard") is not None:
            guard = gt.Guard(names=net, **case["guard"])
            ddp.register_comm_hook(guard, gt.allreduce_hook)
            opt = gt.GuardedOptimizer(inner, guard)
        params = dict(net.named_parameters())
        for step in range(case.get("steps", 4)):
            x, y = batch(rank, step)
            out["snapshots"].append(snapshot(net, inner))
            for attempt in guard.attempts() if guard is not None else [0]:
                opt.zero_grad()
                handles = [
                    params[p["param"]].register_hook(plant_hook(p))
                    for p in case.get("plants", [])
                    if p["rank"] == rank and p["step"] == step and attempt in p.get("attempts", [0])
                ]
                loss = nn.functional.mse_loss(ddp(x), y)
                out["losses"].append(loss.item())
                if guard is not None:
                    guard.backward(loss)
                else:
                    loss.backward()
                for h in handles:
                    h.remove()
                if guard is not None:
                    v = opt.step()
                    out["verdicts"].append(v.action)
                    out["buckets"].append(guard.buckets)
                else:
                    opt.step()
        out["snapshots"].append(snapshot(net, inner))
        if guard is not None:
            out["skipped"] = guard.skipped
            out["suspects"] = guard.suspects
    except gt.NonFiniteGradients as e:  # the tests inspect it
        out["error"] = str(e)
        out["report"] = e.report
    finally:
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker, world: int, case: dict, outdir: str | None = None):
    """Run `worker(rank, world, port, case, outdir)` on `world` spawned processes; the dict each rank
    saved as outdir/rank{r}.pt, in rank order."""
    outdir = outdir or tempfile.mkdtemp(prefix="gradbus-case-")
    os.makedirs(outdir, exist_ok=True)
    mp.start_processes(worker, args=(world, free_port(), case, outdir), nprocs=world, join=True, start_method="spawn")
    return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def run(world: int, case: dict, outdir: str | None = None):
    """Run the case on `world` processes; one result dict per rank."""
    return spawn(worker, world, case, outdir)
