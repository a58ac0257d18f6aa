"""A DeepSpeed ZeRO run with the gradbus guard: a small transformer language model (random weights, no
download) trained with ZeRO over gloo on the CPU (DeepSpeed's CPU accelerator), optionally with a
NaN planted in one rank's gradient.

    torchrun --standalone --nproc-per-node 2 python/examples/deepspeed_guard.py --zero 2 --precision bf16 --policy abort --plant 1:2:layers.0.linear1.weight:77
    torchrun --standalone --nproc-per-node 2 python/examples/deepspeed_guard.py --zero 2 --precision bf16 --policy skip --plant 1:2:layers.0.linear1.weight:77

--plant RANK:STEP:PARAM:ELEMENT writes a NaN into PARAM's gradient element ELEMENT on rank RANK at
update STEP (0-based; example_cli.py: a stand-in for a loss gone non-finite). --policy none runs
DeepSpeed alone. --no-bf16-check turns DeepSpeed's bf16 overflow check off (bf16.check_grad_overflow,
off by default before 2026-05). Each rank prints one line per update (loss, DeepSpeed's
skipped_steps, the learning rate, the loss scale) and one at the end (whether ZeRO's fp32 master
weights and Adam's moments are finite). Exit: 0, or 3 when the guard aborted.

fp16 on a CPU: DeepSpeed's CPU accelerator refuses fp16 unless oneDNN has AVX512-FP16 ("ValueError:
Type fp16 is not supported on your device." on an AMD EPYC, for one); `cpu_fp16` then declares it
supported, as a GPU would (torch computes float16 on any x86 CPU), and says so.
"""

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F

import example_cli
import gradbus.deepspeed

VOCAB, WIDTH, HEADS, LAYERS, SEQ, BATCH = 64, 32, 4, 2, 16, 4


class TinyLM(nn.Module):
    """Token and position embeddings, `LAYERS` pre-norm transformer encoder layers with a causal mask,
    a final norm and an output head: ~30K parameters, every one with a gradient."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, HEADS, 2 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(LAYERS)
        )
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        h = self.tok(ids) + self.pos(torch.arange(n, device=ids.device))
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=ids.device, dtype=h.dtype)
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        logits = self.head(self.norm(h))
        # Next-token loss in float32, whatever the parameters' dtype.
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


def model() -> nn.Module:
    torch.manual_seed(1234)  # the same initial weights on every rank and every run
    return TinyLM()


def batch(rank: int, micro: int) -> torch.Tensor:
    """Micro-batch `micro` of `rank`: random tokens, the same on every run."""
    g = torch.Generator().manual_seed(1000 * micro + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def ds_config(zero: int, precision: str, gas: int = 1) -> dict:
    """The DeepSpeed config: ZeRO `zero` (0: none), `precision` ("fp32", "bf16", "fp16" with the
    dynamic loss scaler from 2^8), torch's Adam (DeepSpeed's own CPU Adam is a compiled op), a warm-up schedule."""
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 20}},
        "zero_optimization": {"stage": zero},
        "steps_per_print": 1 << 30,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        # hysteresis 1: the scale halves at the first overflow (DeepSpeed's default, 2, waits for a second).
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    elif precision != "fp32":
        raise ValueError(f"precision {precision!r}: expected fp32, bf16 or fp16")
    return cfg


def cpu_fp16() -> bool:
    """Declare fp16 supported on DeepSpeed's CPU accelerator where oneDNN lacks AVX512-FP16
    (torch.ops.mkldnn._is_mkldnn_fp16_supported() False): the flag's only use on ZeRO's path is
    deepspeed.initialize's refusal. True when it was needed."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() != "cpu" or acc.is_fp16_supported():
        return False
    acc.is_fp16_supported = lambda: True
    return True


def finite_state(engine) -> bool:
    """ZeRO's fp32 master weights (this rank's partition) and Adam's moments hold no NaN/Inf."""
    inner = engine.optimizer.optimizer
    tensors = [p for g in inner.param_groups for p in g["params"]]
    tensors += [v for st in inner.state.values() for v in st.values() if torch.is_tensor(v)]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def main() -> int:
    ap = example_cli.parser(__doc__, "runs/deepspeed")
    ap.add_argument("--zero", type=int, choices=[1, 2, 3], default=2)
    ap.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
    ap.add_argument("--no-bf16-check", action="store_true", help="DeepSpeed's bf16 overflow check off")
    a = ap.parse_args()
    rank, _ = example_cli.init(cuda=False)
    deepspeed.init_distributed(dist_backend="gloo")
    if a.precision == "fp16" and cpu_fp16() and rank == 0:
        print("fp16: DeepSpeed's CPU accelerator says this CPU has no fp16; declared supported (see --help)", flush=True)
    cfg = ds_config(a.zero, a.precision)
    if a.no_bf16_check:
        cfg.setdefault("bf16", {})["check_grad_overflow"] = False
    net = model()
    engine, _, _, sched = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    guard = None
    if a.policy != "none":
        guard = gradbus.deepspeed.guard(engine, policy=a.policy, run_dir=a.run_dir)  # the line a user adds
    params = dict(engine.module.named_parameters())

    def train() -> None:
        for step in range(a.steps):
            handle = example_cli.plant(a.plant, rank, step, params.__getitem__)
            x = batch(rank, step)
            loss = engine(x, labels=x)
            engine.backward(loss)
            if handle is not None:
                handle.remove()
            engine.step()
            print(f"[rank {rank}] step {step} loss {loss.item():.4f} skipped_steps {engine.skipped_steps} "
                  f"lr {sched.get_last_lr()[0]:.6f} loss_scale {engine.optimizer.loss_scale:g}", flush=True)
        skips = "" if guard is None else "; gradbus skips: " + ", ".join(
            f"step {v.step} {v.report['param']}[{v.report['element']}] rank(s) {v.report['ranks']} "
            f"({v.report['classification'] or 'not an overflow'})" for v in guard.skips)
        print(f"[rank {rank}] done: skipped_steps {engine.skipped_steps}, master weights and Adam state "
              f"finite: {finite_state(engine)}{skips}", flush=True)

    return example_cli.run(train, gradbus.deepspeed.NonFiniteGradients)


if __name__ == "__main__":
    example_cli.exit_now(main())
