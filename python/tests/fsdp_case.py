"""One multi-process FSDP2 training case for the tests: `run(world, case, outdir)` spawns `world`
processes that train a small model with `fully_shard` (each block, then the root) on a 1-D CPU mesh
over gloo, with or without the gradbus guard, optionally planting a NaN/Inf in one parameter's
gradient on one rank (a hook on FSDP's unsharded parameter, the tensor autograd writes).

A case is a dict:
  steps   number of updates (default 4)
  guard   None (FSDP2 alone) or gradbus.fsdp.Guard keyword arguments
  plants  [{"rank", "step", "param", "element", "value": "nan"|"inf"|"-inf"}]
  device  "cpu" (default) or "cuda" (every rank on GPU 0: python/gpu_check.py); backend: "gloo"
          (default) or "nccl"; timeout_s: the process group's timeout (default 120)
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_case import plant_hook, spawn

# The example's model and its access to FSDP's unsharded parameters (python/examples/fsdp_guard.py).
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from fsdp_guard import batch, model, unsharded  # noqa: E402


def snapshot(net: nn.Module, opt: torch.optim.Optimizer):
    """Full weights (all-gathered: every rank calls this at the same points) and this rank's shard of
    the Adam state."""
    names = {id(p): n for n, p in net.named_parameters()}
    local = lambda v: (v.to_local() if hasattr(v, "to_local") else v).to("cpu", copy=True) if torch.is_tensor(v) else v  # noqa: E731
    return {
        "weights": {n: p.full_tensor().detach().to("cpu", copy=True) for n, p in net.named_parameters()},
        "adam": {names[id(p)]: {k: local(v) for k, v in s.items()} for p, s in opt.state.items()},
    }


def worker(rank: int, world: int, port: int, case: dict, outdir: str) -> None:
    import gradbus.fsdp as gf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    device = torch.device(case.get("device", "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(0)
    timeout = timedelta(seconds=case.get("timeout_s", 120))
    dist.init_process_group(case.get("backend", "gloo"), rank=rank, world_size=world, timeout=timeout)
    out = {"losses": [], "verdicts": [], "snapshots": [], "error": None, "report": None}
    try:
        mesh = init_device_mesh(device.type, (world,))
        net = model().to(device)
        for block in (net.inp, net.mid):
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        inner = torch.optim.Adam(net.parameters(), lr=1e-2)
        opt, guard = inner, None
        if case.get("guard") is not None:
            guard = gf.Guard(net, **case["guard"])
            opt = gf.GuardedOptimizer(inner, guard)
        for step in range(case.get("steps", 4)):
            out["snapshots"].append(snapshot(net, inner))
            opt.zero_grad()
            x, y = batch(rank, step, device.type)
            loss = nn.functional.mse_loss(net(x), y)
            handles = [unsharded(net, p["param"]).register_hook(plant_hook(p))
                       for p in case.get("plants", []) if p["rank"] == rank and p["step"] == step]
            out["losses"].append(loss.item())
            if guard is not None:
                guard.set_loss(loss)
            loss.backward()
            for h in handles:
                h.remove()
            v = opt.step()
            out["verdicts"].append(v.action if guard is not None else "proceed")
        out["snapshots"].append(snapshot(net, inner))
        if guard is not None:
            out["skipped"] = guard.skipped
    except gf.NonFiniteGradients as e:
        out["error"] = str(e)
        out["report"] = e.report
    finally:
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def run(world: int, case: dict, outdir: str | None = None):
    """Run the case on `world` processes; one result dict per rank."""
    return spawn(worker, world, case, outdir)
