"""One multi-process Megatron-core training case for the tests: `run(world, case, outdir)` spawns
`world` processes that train a tiny megatron-core GPTModel (local layer spec, no Transformer Engine)
wrapped in Megatron's own DistributedDataParallel over gloo on the CPU, with or without the gradbus
guard, optionally planting a NaN/Inf in one parameter's gradient on one rank.

What runs is megatron-core's code: parallel_state, GPTModel, DistributedDataParallel with its
_ParamAndGradBuffer / buckets / bucket groups, start_grad_sync and its collectives. Three CPU
stand-ins, and only these (Megatron assumes a GPU there):
- `torch.cuda.current_device` returns "cpu": Megatron's DDP allocates its grad buffers on it;
- `torch.cuda.current_stream` returns a no-op stream (0.19's start_grad_sync waits on CUDA-graph
  events through it; there are none);
- the model-parallel RNG tracker's `fork` is a no-op: it swaps CUDA RNG states around dropout, and
  dropout is 0 here.
Megatron's optimizer (FP32Optimizer) allocates on 'cuda' in its constructor, so the optimizer is a
stand-in that does what FP32Optimizer does with fp32 params: grad = main_grad, then torch Adam,
returning Megatron's (update_successful, grad_norm, num_zeros). The GPU check
(python/gpu/megatron_check.py) runs Megatron's own optimizer.

A case is a dict:
  steps     number of updates (default 4)
  guard     None (Megatron's DDP alone) or gradbus.megatron.Guard keyword arguments
  plants    [{"rank", "step", "param", "element", "value": "nan"|"inf"}]
  overlap   Megatron's overlap_grad_reduce (default True: several buckets, reduced from the backward hooks)
  nan_check Megatron's own check_for_nan_in_grad (default True, as the seed's run had it)
  dist_opt  Megatron's use_distributed_optimizer (reduce-scatter, padded parameter offsets); the
            optimizer stand-in then updates with partly reduced gradients: only for aborts at step 0
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ddp_case import plant_hook, spawn

VOCAB, SEQ, BATCH = 64, 16, 2


class _NoStream:
    def wait_event(self, event):  # pragma: no cover - no CUDA-graph events on the CPU
        raise AssertionError("no CUDA events on the CPU")


def cpu_stand_ins() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def gpt():
    """A tiny GPTModel in Megatron's DDP (2 layers, hidden 32, 4 heads, vocab 64: ~30K parameters)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    torch.manual_seed(1234)  # the same initial weights on every rank
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="learned_absolute")
    return cfg, model


class MainGradAdam:
    """FP32Optimizer's step for fp32 params, on the CPU: grad = main_grad, torch Adam."""

    def __init__(self, params):
        self.params = list(params)
        self.inner = torch.optim.Adam(self.params, lr=1e-2)

    def step(self):
        for p in self.params:
            p.grad = p.main_grad
        self.inner.step()
        return True, None, None

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def snapshot(model, opt: MainGradAdam):
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for p, s in opt.inner.state.items()}
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters()}, "adam": state}


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    mask = torch.tril(torch.ones(1, 1, SEQ, SEQ)) < 0.5
    return ids, pos, mask


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
        cfg, model = gpt()
        overlap = case.get("overlap", True)
        ddp_config = DistributedDataParallelConfig(
            check_for_nan_in_grad=case.get("nan_check", True), overlap_grad_reduce=overlap,
            bucket_size=8000 if overlap else None, use_distributed_optimizer=case.get("dist_opt", False),
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
            ids, pos, mask = batch(rank, step)
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
