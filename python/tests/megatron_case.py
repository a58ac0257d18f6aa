"""One multi-process Megatron-core training case for the tests: `run(world, case, outdir)` spawns
`world` processes that train a tiny megatron-core GPTModel (local layer spec, no Transformer Engine)
wrapped in Megatron's own DistributedDataParallel over gloo on the CPU, with or without the gradbus
guard, optionally planting a NaN/Inf in one parameter's gradient on one rank.

What runs is megatron-core's code (parallel_state, GPTModel, DistributedDataParallel with its
buffers, buckets, bucket groups, start_grad_sync and collectives), with the three CPU stand-ins and
the stand-in optimizer of python/examples/megatron_guard.py (`cpu_stand_ins`, `MainGradAdam`: Megatron
assumes a GPU there, and its optimizer allocates on 'cuda'). The GPU check
(python/gpu/megatron_check.py) runs Megatron's own optimizer.

A case is a dict:
  steps     number of updates (default 4)
  guard     None (Megatron's DDP alone) or gradbus.megatron.Guard keyword arguments
  plants    [{"rank", "step", "param", "element", "value": "nan"|"inf"}]
  overlap   Megatron's overlap_grad_reduce (default True: several buckets, reduced from the backward hooks)
  nan_check Megatron's own check_for_nan_in_grad (default True, as the seed's run had it)
  dist_opt  Megatron's use_distributed_optimizer (reduce-scatter, padded parameter offsets); the
            optimizer stand-in then updates with partly reduced gradients: only for aborts at step 0
  bf16      None, "bf16-grads" or "fp32-grads": bf16 parameters (Float16Module) with bf16 grad
            buffers, or fp32 ones (grad_reduce_in_fp32); the stand-in optimizer cannot step bf16
            parameters: only for aborts at step 0
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ddp_case import plant_hook, spawn

# The example's CPU stand-ins and model (python/examples/megatron_guard.py; beside this file in the
# GPU bundle of python/gpu/megatron-check.sh).
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from megatron_guard import MainGradAdam, batch, cpu_stand_ins, gpt  # noqa: E402


def snapshot(model, opt: MainGradAdam):
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for p, s in opt.inner.state.items()}
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters()}, "adam": state}


def worker(rank: int, world: int, port: int, case: dict, outdir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    out = {"losses": [], "results": [], "snapshots": [], "error": None, "report": None, "buckets": 0}
    try:
        import gradbus.megatron as gm
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        parallel_state.initialize_model_parallel(1, 1)
        cpu_stand_ins()
        cfg, model = gpt(cpu=True, bf16=case.get("bf16") is not None)
        overlap = case.get("overlap", True)
        ddp_config = DistributedDataParallelConfig(
            check_for_nan_in_grad=case.get("nan_check", True), overlap_grad_reduce=overlap,
            bucket_size=8000 if overlap else None, use_distributed_optimizer=case.get("dist_opt", False),
            grad_reduce_in_fp32=case.get("bf16") == "fp32-grads",
        )
        ddp = DistributedDataParallel(cfg, ddp_config, model)
        inner = MainGradAdam(ddp.parameters())
        opt = inner
        if case.get("guard") is not None:
            guard = gm.Guard(ddp, **case["guard"])
            opt = gm.GuardedOptimizer(inner, guard)
            out["buckets"] = len(guard.layouts)
        params = dict(model.named_parameters())
        for step in range(case.get("steps", 4)):
            out["snapshots"].append(snapshot(model, inner))
            ddp.zero_grad_buffer()
            opt.zero_grad()
            handles = []
            for p in case.get("plants", []):
                if p["rank"] == rank and p["step"] == step:
                    handles.append(params[p["param"]].register_hook(plant_hook(p)))
            ids, pos, mask = batch(rank, step, "cpu")
            loss = ddp(ids, pos, mask, labels=ids).float().mean()
            out["losses"].append(loss.item())
            loss.backward()
            for h in handles:
                h.remove()
            ddp.finish_grad_sync()  # what Megatron's finalize_model_grads calls
            out["results"].append(opt.step()[0])
        out["snapshots"].append(snapshot(model, inner))
        if case.get("guard") is not None:
            out["skipped"] = guard.skipped
    except Exception as e:  # the tests inspect it
        out["error"] = f"{type(e).__name__}: {e}"
        out["report"] = getattr(e, "report", None)
    finally:
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def run(world: int, case: dict, outdir: str | None = None):
    """Run the case on `world` processes; one result dict per rank."""
    return spawn(worker, world, case, outdir)
