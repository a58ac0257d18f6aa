#!/usr/bin/env python3
"""What the framework adapters' guard costs per update, against the same framework without it, in the
same processes: a 2-rank job over gloo on the CPU builds the model twice (identical weights), once
plain and once guarded, and alternates rounds of `--iters` updates between the two (plain, guarded,
plain, ...), so a load change on the machine hits both alike. Prints, per round pair, wall ms per
update and rank 0's CPU ms per update (process time: its own work, not time spent waiting for the
peer), the guarded/plain ratio of the medians, and the CPU time of the thread that runs the guard's
own entry points (its scans; building and exchanging the agreement's row, waiting for it, the
verdict) per update, as a fraction of a plain update's CPU time. Thread time, not process time:
the process's clock also counts gloo's threads and autograd's, which run meanwhile and while the
hook waits for the GIL. On a loaded or shared machine the A/B ratios wander by several percent both
ways from round to round; that fraction does not. A benchmark: asserts nothing.

  --framework megatron   megatron-core GPTModel (local spec) in Megatron's DDP, overlap_grad_reduce,
                         with the CPU stand-ins of python/examples/megatron_guard.py; optimizer: torch
                         Adam on main_grad (Megatron's own needs CUDA)
  --framework fsdp       FSDP2: a GPT-like stack of fully_shard'ed blocks; torch Adam
  --framework ddp        plain DDP with gradbus.torch's hook vs DDP's built-in all-reduce (what the
                         Hugging Face adapter runs: gradbus.hf registers that hook)
  --framework deepspeed  DeepSpeed ZeRO (`--zero`, default 2; `--precision`, default fp32) on its CPU
                         accelerator, torch Adam, the same stack; gradbus.deepspeed.guard vs none

The model: `--layers` blocks of width `--width`; `--tokens` tokens per rank per update (the guard's
scan is linear in the parameters, the update's compute in parameters x tokens).

Usage: frameworks_cost.py --framework megatron|fsdp|ddp|deepspeed [--width 256] [--layers 4]
                          [--tokens 512] [--iters 10] [--rounds 5] [--zero 2] [--precision fp32]
"""

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402

for d in ("tests", "examples"):  # ddp_case.free_port; megatron_guard's CPU stand-ins
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", d))
SEQ = 128


class Block(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.ln = nn.LayerNorm(w)
        self.attn = nn.Linear(w, 3 * w)
        self.proj = nn.Linear(w, w)
        self.fc = nn.Linear(w, 4 * w)
        self.out = nn.Linear(4 * w, w)

    def forward(self, x):
        h = self.ln(x)
        q, k, v = self.attn(h).chunk(3, dim=-1)
        a = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v
        x = x + self.proj(a)
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln(x))))


def stack(a):
    torch.manual_seed(0)
    return nn.Sequential(*[Block(a.width) for _ in range(a.layers)])


GUARD_CPU = {"health": 0.0, "exchange": 0.0}
"""Rank 0's thread CPU seconds inside the guard's own entry points: `health` (the scans), and `exchange` /
`verdict` (building and exchanging the table, waiting for it, `decide`)."""
_DEPTH = [0]


def timed(guard):
    """Count the CPU time of the guard's work. The DDP hook calls `exchange` at the last bucket and
    `verdict` later; the adapters call `exchange` inside `verdict`: nested calls count once."""
    for name, kind in (("health", "health"), ("exchange", "exchange"), ("verdict", "exchange")):
        f = getattr(guard, name)

        def wrapper(*args, _f=f, _kind=kind, **kw):
            t = time.thread_time()
            _DEPTH[0] += 1
            try:
                return _f(*args, **kw)
            finally:
                _DEPTH[0] -= 1
                if _DEPTH[0] == 0:
                    GUARD_CPU[_kind] += time.thread_time() - t

        setattr(guard, name, wrapper)
    return guard


def build(a, guarded):
    """(step function, parameter count) of one model, plain or guarded."""
    x = torch.randn(a.tokens // SEQ, SEQ, a.width, generator=torch.Generator().manual_seed(dist.get_rank()))
    if a.framework == "ddp":
        import gradbus.torch as gbt
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = stack(a)
        ddp = DDP(net)
        opt = torch.optim.Adam(net.parameters(), lr=1e-4)
        if guarded:
            g = timed(gbt.Guard(policy="skip", names=net))
            ddp.register_comm_hook(g, gbt.allreduce_hook)
            opt = gbt.GuardedOptimizer(opt, g)

        def step():
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()

        return step, sum(p.numel() for p in net.parameters())
    if a.framework == "fsdp":
        import gradbus.fsdp as gf
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        net = stack(a)
        for b in net:
            fully_shard(b, mesh=mesh)
        fully_shard(net, mesh=mesh)
        opt = torch.optim.Adam(net.parameters(), lr=1e-4)
        if guarded:
            opt = gf.GuardedOptimizer(opt, timed(gf.Guard(net, policy="skip")))

        def step():
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()

        return step, sum(p.numel() for p in net.parameters()) * dist.get_world_size()
    if a.framework == "deepspeed":
        import deepspeed
        import gradbus.deepspeed as gds
        from deepspeed_guard import ds_config

        net = stack(a)
        cfg = ds_config(a.zero, a.precision)
        cfg.pop("scheduler")
        engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
        if guarded:
            timed(gds.guard(engine, policy="skip"))
        xd = x.to(next(engine.module.parameters()).dtype)

        def step():
            loss = engine(xd).float().square().mean()
            engine.backward(loss)
            engine.step()

        return step, sum(getattr(p, "ds_numel", p.numel()) for p in net.parameters())  # ZeRO 3: the full size
    # megatron
    import gradbus.megatron as gm
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron_guard import MainGradAdam

    cfg = TransformerConfig(
        num_layers=a.layers, hidden_size=a.width, num_attention_heads=4, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
    )
    torch.manual_seed(0)
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=1024, max_sequence_length=SEQ, position_embedding_type="learned_absolute")
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=10**6), model)
    opt = MainGradAdam(ddp.parameters())
    if guarded:
        opt = gm.GuardedOptimizer(opt, timed(gm.Guard(ddp, policy="skip")))
    b = a.tokens // SEQ
    ids = torch.randint(0, 1024, (b, SEQ), generator=torch.Generator().manual_seed(dist.get_rank()))
    pos = torch.arange(SEQ).unsqueeze(0).expand(b, -1)
    mask = torch.tril(torch.ones(1, 1, SEQ, SEQ)) < 0.5

    def step():
        ddp.zero_grad_buffer()
        ddp(ids, pos, mask, labels=ids).float().mean().backward()
        ddp.finish_grad_sync()
        opt.step()

    return step, sum(p.numel() for p in model.parameters())


def worker(rank, world, port, a):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    if a.framework == "megatron":
        from megatron.core import parallel_state
        from megatron_guard import cpu_stand_ins

        parallel_state.initialize_model_parallel(1, 1)
        cpu_stand_ins()
    if a.framework == "deepspeed":
        import deepspeed
        from deepspeed_guard import cpu_fp16

        # DeepSpeed's CPU accelerator builds its shm op with ninja from the venv's bin/.
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        deepspeed.init_distributed(dist_backend="gloo")
        cpu_fp16()
    steps = {}
    for kind in ("plain", "guarded"):
        steps[kind], params = build(a, kind == "guarded")
        steps[kind]()  # warm-up (DDP's bucket rebuild, lazy init)
    rows = {"plain": [], "guarded": []}
    GUARD_CPU.update(health=0.0, exchange=0.0)
    for r in range(a.rounds):
        for kind in ("plain", "guarded"):
            dist.barrier()
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(a.iters):
                steps[kind]()
            rows[kind].append(((time.perf_counter() - w0) * 1e3 / a.iters, (time.process_time() - c0) * 1e3 / a.iters))
        if rank == 0:
            p, g = rows["plain"][-1], rows["guarded"][-1]
            print(f"round {r}: wall ms/update plain {p[0]:8.2f} guarded {g[0]:8.2f} ({g[0] / p[0]:.3f})   "
                  f"rank-0 CPU ms/update plain {p[1]:8.2f} guarded {g[1]:8.2f} ({g[1] / p[1]:.3f})", flush=True)
    if rank == 0:
        med = {k: [statistics.median(x[i] for x in v) for i in (0, 1)] for k, v in rows.items()}
        print(f"{a.framework}: {params / 1e6:.2f} M parameters, {a.tokens} tokens per rank per update, world {world}, "
              f"{a.rounds} rounds x {a.iters} updates")
        print(f"median wall ms/update: plain {med['plain'][0]:.2f}, guarded {med['guarded'][0]:.2f}, ratio {med['guarded'][0] / med['plain'][0]:.4f}")
        n = a.rounds * a.iters
        scans, verdicts = (GUARD_CPU[k] * 1e3 / n for k in ("health", "exchange"))
        print(f"rank-0 thread CPU ms/update inside the guard: scans {scans:.3f} + exchange and verdict {verdicts:.3f} = {scans + verdicts:.3f}, "
              f"{(scans + verdicts) / med['plain'][1]:.4f} of a plain update's CPU time")
        print(f"median rank-0 CPU ms/update: plain {med['plain'][1]:.2f}, guarded {med['guarded'][1]:.2f}, ratio {med['guarded'][1] / med['plain'][1]:.4f}")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--framework", choices=["megatron", "fsdp", "ddp", "deepspeed"], required=True)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--zero", type=int, choices=[1, 2, 3], default=2, help="deepspeed: the ZeRO stage")
    ap.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32", help="deepspeed: the precision")
    a = ap.parse_args()
    from ddp_case import free_port

    mp.start_processes(worker, args=(a.world, free_port(), a), nprocs=a.world, join=True, start_method="spawn")


if __name__ == "__main__":
    main()
