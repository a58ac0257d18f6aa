#!/usr/bin/env python3
"""Write tests/golden/gpt_grpo.bin: the outside oracle for gradbus's tiny GPT policy and RL loss.

PyTorch builds the same model as worker/src/model.rs (token + position embeddings, pre-LN blocks with
causal multi-head attention and a tanh-GELU MLP, final layer norm, untied bias-free head) from
weights drawn here, runs the forward pass, the GRPO loss and autograd's backward, and writes
everything the Rust test needs to redo and compare the computation. The file is self-contained:
the Rust side reads the weights and inputs from it, so no random stream has to agree across
languages.

Two cases share the weights and the batch:
  safe  - the safe loss (masked positions selected out, log-ratios clamped to [-20, 20] before exp):
          logits, loss and every parameter gradient.
  roll  - ROLL's loss (exp everywhere, k3 clamped after, mask multiplied after) with one masked
          position whose reference log-prob sits 95 nats above the policy's: the loss stays finite
          and autograd's 0 * inf = NaN spreads through the model. Stored: the loss and, per
          parameter, which gradient elements are NaN (u8), so the Rust side can check that it
          reproduces PyTorch's NaN pattern exactly.

File format (little-endian): magic b"GBGOLDEN", u32 version, u32 count, then `count` records of
  u32 name length, name (utf-8), u8 dtype (0 = f32, 1 = i32, 2 = u8), u32 ndim, u32 dims[ndim], data.

Usage: python tests/golden/make_golden.py [output]   (needs torch; see requirements.txt)
Regenerate only when the model or loss definition changes on purpose, and commit the result.
"""

import math
import struct
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

MAGIC = b"GBGOLDEN"
VERSION = 1

# The calibration model (worker GptConfig defaults) and a small batch.
V, MAX_T, C, NH, L = 16, 16, 64, 4, 2
B, T = 4, 10
CLIP, KL_COEF = 0.2, 0.5  # a large KL coefficient so the k3 path carries real weight in the gradients
SEED = 20261129


def param_specs():
    """Names and shapes in forward order, exactly as `model::param_specs`."""
    specs = [("wte", (V, C)), ("wpe", (MAX_T, C))]
    for l in range(L):
        p = f"blocks.{l}."
        specs += [
            (p + "ln1.weight", (C,)),
            (p + "ln1.bias", (C,)),
            (p + "attn.qkv.weight", (3 * C, C)),
            (p + "attn.qkv.bias", (3 * C,)),
            (p + "attn.proj.weight", (C, C)),
            (p + "attn.proj.bias", (C,)),
            (p + "ln2.weight", (C,)),
            (p + "ln2.bias", (C,)),
            (p + "mlp.fc.weight", (4 * C, C)),
            (p + "mlp.fc.bias", (4 * C,)),
            (p + "mlp.proj.weight", (C, 4 * C)),
            (p + "mlp.proj.bias", (C,)),
        ]
    specs += [("ln_f.weight", (C,)), ("ln_f.bias", (C,)), ("head.weight", (V, C))]
    return specs


def make_params(gen):
    """Weights far from init so every path carries signal: N(0, 0.15) matrices, LN weights
    1 + N(0, 0.1), biases N(0, 0.05)."""
    params = {}
    for name, shape in param_specs():
        z = torch.randn(shape, generator=gen, dtype=torch.float32)
        if ".ln" in name or name.startswith("ln_f"):
            t = 1.0 + 0.1 * z if name.endswith("weight") else 0.05 * z
        elif name.endswith("bias"):
            t = 0.05 * z
        else:
            t = 0.15 * z
        params[name] = t.contiguous().requires_grad_(True)
    return params


def forward(P, tokens):
    b, t = tokens.shape
    hs = C // NH
    x = P["wte"][tokens] + P["wpe"][:t]
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
    for l in range(L):
        p = f"blocks.{l}."
        h = F.layer_norm(x, (C,), P[p + "ln1.weight"], P[p + "ln1.bias"], eps=1e-5)
        qkv = F.linear(h, P[p + "attn.qkv.weight"], P[p + "attn.qkv.bias"])
        q, k, v = qkv.split(C, dim=-1)
        q, k, v = (z.view(b, t, NH, hs).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = att.masked_fill(~causal, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, C)
        x = x + F.linear(y, P[p + "attn.proj.weight"], P[p + "attn.proj.bias"])
        h = F.layer_norm(x, (C,), P[p + "ln2.weight"], P[p + "ln2.bias"], eps=1e-5)
        h = F.gelu(F.linear(h, P[p + "mlp.fc.weight"], P[p + "mlp.fc.bias"]), approximate="tanh")
        x = x + F.linear(h, P[p + "mlp.proj.weight"], P[p + "mlp.proj.bias"])
    h = F.layer_norm(x, (C,), P["ln_f.weight"], P["ln_f.bias"], eps=1e-5)
    return F.linear(h, P["head.weight"])


def target_logp(logits, targets):
    return F.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def safe_loss(logp, targets_mask, adv, old, ref):
    """verl/OpenRLHF-style: select response positions first, clamp log-ratios before exp."""
    sel = targets_mask > 0
    lp, o, r = logp[sel], old[sel], ref[sel]
    a = adv[:, None].expand_as(logp)[sel]
    ratio = torch.exp((lp - o).clamp(-20.0, 20.0))
    pg = -torch.min(ratio * a, ratio.clamp(1.0 - CLIP, 1.0 + CLIP) * a)
    lr = (r - lp).clamp(-20.0, 20.0)
    k3 = (lr.exp() - 1 - lr).clamp(-10.0, 10.0)
    n = sel.sum()
    return pg.sum() / n + KL_COEF * (k3.sum() / n)


def roll_loss(logp, mask, adv, old, ref):
    """ROLL: exp at every position, no log-ratio clamp, k3 clamped after exp, mask multiplied after."""
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    pg = -torch.min(ratio * a, ratio.clamp(1.0 - CLIP, 1.0 + CLIP) * a)
    log_ratio = -(logp - ref)
    k3 = (log_ratio.exp() - 1 - log_ratio).clamp(-10.0, 10.0)
    n = mask.sum().clamp(min=1.0)
    return (pg * mask).sum() / n + KL_COEF * ((k3 * mask).sum() / n)


class Writer:
    def __init__(self):
        self.records = []

    def add(self, name, tensor, dtype):
        t = tensor.detach().contiguous()
        if dtype == 0:
            data = struct.pack(f"<{t.numel()}f", *t.to(torch.float32).flatten().tolist())
        elif dtype == 1:
            data = struct.pack(f"<{t.numel()}i", *t.to(torch.int64).flatten().tolist())
        else:
            data = bytes(t.to(torch.uint8).flatten().tolist())
        nb = name.encode()
        head = struct.pack("<I", len(nb)) + nb + struct.pack("<BI", dtype, t.dim())
        head += struct.pack(f"<{t.dim()}I", *t.shape)
        self.records.append(head + data)

    def bytes(self):
        return MAGIC + struct.pack("<II", VERSION, len(self.records)) + b"".join(self.records)


def main():
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("gpt_grpo.bin")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(SEED)
    P = make_params(gen)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    targets = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T)
    mask[:, 0] = 0.0  # position 0 predicts the prompt token
    for b, live in enumerate([T, T - 2, T - 4, 3]):  # padded tails
        mask[b, live:] = 0.0
    adv = torch.randn(B, generator=gen)
    with torch.no_grad():
        logp0 = target_logp(forward(P, tokens), targets)
    # Old and reference log-probs near the current ones: ratios straddle the clip range.
    old = (logp0 + 0.15 * torch.randn(B, T, generator=gen)).contiguous()
    ref = (logp0 + 0.5 * torch.randn(B, T, generator=gen)).contiguous()

    w = Writer()
    w.add("config", torch.tensor([V, MAX_T, C, NH, L, B, T]), 1)
    w.add("loss_config", torch.tensor([CLIP, KL_COEF]), 0)
    w.add("tokens", tokens, 1)
    w.add("targets", targets, 1)
    w.add("mask", mask, 0)
    w.add("adv", adv, 0)
    w.add("old_logp", old, 0)
    w.add("ref_logp", ref, 0)
    for name, _ in param_specs():
        w.add("param." + name, P[name], 0)

    # Case 1: safe loss.
    logits = forward(P, tokens)
    loss = safe_loss(target_logp(logits, targets), mask, adv, old, ref)
    loss.backward()
    safe_value = float(loss.detach())
    w.add("safe.logits", logits, 0)
    w.add("safe.loss", loss.reshape(1), 0)
    for name, _ in param_specs():
        w.add("safe.grad." + name, P[name].grad, 0)
        P[name].grad = None

    # Case 2: ROLL's loss with a 95-nat k3 gap at a masked (padding) position of sample 2.
    ref_roll = ref.clone()
    ref_roll[2, T - 1] = logp0[2, T - 1] + 95.0
    logits = forward(P, tokens)
    loss = roll_loss(target_logp(logits, targets), mask, adv, old, ref_roll)
    loss.backward()
    assert torch.isfinite(loss), "the roll case keeps a finite loss"
    w.add("roll.ref_logp", ref_roll, 0)
    w.add("roll.loss", loss.reshape(1), 0)
    nan_total = 0
    for name, _ in param_specs():
        nan = torch.isnan(P[name].grad)
        nan_total += int(nan.sum())
        w.add("roll.grad_is_nan." + name, nan, 2)
    assert nan_total > 0, "the roll case must produce NaN gradients"

    out.write_bytes(w.bytes())
    print(f"wrote {out} ({out.stat().st_size} bytes); torch {torch.__version__}; "
          f"safe loss {safe_value:.6f}; roll loss {float(loss.detach()):.6f}; "
          f"NaN gradient elements in the roll case: {nan_total} of {sum(p.numel() for p in P.values())}")


if __name__ == "__main__":
    main()
