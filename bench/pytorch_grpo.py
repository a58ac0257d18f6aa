#!/usr/bin/env python3
"""The gradbus reference workload in PyTorch: the same tiny GPT, the same GRPO RL step, data-parallel
with DistributedDataParallel over gloo on the CPU (one thread per process), or on CUDA GPUs
(`--device cuda`: rank r on GPU r mod the GPU count; NCCL when every rank has a GPU of its own, else
gloo). A benchmark twin, not a
numerical one: the sizes and the work per step are gradbus's (read from the same TOML config), the
random streams and the floating-point order are PyTorch's own.

Per RL step and rank (as worker/src/train.rs):
  1. rollout: copy the trainer weights into the rollout model every `rollout_sync_interval` steps,
     sample `prompts_per_rank x group_size` responses of `response_len` tokens with the rollout
     weights, one position at a time through a KV cache (the prompt first), as gradbus does, PAD
     after EOS;
  2. rewards (task.rs), group-normalised advantages (r - mean) / (std + 1e-6), the mask;
  3. old log-probs under the trainer weights (right after a sync, when the rollout weights are the
     trainer's, the rollout's own logits, as gradbus does) and reference log-probs under the frozen
     initial weights;
  4. epochs x minibatches updates on a fresh shuffle per epoch: forward (DDP), GRPO loss, backward
     (DDP's bucketed gloo all-reduce, mean over ranks), clip by global norm, AdamW.

Throughput - defined identically for gradbus in bench/compare.py:
  tokens   = updates x (per-rank minibatch sequences) x T, summed over ranks, with T = response_len + 1
             the positions the model reads per sequence (only the updates count, though the rollout
             and the old/ref forwards run inside the timed window on both sides);
  wall     = time from the end of RL step 0 to the end of the last step on rank 0: startup, process
             spawn, rendezvous and the warm-up step 0 are excluded; rollout, old/ref log-probs and
             every update of steps 1..S-1 are included;
  tokens/s = tokens of steps 1..S-1 / wall.
Rank 0 prints `step K done` (flushed) at the end of each step, so the driver can also time the lines
exactly as it times gradbus's, and a final JSON line `{"pytorch": {...}}`.

Usage: pytorch_grpo.py CONFIG.toml [--np N] [--set key=value ...] [--guard abort|skip|rerun [--run-dir DIR]]
                       [--comm-hook allreduce] [--device cpu|cuda]

--guard: the gradbus guard (the `gradbus` Python package, python/) as DDP's comm hook, with its
optimizer wrapper; without it, PyTorch's default all-reduce hook. An agreed abort exits 3.
"""

import argparse
import json
import math
import os
import socket
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from workload_config import BOS, EOS, FIRST, PAD, load_config  # noqa: E402


# --- the task (worker/src/task.rs) -------------------------------------------------------------


def target_table(vocab, resp_len, device="cpu"):
    """target(p, i) for every prompt token p (rows) and response position i (columns)."""
    n = vocab - FIRST
    p = torch.arange(vocab, device=device).clamp(min=FIRST)[:, None]
    i = torch.arange(resp_len, device=device)[None, :]
    return FIRST + (3 * (p - FIRST) + i) % n


def batch_from_sequences(seqs, group, targets_of):
    """seqs (B, R + 2) -> inputs, targets (B, T), mask (B, T), reward (B), adv (B)."""
    b, ln = seqs.shape
    resp = seqs[:, 2:]
    stop = (resp == EOS) | (resp == PAD)
    # live_before[i]: no EOS/PAD strictly before i; the mask covers response tokens up to and
    # including EOS, not PAD.
    before = torch.cumsum(stop.int(), dim=1) - stop.int()
    live_before = before == 0
    mask = torch.zeros(b, ln - 1, device=seqs.device)
    mask[:, 1:] = (live_before & (resp != PAD)).float()
    hits = (live_before & ~stop & (resp == targets_of[seqs[:, 1]])).sum(dim=1)
    reward = hits.float() / resp.shape[1]
    g = reward.view(-1, group)
    mean = g.mean(dim=1, keepdim=True)
    std = g.var(dim=1, unbiased=False, keepdim=True).sqrt()
    adv = ((g - mean) / (std + 1e-6)).view(-1)
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous(), mask, reward, adv


# --- the model (worker/src/model.rs) -----------------------------------------------------------


class Block(nn.Module):
    def __init__(self, c, nh):
        super().__init__()
        self.nh = nh
        self.ln1 = nn.LayerNorm(c, eps=1e-5)
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)
        self.ln2 = nn.LayerNorm(c, eps=1e-5)
        self.fc = nn.Linear(c, 4 * c)
        self.fc_proj = nn.Linear(4 * c, c)

    def forward(self, x, cache=None):
        """x: the positions after those in `cache` (a list [k, v], empty at first, extended here)."""
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.nh, c // self.nh).transpose(1, 2) for z in (q, k, v))
        causal = True
        if cache is not None:
            if cache:
                # SDPA's causal mask is aligned top-left: a cached step feeds one new query, which
                # attends every key.
                assert t == 1, "a KV-cached step feeds one position"
                k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
                causal = False
            cache[:] = [k, v]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Gpt(nn.Module):
    """Token + position embeddings, pre-LN blocks, final LN, untied bias-free head."""

    def __init__(self, m):
        super().__init__()
        v, c = m["vocab"], m["channels"]
        self.wte = nn.Embedding(v, c)
        self.wpe = nn.Embedding(m["max_seq"], c)
        self.blocks = nn.ModuleList(Block(c, m["heads"]) for _ in range(m["layers"]))
        self.ln_f = nn.LayerNorm(c, eps=1e-5)
        self.head = nn.Linear(c, v, bias=False)
        # GPT-2 init as Gpt::init: N(0, 0.02), residual projections N(0, 0.02 / sqrt(2L)).
        proj_std = 0.02 / math.sqrt(2 * max(m["layers"], 1))
        for name, p in self.named_parameters():
            if ".ln" in name or name.startswith("ln_f"):
                continue  # LayerNorm: weight 1, bias 0 already
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, 0.0, proj_std if name.endswith("proj.weight") else 0.02)

    def forward(self, tokens, caches=None):
        """tokens (B, T); with `caches` (one list per block, see Block.forward) the positions after
        those already cached."""
        t = tokens.shape[1]
        p0 = caches[0][0].shape[2] if caches and caches[0] else 0
        x = self.wte(tokens) + self.wpe.weight[p0:p0 + t]
        for i, blk in enumerate(self.blocks):
            x = blk(x, None if caches is None else caches[i])
        return self.head(self.ln_f(x))


def target_logp(logits, targets):
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


# --- the loss (worker/src/loss.rs) -------------------------------------------------------------


def grpo_loss(style, clip, kl_coef, logp, mask, adv, old, ref):
    if style == "safe":  # verl/OpenRLHF/TRL: select response positions first, clamp before exp
        sel = mask > 0
        lp, o, r = logp[sel], old[sel], ref[sel]
        a = adv[:, None].expand_as(logp)[sel]
        ratio = torch.exp((lp - o).clamp(-20.0, 20.0))
        pg = -torch.min(ratio * a, ratio.clamp(1.0 - clip, 1.0 + clip) * a)
        lr = (r - lp).clamp(-20.0, 20.0)
        k3 = (lr.exp() - 1 - lr).clamp(-10.0, 10.0)
        n = sel.sum().clamp(min=1)
        return pg.sum() / n + kl_coef * (k3.sum() / n)
    # roll: exp everywhere, k3 clamped after exp, mask multiplied after
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    pg = -torch.min(ratio * a, ratio.clamp(1.0 - clip, 1.0 + clip) * a)
    lr = ref - logp
    k3 = (lr.exp() - 1 - lr).clamp(-10.0, 10.0)
    n = mask.sum().clamp(min=1.0)
    return (pg * mask).sum() / n + kl_coef * ((k3 * mask).sum() / n)


# --- one rank ----------------------------------------------------------------------------------


def worker(rank, world, cfg, port, out):
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dev = torch.device("cpu")
    backend = "gloo"
    if cfg["device"] == "cuda":
        n = torch.cuda.device_count()
        if n == 0:
            sys.exit("--device cuda: torch sees no CUDA device")
        dev = torch.device("cuda", rank % n)
        torch.cuda.set_device(dev)
        backend = "nccl" if world <= n else "gloo"  # NCCL refuses two ranks on one GPU
    dist.init_process_group(backend, rank=rank, world_size=world)

    m, op = cfg["model"], cfg["optim"]
    torch.manual_seed(cfg["seed"])  # same initial weights on every rank (DDP also broadcasts them)
    policy = Gpt(m).to(dev)
    rollout, reference = Gpt(m).to(dev), Gpt(m).to(dev)
    rollout.load_state_dict(policy.state_dict())
    reference.load_state_dict(policy.state_dict())
    for p in list(rollout.parameters()) + list(reference.parameters()):
        p.requires_grad_(False)
    ddp = DDP(policy, gradient_as_bucket_view=True, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.AdamW(policy.parameters(), lr=op["lr"], betas=(op["beta1"], op["beta2"]), eps=op["eps"],
                            weight_decay=op["weight_decay"], foreach=True)
    guard = None
    if cfg.get("comm_hook") == "allreduce":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    if cfg.get("guard"):
        import gradbus.torch as gbt
        sk = cfg.get("skip", {})  # the runtime's skip.* keys bound the skip policy as there
        guard = gbt.Guard(policy=cfg["guard"], names=policy, run_dir=cfg.get("run_dir"),
                          max_consecutive=sk.get("max_consecutive", 3), max_fraction=sk.get("max_fraction", 0.1),
                          window=sk.get("window", 100), agreement=cfg.get("agreement") or "auto",
                          sdc=bool(cfg.get("sdc")), replica_every=1 if cfg.get("sdc") else 0)
        ddp.register_comm_hook(guard, gbt.allreduce_hook)
        opt = gbt.GuardedOptimizer(opt, guard)
    try:
        train(rank, world, cfg, out, policy, rollout, reference, ddp, opt, guard)
        # Everything is printed and the process group destroyed; skip the interpreter's teardown,
        # where torch 2.15 (gloo, 3.2M-parameter DDP) aborts with "terminate called without an
        # active exception" (a joinable C++ thread destroyed), which would fail a finished run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except Exception as e:
        if guard is None or type(e).__name__ != "NonFiniteGradients":
            raise
        sys.stdout.write(f"[rank {rank}] {e}\n")  # one write: the ranks share the pipe
        sys.stdout.flush()
        sys.stderr.flush()
        dist.destroy_process_group()
        # As a finished run (above): skip the teardown where torch 2.15's gloo may abort ("terminate
        # called without an active exception"), which turned this exit 3 into 250 once under load.
        os._exit(3)


def train(rank, world, cfg, out, policy, rollout, reference, ddp, opt, guard):
    m, rl, lo, op = cfg["model"], cfg["rl"], cfg["loss"], cfg["optim"]
    v, r = m["vocab"], rl["response_len"]
    b = rl["prompts_per_rank"] * rl["group_size"]
    per_mb = b // rl["minibatches"]
    t_len = r + 1
    dev = next(policy.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(cfg["seed"] * 1_000_003 + rank)
    targets_of = target_table(v, r, dev)
    kinds = min(v - FIRST, 8)
    sync = max(int(cfg["rollout_sync_interval"]), 1)
    step_end = []
    adam_t = 0

    for step in range(int(cfg["steps"])):
        # 1. rollout with the rollout weights
        if step % sync == 0:
            with torch.no_grad():
                for d, s in zip(rollout.parameters(), policy.parameters()):
                    d.copy_(s)
        with torch.no_grad():
            prompts = FIRST + torch.randint(0, kinds, (rl["prompts_per_rank"],), generator=gen, device=dev)
            seqs = torch.full((b, r + 2), PAD, dtype=torch.long, device=dev)
            seqs[:, 0] = BOS
            seqs[:, 1] = prompts.repeat_interleave(rl["group_size"])
            caches = [[] for _ in rollout.blocks]
            every = []  # the logits of every fed position, (B, T, V) once concatenated
            for t in range(2, r + 2):
                p0 = 0 if t == 2 else t - 1
                every.append(rollout(seqs[:, p0:t], caches))
                logits = every[-1][:, -1, :]
                probs = torch.softmax(logits / rl["temperature"], dim=-1)
                tok = torch.multinomial(probs, 1, generator=gen).squeeze(1)
                if t > 2:
                    prev = seqs[:, t - 1]
                    tok = torch.where((prev == EOS) | (prev == PAD), torch.full_like(tok, PAD), tok)
                seqs[:, t] = tok
            # 2. rewards, advantages, mask
            inputs, targets, mask, reward, adv = batch_from_sequences(seqs, rl["group_size"], targets_of)
            # 3. old (trainer weights) and reference log-probs
            old = target_logp(torch.cat(every, dim=1) if step % sync == 0 else policy(inputs), targets)
            ref = target_logp(reference(inputs), targets)
        # 4. epochs x minibatches updates
        for _epoch in range(rl["epochs"]):
            order = torch.randperm(b, generator=gen, device=dev)
            for mb in range(rl["minibatches"]):
                rows = order[mb * per_mb:(mb + 1) * per_mb]
                logits = ddp(inputs[rows])
                logp = target_logp(logits, targets[rows])
                loss = grpo_loss(lo["style"], lo["clip"], lo["kl_coef"], logp, mask[rows], adv[rows], old[rows],
                                 ref[rows])
                opt.zero_grad(set_to_none=False)
                if guard is None:
                    loss.backward()  # DDP: bucketed all-reduce (mean over ranks) over gloo
                else:
                    guard.backward(loss)  # the same, each bucket validated; the loss is judged too
                if op["grad_clip"] > 0:
                    torch.nn.utils.clip_grad_norm_(policy.parameters(), op["grad_clip"], foreach=True)
                if op.get("warmup", 0) > 0 and adam_t < op["warmup"]:
                    for g in opt.param_groups:
                        g["lr"] = op["lr"] * (adam_t + 1) / op["warmup"]
                elif op.get("warmup", 0) > 0:
                    for g in opt.param_groups:
                        g["lr"] = op["lr"]
                opt.step()
                adam_t += 1
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # the step's kernels are done before its time is taken
        step_end.append(time.perf_counter())
        if rank == 0:
            print(f"step {step} done: reward {float(reward.mean()):.4f} loss {float(loss.detach()):.4f}", flush=True)

    # Replicas: every rank's parameters, compared bitwise on rank 0.
    flat = torch.cat([p.detach().reshape(-1) for p in policy.parameters()])
    every = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    if rank == 0 and len(step_end) >= 2:
        steps_timed = len(step_end) - 1
        updates = steps_timed * rl["epochs"] * rl["minibatches"]
        tokens = updates * per_mb * t_len * world
        wall = step_end[-1] - step_end[0]
        res = {"ranks": world, "steps": len(step_end), "steps_timed": steps_timed, "updates_timed": updates,
               "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
               "params": sum(p.numel() for p in policy.parameters()), "torch": torch.__version__,
               "guard": cfg.get("guard"), "skipped": guard.skipped if guard is not None else 0,
               "replicas_identical": all(torch.equal(every[0], e) for e in every),
               "params_finite": bool(torch.isfinite(flat).all())}
        print(f"pytorch: {world} rank(s), {tokens} tokens in {wall:.2f} s (steps 1..{len(step_end) - 1}): "
              f"{tokens / wall:.0f} tokens/s", flush=True)
        print(json.dumps({"pytorch": res}), flush=True)
        if out:
            with open(out, "w") as f:
                json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("--np", type=int, default=2, help="ranks (processes)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--out", help="write the result JSON here")
    ap.add_argument("--guard", choices=["abort", "skip", "rerun"], help="the gradbus guard with this policy")
    ap.add_argument("--run-dir", help="with --guard: where rank 0 writes report.json on abort")
    ap.add_argument("--agreement", choices=["auto", "summary", "table", "ride"],
                    help="with --guard: the guard's agreement path (default auto: the rows ride the last bucket at 2 ranks)")
    ap.add_argument("--sdc", action="store_true",
                    help="with --guard: the silent-data-corruption checks on every update (sdc=True, replica_every=1)")
    ap.add_argument("--device", choices=["cpu", "cuda"],
                    help="where the model trains (default: the config's `device`, else cpu)")
    ap.add_argument("--comm-hook", choices=["allreduce"],
                    help="register PyTorch's Python default_hooks.allreduce_hook (the guard's baseline)")
    a = ap.parse_args()
    cfg = load_config(a.config, a.set)
    cfg["guard"], cfg["run_dir"], cfg["comm_hook"], cfg["agreement"] = a.guard, a.run_dir, a.comm_hook, a.agreement
    cfg["sdc"] = a.sdc
    cfg["device"] = a.device or cfg.get("device", "cpu")
    if cfg["device"] not in ("cpu", "cuda"):
        sys.exit(f"device = {cfg['device']!r}: expected cpu or cuda")
    rl = cfg["rl"]
    if (rl["prompts_per_rank"] * rl["group_size"]) % rl["minibatches"]:
        sys.exit("rl.minibatches must divide prompts_per_rank x group_size")
    if rl["response_len"] + 1 > cfg["model"]["max_seq"]:
        sys.exit("response_len + 1 must fit model.max_seq")
    try:
        mp.spawn(worker, args=(a.np, cfg, free_port(), a.out), nprocs=a.np, join=True)
    except mp.ProcessExitedException as e:
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
