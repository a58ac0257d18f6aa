"""Megatron-core with the gradbus guard: a tiny GPTModel (local layer spec, no Transformer Engine) in
Megatron's DistributedDataParallel, optionally with a NaN planted in one rank's gradient.

    torchrun --standalone --nproc-per-node 2 python/examples/megatron_guard.py --cpu --policy abort --plant 1:2:decoder.layers.0.mlp.linear_fc1.weight:77
    torchrun --standalone --nproc-per-node 2 python/examples/megatron_guard.py --policy skip      # GPUs: NCCL, Megatron's optimizer

The two lines a Megatron script adds are marked "gradbus". --plant RANK:STEP:PARAM:ELEMENT writes a
NaN into PARAM's gradient element ELEMENT on rank RANK at iteration STEP (example_cli.py: a stand-in
for a loss gone non-finite). --policy none runs Megatron alone (its own check_for_nan_in_grad on,
as in the seed's run: only the rank that sees the NaN raises). Exit: 0, or 3 when the guard aborted.

--cpu runs on the CPU over gloo. Megatron assumes a GPU in a few places, so three CPU stand-ins are
installed (`cpu_stand_ins`), and Megatron's optimizer (it allocates on 'cuda') is replaced by
`MainGradAdam`, which does what its FP32Optimizer does for fp32 parameters; everything else -
GPTModel, DistributedDataParallel with its buffers, buckets and collectives, finalize_model_grads -
is megatron-core's own code.
"""

import contextlib

import torch

import example_cli

VOCAB, SEQ, BATCH = 64, 16, 2


class _NoStream:
    def wait_event(self, event):  # pragma: no cover - no CUDA-graph events on the CPU
        raise AssertionError("no CUDA events on the CPU")


def cpu_stand_ins() -> None:
    """Megatron on the CPU: `torch.cuda.current_device` returns "cpu" (its DDP allocates the grad
    buffers there); `torch.cuda.current_stream` returns a no-op stream (0.19's start_grad_sync waits on
    CUDA-graph events through it; there are none); the model-parallel RNG tracker's `fork` is a no-op
    (it swaps CUDA RNG states around dropout, and dropout is 0 here)."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


class MainGradAdam:
    """FP32Optimizer's step for fp32 parameters, on the CPU: grad = main_grad, torch Adam; returns
    Megatron's (update_successful, grad_norm, num_zeros_in_grad)."""

    def __init__(self, params, lr=1e-2):
        self.params = list(params)
        self.inner = torch.optim.Adam(self.params, lr=lr)

    def step(self):
        for p in self.params:
            p.grad = p.main_grad
        self.inner.step()
        return True, None, None

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def gpt(cpu: bool, bf16: bool = False):
    """(config, model): a tiny GPTModel (2 layers, hidden 32, 4 heads, vocab 64: ~30K parameters),
    the same initial weights on every rank; bf16: bf16 parameters in Megatron's Float16Module (its
    parameter names then start with "module.", as in Megatron)."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=cpu,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    torch.manual_seed(1234)
    if not cpu:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="learned_absolute")
    model = model if cpu else model.cuda()
    if bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(cfg, model)
    return cfg, model


def batch(rank: int, step: int, device: str):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device)
    pos = torch.arange(SEQ, device=device).unsqueeze(0).expand(BATCH, -1)
    mask = (torch.tril(torch.ones(1, 1, SEQ, SEQ)) < 0.5).to(device)
    return ids, pos, mask


def main() -> int:
    ap = example_cli.parser(__doc__, "runs/megatron")
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU, with the stand-ins above")
    a = ap.parse_args()
    import gradbus.megatron as gm
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    rank, device = example_cli.init(not a.cpu)
    parallel_state.initialize_model_parallel(1, 1)
    if a.cpu:
        cpu_stand_ins()
    cfg, model = gpt(a.cpu)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(check_for_nan_in_grad=True, overlap_grad_reduce=True, bucket_size=8000), model)
    if a.cpu:
        optimizer = MainGradAdam(ddp.parameters())
    else:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2), [ddp])
    if a.policy != "none":
        guard = gm.Guard(ddp, policy=a.policy, run_dir=a.run_dir)  # gradbus
        optimizer = gm.GuardedOptimizer(optimizer, guard)  # gradbus

    def train():
        for it in range(a.steps):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            handle = example_cli.plant(a.plant, rank, it, dict(model.named_parameters()).__getitem__)
            ids, pos, mask = batch(rank, it, device)
            loss = ddp(ids, pos, mask, labels=ids).float().mean()
            loss.backward()
            if handle is not None:
                handle.remove()
            finalize_model_grads([ddp])  # what Megatron's schedule calls after the last micro-batch
            ok, _, _ = optimizer.step()
            print(f"[rank {rank}] iteration {it}: loss {loss.item():.4f}, update {'applied' if ok else 'skipped'}", flush=True)

    return example_cli.run(train, gm.NonFiniteGradients)


if __name__ == "__main__":
    example_cli.exit_now(main())
