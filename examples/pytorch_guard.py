"""A complete DDP training script guarded by gradbus (docs/pytorch.md shows it and runs it).

    torchrun --standalone --nproc-per-node 2 examples/pytorch_guard.py --steps 20

NCCL on GPUs when there are any (one per process), gloo on the CPU otherwise. --plant-nan STEP makes
rank 1's gradient NaN at that step, to see what the guard does with it under each --policy.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradbus.torch as gbt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--policy", choices=["abort", "skip", "rerun"], default="skip")
    ap.add_argument("--amp", choices=["fp16", "bf16"], help="autocast dtype (fp16 with a GradScaler)")
    ap.add_argument("--plant-nan", type=int, metavar="STEP", help="rank 1 plants a NaN in its gradient at STEP")
    ap.add_argument("--run-dir", default="runs/pytorch-guard", help="where rank 0 writes report.json")
    a = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 1)).to(device)
    ddp = DDP(model)

    scaler = torch.amp.GradScaler(device.type) if a.amp == "fp16" else None
    guard = gbt.Guard(policy=a.policy, names=model, run_dir=a.run_dir, scaler=scaler, replica_every=100)
    ddp.register_comm_hook(guard, gbt.allreduce_hook)
    opt = gbt.GuardedOptimizer(torch.optim.AdamW(ddp.parameters(), lr=1e-3), guard)
    amp = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(a.amp, torch.float32)

    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
    for step in range(a.steps):
        x = torch.randn(64, 32, generator=data).to(device)
        y = x[:, :1].sin() + 0.1 * x[:, 1:2]
        for attempt in guard.attempts():  # 0, and 1 again when policy "rerun" asks to recompute
            opt.zero_grad()
            with torch.autocast(device.type, dtype=amp, enabled=a.amp is not None):
                loss = nn.functional.mse_loss(ddp(x).float(), y)
            plant = None
            if step == a.plant_nan and rank == 1 and attempt == 0:
                plant = model[2].weight.register_hook(lambda g: g.index_fill(1, torch.tensor([5], device=g.device), float("nan")))
            guard.backward(loss)  # loss.backward(), the loss judged with the gradients (scaled with a scaler)
            if plant is not None:
                plant.remove()
            v = opt.step()  # the agreed verdict: the optimizer steps only on "proceed"
        if rank == 0 and (step % 5 == 0 or not v.proceeded or step == a.steps - 1):
            scale = "" if v.loss_scale is None else f", loss scale {v.loss_scale:g}"
            print(f"step {step}: loss {loss.item():.4f} (rank 0), {v.action}{scale}", flush=True)
    if rank == 0:
        print(f"done: {a.steps} updates, {guard.skipped} skipped", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    code = 0
    try:
        main()
    except gbt.NonFiniteGradients as e:  # the same on every rank; rank 0 wrote e.path
        print(f"[rank {dist.get_rank()}] {e}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        code = 3
    # Skip the interpreter's teardown: there torch 2.15's gloo sometimes aborts a finished run
    # ("terminate called without an active exception", SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
