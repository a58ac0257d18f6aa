"""A plain PyTorch GRPO loop guarded by gradbus, the API used directly: the guard watches the two exps
of the loss and warns before they overflow, stops before the overflow with a checkpoint, and names
(and quarantines) the samples of a micro-batch that turned the gradients non-finite.

    torchrun --standalone --nproc-per-node 2 python/examples/grpo_loop.py                     # warnings, then the abort
    torchrun --standalone --nproc-per-node 2 python/examples/grpo_loop.py --watch-policy stop # stop before it
    torchrun --standalone --nproc-per-node 2 python/examples/grpo_loop.py --resume runs/grpo/checkpoint.pt --num-iterations 1
    torchrun --standalone --nproc-per-node 2 python/examples/grpo_loop.py --num-iterations 1 --empty-response 16

The model is the runtime's tiny GPT in PyTorch (bench/pytorch_grpo.py's `Gpt`: 2 pre-LN blocks, width
32, vocabulary 16); the task is TRL's example's (python/examples/trl_grpo.py): one-letter prompts, 8
completions of up to 8 tokens per prompt, a reward of the fraction of "a" in a completion, group
advantages, TRL's loss (the PPO ratio, and the k3 KL with TRL's bias correction, or plain with
--no-kl-bias-correction), normalised per sequence by its length, AdamW at a constant 0.3, gradients
clipped at norm 1. Each generation batch serves --num-iterations updates (stale rollouts: the policy
drifts from the weights that sampled them), and the k3 exponent ref - logp climbs until exp overflows
float32, as in TRL's example.

--watch-policy stop: rank 0 saves RUN_DIR/checkpoint.pt (weights, optimizer, the update) and every
rank stops before the update the forecast says would overflow; after an agreed abort the loop saves
the same (the update was not taken). --resume FILE continues from it, with a new generation batch
sampled by the restored weights, and leaves out the samples that RUN_DIR/quarantine.jsonl names. --empty-response ID gives prompt ID an empty response budget (as a
prompt that fills the context would): its completions have no token, the per-sequence normalisation
divides 0 by 0, and the update's gradients turn NaN; the guard's report names sample ID.
--out DIR writes each rank's outcome (result-rankK.json) for the tests. Exit: 0; 3 when the guard
aborted or stopped.
"""

import argparse
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from pytorch_grpo import Gpt, target_logp  # noqa: E402  (the runtime's workload in PyTorch)
from workload_config import BOS, EOS, FIRST, PAD  # noqa: E402

import example_cli  # noqa: E402
import gradbus.torch as gbt  # noqa: E402

A = FIRST  # the rewarded token ("a")
PROMPTS = 64
RESPONSE = 8


def sample(policy, ids, budget, group, gen):
    """`group` completions of each prompt `ids[i]` ([BOS, letter]) with `policy`: sequences
    (B, 2 + RESPONSE), PAD after EOS and beyond the prompt's response budget."""
    b = len(ids) * group
    seqs = torch.full((b, 2 + RESPONSE), PAD, dtype=torch.long)
    seqs[:, 0] = BOS
    seqs[:, 1] = torch.tensor([FIRST + i % 13 for i in ids]).repeat_interleave(group)
    room = torch.tensor([budget(i) for i in ids]).repeat_interleave(group)
    for t in range(2, 2 + RESPONSE):
        logits = policy(seqs[:, :t])[:, -1]
        logits[:, [BOS, PAD]] = float("-inf")  # a completion holds letters and EOS only
        probs = torch.softmax(logits, dim=-1)
        tok = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        done = (t - 2 >= room) | ((t > 2) & ((seqs[:, t - 1] == EOS) | (seqs[:, t - 1] == PAD)))
        seqs[:, t] = torch.where(done, torch.full_like(tok, PAD), tok)
    return seqs


def batch(policy, reference, ids, budget, group, gen, stale):
    """A generation batch: inputs, the completion positions' targets, their mask (tokens up to EOS),
    the group advantages, the reference's and (stale rollouts) the sampling policy's log-probs."""
    with torch.no_grad():
        seqs = sample(policy, ids, budget, group, gen)
        inputs, targets = seqs[:, :-1], seqs[:, 2:]
        mask = (targets != PAD).float()
        reward = ((targets == A).float() * mask).sum(1) / RESPONSE
        g = reward.view(-1, group)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).view(-1)
        ref = logps(reference, inputs, targets)
        old = logps(policy, inputs, targets) if stale else None
    return {"inputs": inputs, "targets": targets, "mask": mask, "adv": adv, "ref": ref, "old": old,
            "ids": [i for i in ids for _ in range(group)]}


def logps(model, inputs, targets):
    """Log-probs of the completion positions' targets (as TRL keeps only the completion's logits)."""
    return target_logp(model(inputs)[:, 1:], targets)


def checksum(model) -> str:
    h = hashlib.sha256()
    for n, p in model.named_parameters():
        h.update(n.encode())
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", choices=["abort", "skip", "none"], default="abort", help="the guard's; none: no guard")
    ap.add_argument("--watch-policy", choices=["warn", "stop"], default="warn")
    ap.add_argument("--steps", type=int, default=12, help="updates")
    ap.add_argument("--seed", default="0", help="the seed, or several (0,1,2: one run per seed, each in RUN_DIR/seed-S)")
    ap.add_argument("--lr", type=float, default=0.3)
    ap.add_argument("--beta", type=float, default=0.04, help="the k3 KL's coefficient")
    ap.add_argument("--num-iterations", type=int, default=20, help="updates per generation batch (1: on-policy)")
    ap.add_argument("--no-kl-bias-correction", action="store_true", help="the plain k3 KL")
    ap.add_argument("--empty-response", type=int, default=None, metavar="ID", help="prompt ID's response budget is 0")
    ap.add_argument("--resume", default=None, metavar="FILE", help="a checkpoint.pt of an earlier run")
    ap.add_argument("--spike", choices=["warn", "skip"], default=None, help="the guard's spike detection")
    ap.add_argument("--run-dir", default="runs/grpo")
    ap.add_argument("--out", default=None, help="where each rank writes result-rankK.json (for the tests)")
    a = ap.parse_args()
    example_cli.init(cuda=False)
    seeds = [int(x) for x in a.seed.split(",")]
    rc = 0
    for seed in seeds:
        # Several seeds one after the other in this process group (startup is most of a run's time).
        sub = (lambda d: d) if len(seeds) == 1 else (lambda d: d and os.path.join(d, f"seed-{seed}"))
        rc = max(rc, run(a, seed, sub(a.run_dir), sub(a.out)))
    dist.destroy_process_group()
    return rc


def run(a, seed: int, run_dir: str, out_dir: str) -> int:
    """One run with `seed`: 0, or 3 when the guard aborted or stopped (the same on every rank)."""
    rank = dist.get_rank()
    os.makedirs(run_dir, exist_ok=True)
    torch.manual_seed(seed)  # the same initial weights on every rank
    shape = {"vocab": 16, "channels": 32, "heads": 4, "layers": 2, "max_seq": 2 + RESPONSE}
    policy, reference = Gpt(shape), Gpt(shape)
    reference.load_state_dict(policy.state_dict())
    opt = torch.optim.AdamW(policy.parameters(), lr=a.lr, weight_decay=0.0)
    first, left_out = 0, []
    if a.resume:
        state = torch.load(a.resume)
        policy.load_state_dict(state["policy"])
        opt.load_state_dict(state["optimizer"])
        first = state["update"]
        left_out = gbt.quarantined(run_dir)  # the samples a report named: left out from now on
    now = {"update": first}

    def save() -> str:
        """The loop's own checkpoint of the state before the update now judged (rank 0 writes it)."""
        path = os.path.join(run_dir, "checkpoint.pt")
        if rank == 0:
            torch.save({"policy": policy.state_dict(), "optimizer": opt.state_dict(), "update": now["update"]}, path + ".tmp")
            os.replace(path + ".tmp", path)
        dist.barrier()
        return path

    ddp = DDP(policy)
    guard = None
    if a.policy != "none":
        guard = gbt.Guard(a.policy, names=policy, run_dir=run_dir, watch_policy=a.watch_policy, on_stop=save,
                          spike=a.spike)
        ddp.register_comm_hook(guard, gbt.allreduce_hook)
        guard.step = first
    step = opt.step if guard is None else gbt.GuardedOptimizer(opt, guard).step

    allowed = [i for i in range(PROMPTS) if i not in left_out]
    budget = lambda i: 0 if i == a.empty_response else RESPONSE  # noqa: E731
    rows, out, rc = [], {"error": None, "report": None, "stopped": None, "left_out": left_out}, 0
    b = None
    try:
        for u in range(first, a.steps):
            now["update"] = u
            if u % a.num_iterations == 0 or b is None:
                # This rank's prompt for the generation: the sampler's order is the seed's, the same
                # on every run with the same allowed samples.
                gen = torch.Generator().manual_seed(seed * 1_000_003 + u * 101 + rank)
                order = torch.randperm(len(allowed), generator=torch.Generator().manual_seed(seed + u))
                ids = [allowed[int(order[rank])]]
                b = batch(policy, reference, ids, budget, 8, gen, stale=a.num_iterations > 1)
            logp = logps(ddp, b["inputs"], b["targets"])
            old = logp.detach() if b["old"] is None else b["old"]
            ratio = torch.exp(logp - old)
            adv = b["adv"][:, None]
            per_token = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
            k3 = torch.exp(b["ref"] - logp) - (b["ref"] - logp) - 1
            per_token = per_token + a.beta * (k3 if a.no_kl_bias_correction else k3 * ratio)
            # Normalised per sequence by its length (TRL's "grpo" loss type without its clamp).
            loss = ((per_token * b["mask"]).sum(-1) / b["mask"].sum(-1)).mean()
            rows.append({"update": u, "loss": loss.item(), "ids": sorted(set(b["ids"])),
                         "k3_exp": (b["ref"] - logp).max().item(), "ratio_exp": (logp - old).max().item()})
            opt.zero_grad()
            if guard is None:
                loss.backward()
            else:
                guard.watch("k3_exp", b["ref"] - logp)  # the argument of exp(ref - logp), every position
                if b["old"] is not None:
                    guard.watch("ratio_exp", logp - old)  # the PPO ratio's
                guard.samples(b["ids"])  # this micro-batch's samples, for a report and the quarantine
                guard.backward(loss)
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            step()
    except gbt.OverflowAhead as e:  # watch_policy "stop": saved by the guard through `save`
        print(f"[rank {rank}] {e}", flush=True)
        out.update(error=str(e), stopped=e.update, checkpoint=e.checkpoint)
        rc = 3
    except gbt.NonFiniteGradients as e:
        # The update was not taken: the weights and the optimizer are those before it, the same on
        # every rank. Save them: a resume leaves out the samples the report named.
        print(f"[rank {rank}] {e}", flush=True)
        out.update(error=str(e), report=e.report, checkpoint=save())
        rc = 3
    out.update(gaps=rows, weights=checksum(policy), optimizer_steps=sorted({int(s["step"]) for s in opt.state.values()}),
               nonfinite_params=[n for n, p in policy.named_parameters() if not torch.isfinite(p).all()],
               warnings=None if guard is None else list(guard.warnings),
               skips=None if guard is None else [v.report for v in guard.skips],
               spikes=None if guard is None else guard.spikes)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"result-rank{rank}.json"), "w") as f:
            json.dump(out, f)
    if rank == 0:
        done = rows[-1]["update"] if rows else first
        top = max((r["k3_exp"] for r in rows), default=float("nan"))
        spikes = "" if guard is None or a.spike is None else f", {guard.spikes} spike(s) flagged"
        print(f"seed {seed}: updates {first}..{done}, largest k3 exponent {top:.1f}{spikes}", flush=True)
    dist.barrier()  # every rank recorded its outcome (after an agreed ending every rank is healthy)
    return rc


if __name__ == "__main__":
    example_cli.exit_now(main())
