"""The DDP case of the silent-data-corruption tests (test_sdc.py): `run(world, case, outdir)` spawns
`world` processes that train ddp_case's MLP with DistributedDataParallel (gloo, CPU) under the guard
(or plain DDP without it), with one fault planted through a hook on one rank, and returns what each
rank saw.

A case is a dict:
  steps   updates (default 8)
  guard   None (plain DDP, no hook) or Guard keyword arguments
  clip    clip the gradients' norm to this after the backward, as scripts do (default None)
  plain_backward  True: loss.backward() instead of guard.backward(loss)
  fault   None or one of (each on `rank` at update `step`, on the attempts in `attempts`, default [0]:
          a transient fault; [0, 1]: a deterministic one):
          {"kind": "reduced", "bucket", "element", "bit"}: flip a bit of that element of what the
              bucket's all-reduce returned (a comm hook chained after the guard's), before DDP copies
              it into the gradients
          {"kind": "weight", "param", "element", "bit"}: flip a bit of a weight before the update's
              forward (memory that changed after the optimizer step)
          {"kind": "grad", "param", "element", "scale"}: multiply one element of the rank's local
              gradient by `scale` (a tensor hook, before the reduce: an exponent bit flipped 0->1)
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_case import batch, model, snapshot, spawn


def flip(t: torch.Tensor, element: int, bit: int) -> None:
    """Flip bit `bit` of float32 element `element` of `t` in place."""
    bits = t.detach().view(-1)[element : element + 1].view(torch.int32)
    bits ^= torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32)


def worker(rank: int, world: int, port: int, case: dict, outdir: str) -> None:
    import gradbus.torch as gt

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    out = {"verdicts": [], "findings": [], "snapshots": [], "losses": [], "error": None, "error_type": None,
           "report": None, "detections": None, "suspects": None, "paths": []}
    f = case.get("fault") or {}
    mine = f.get("rank") == rank
    now = {"step": -1, "attempt": 0}

    def due() -> bool:
        return mine and now["step"] == f["step"] and now["attempt"] in f.get("attempts", [0])

    try:
        net = model()
        ddp = DDP(net, bucket_cap_mb=0.25)
        inner = torch.optim.Adam(ddp.parameters(), lr=1e-2)
        params = dict(net.named_parameters())
        guard, opt = None, inner
        if case.get("guard") is not None:
            guard = gt.Guard(names=net, **case["guard"])
            opt = gt.GuardedOptimizer(inner, guard)

            def hook(g, bucket):  # no annotations: DDP checks them, and this module defers them
                fut = gt.allreduce_hook(g, bucket)
                if f.get("kind") == "reduced" and due() and bucket.index() == f["bucket"]:
                    def damage(fu: torch.futures.Future) -> torch.Tensor:
                        t = fu.value()
                        flip(t, f["element"], f["bit"])
                        return t
                    return fut.then(damage)
                return fut

            ddp.register_comm_hook(guard, hook)
        for step in range(case.get("steps", 8)):
            now["step"] = step
            x, y = batch(rank, step)
            out["snapshots"].append(snapshot(net, inner))
            for attempt in guard.attempts() if guard is not None else [0]:
                now["attempt"] = attempt
                if f.get("kind") == "weight" and due():
                    with torch.no_grad():
                        flip(params[f["param"]], f["element"], f["bit"])
                handles = []
                if f.get("kind") == "grad" and due():
                    def scaled(g: torch.Tensor) -> torch.Tensor:
                        g = g.clone()
                        g.view(-1)[f["element"]] *= f["scale"]
                        return g
                    handles.append(params[f["param"]].register_hook(scaled))
                opt.zero_grad()
                loss = nn.functional.mse_loss(ddp(x), y)
                out["losses"].append(loss.item())
                if guard is not None and not case.get("plain_backward"):
                    guard.backward(loss)
                else:
                    loss.backward()
                for h in handles:
                    h.remove()
                if case.get("clip") is not None:
                    torch.nn.utils.clip_grad_norm_(net.parameters(), case["clip"])
                if guard is not None:
                    v = opt.step()
                    out["verdicts"].append((step, attempt, v.action))
                    out["paths"].append(guard.path)
                    if v.finding is not None:
                        out["findings"].append((step, attempt, v.finding, v.report))
                else:
                    opt.step()
        out["snapshots"].append(snapshot(net, inner))
    except (gt.NonFiniteGradients, gt.ReplicasDiverged, gt.OutlierGradients) as e:
        out["error"], out["error_type"], out["report"] = str(e), type(e).__name__, e.report
    finally:
        if guard is not None:
            out["detections"], out["suspects"] = guard.detections, guard.suspects
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def run(world: int, case: dict, outdir: str | None = None):
    """Run the case on `world` processes; one result dict per rank."""
    return spawn(worker, world, case, outdir)
