"""TRL's GRPOTrainer with the gradbus guard: a tiny GPT-2 from a config (random weights, no download)
trained with GRPO, DDP over gloo on the CPU, on stale rollouts until TRL's k3 KL overflows float32.

    torchrun --standalone --nproc-per-node 2 python/examples/trl_grpo.py --policy abort
    torchrun --standalone --nproc-per-node 2 python/examples/trl_grpo.py --policy none

The seed's mechanism, from the training dynamics alone (nothing planted): every generation batch is
reused for --num-iterations updates (GRPOConfig.num_iterations, the GRPO paper's mu) at a large
learning rate, so the policy drifts away from the weights that sampled the rollouts. The reward (the
fraction of "a" in a completion) collapses the policy onto "a", and the other tokens of the stale
rollouts fall far below the reference's log-probability. TRL's k3 KL (beta > 0) with its default
bias correction, (exp(ref - logp) - (ref - logp) - 1) * exp(logp - logp_old), stays modest meanwhile
(about exp(ref - logp_old)), so nothing pulls those tokens back; but exp(ref - logp) is computed
first, and once ref - logp passes ln(FLT_MAX) = 88.72 it is Inf: the loss turns Inf and every
gradient NaN (Inf - Inf in the backward). With --num-iterations 1 (on-policy) the same learning rate
stays far from it.

The guard watches both exps of TRL's loss (gradbus.hf does it, no line in this script): it warns in
RUN_DIR/warnings.jsonl when one is forecast to overflow; --watch-policy stop saves a checkpoint
(RUN_DIR/checkpoint-STEP, through the Trainer's own save) and stops every rank before the update that
would overflow; --resume RUN_DIR/checkpoint-STEP resumes from it (with --num-iterations 1, or
--no-kl-bias-correction, the update passes).

--policy none runs the GRPOTrainer alone. --out DIR writes each rank's outcome (result-rankK.json: the
Trainer's global_step and log history, a checksum of the weights, the parameters holding a non-finite
value, the optimizer's step counts, the error and report or the stop, the guard's warnings, and per
update the loss and the largest k3 exponent ref - logp and PPO log-ratio logp - logp_old over this
rank's completion positions) for the tests. --plant as hf_trainer.py.
Exit: 0; 3 when the guard aborted or stopped; 1 when the GRPOTrainer raised (after NaN weights: the
next generation's sampling fails).
"""

import os

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

import example_cli
import gradbus.hf
from hf_trainer import Plant, train_and_record

VOCAB = ["<pad>", "<eos>", "<bos>"] + [chr(ord("a") + i) for i in range(13)]
A = VOCAB.index("a")


def tokenizer() -> PreTrainedTokenizerFast:
    """One token per space-separated letter (a WordLevel model built here: nothing downloaded)."""
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<pad>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


def reward_a(prompts, completions, completion_ids, **kw) -> list:
    """The fraction of "a" in each completion."""
    return [sum(t == A for t in ids) / max(len(ids), 1) for ids in completion_ids]


class Gaps:
    """Per update and rank, the loss and the largest argument of each exp of TRL's loss over the
    rank's completion positions: "k3_exp" (ref - logp, the k3 KL's) and "ratio_exp" (logp - logp_old,
    the PPO ratio's; absent on-policy), read as the guard reads them (gradbus.hf.trl_exponents). A
    measurement only, for the tests and docs; it changes nothing."""

    def __init__(self, trainer: GRPOTrainer):
        self.rows, self.now = [], {}
        gradbus.hf.trl_exponents(trainer, lambda name, x: self.now.__setitem__(name, x.max().item()))
        loss = trainer.compute_loss

        def measured_loss(*a, **kw):
            out = loss(*a, **kw)
            self.rows.append({"step": trainer.state.global_step, "loss": out.item(), **self.now})
            self.now = {}
            return out

        trainer.compute_loss = measured_loss


def main() -> int:
    ap = example_cli.parser(__doc__, "runs/trl")
    ap.set_defaults(steps=24)
    ap.add_argument("--lr", type=float, default=0.3)
    ap.add_argument("--num-iterations", type=int, default=20, help="updates per generation batch (1: on-policy)")
    ap.add_argument("--beta", type=float, default=0.04, help="the k3 KL's coefficient (TRL's default 0 has no KL)")
    ap.add_argument("--no-kl-bias-correction", action="store_true",
                    help="the plain k3 KL (use_bias_correction_kl=False), whose gradient pulls the policy back")
    ap.add_argument("--seed", default="0", help="the seed, or several (0,1,2: one run per seed, each in RUN_DIR/seed-S)")
    ap.add_argument("--out", default=None, help="where each rank writes result-rankK.json (for the tests)")
    ap.add_argument("--watch-policy", choices=["warn", "stop"], default="warn",
                    help="the guard's answer to an exp forecast to overflow: warn, or save a checkpoint and stop")
    ap.add_argument("--resume", default=None, metavar="CHECKPOINT", help="resume from a checkpoint (the stop's)")
    ap.add_argument("--spike", choices=["warn", "skip"], default=None, help="the guard's spike detection")
    a = ap.parse_args()
    torch.set_num_threads(1)
    seeds = [int(s) for s in a.seed.split(",")]
    rc = 0
    for seed in seeds:
        # Several seeds run one after the other in this process group (the startup is most of a run's
        # time), each into its own folders.
        sub = (lambda d: d) if len(seeds) == 1 else (lambda d: d and os.path.join(d, f"seed-{seed}"))
        rc = max(rc, run(a, seed, sub(a.run_dir), sub(a.out)))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return rc


def run(a, seed: int, run_dir: str, out: str) -> int:
    """One run of the GRPOTrainer with `seed`; its exit code (as train_and_record's)."""
    args = GRPOConfig(
        output_dir=run_dir, max_steps=a.steps, per_device_train_batch_size=8, num_generations=8,
        max_completion_length=8, learning_rate=a.lr, lr_scheduler_type="constant", num_iterations=a.num_iterations,
        beta=a.beta, use_bias_correction_kl=not a.no_kl_bias_correction, disable_dropout=True, seed=seed,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, use_cpu=True, ddp_backend="gloo",
        ddp_find_unused_parameters=False, ddp_timeout=300, dataloader_num_workers=0,
    )
    torch.manual_seed(seed)  # the same random weights on every rank
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=len(VOCAB), n_positions=32,
                                       bos_token_id=2, eos_token_id=1, pad_token_id=0))
    # With beta > 0 TRL builds the reference model with from_pretrained(config._name_or_path): a copy
    # of these initial weights (rank 0 writes them; the process group exists since GRPOConfig).
    ref = os.path.join(run_dir, "initial")
    if args.process_index == 0:
        model.save_pretrained(ref)
    torch.distributed.barrier()
    model.config._name_or_path = ref
    prompts = Dataset.from_list([{"prompt": f"<bos> {VOCAB[3 + i % 13]}"} for i in range(64)])
    trainer = GRPOTrainer(model=model, reward_funcs=reward_a, args=args, train_dataset=prompts,
                          processing_class=tokenizer())
    gaps = Gaps(trainer)
    if a.plant:
        trainer.add_callback(Plant(model, a.plant))
    guard = None
    if a.policy != "none":
        # The line a user adds:
        guard = gradbus.hf.guard(trainer, policy=a.policy, run_dir=run_dir, watch_policy=a.watch_policy, spike=a.spike)

    def outcome() -> dict:
        opt = trainer.optimizer.optimizer
        return {"gaps": gaps.rows, "optimizer_steps": sorted({int(s["step"]) for s in opt.state.values()}),
                "spikes": None if guard is None else guard.spikes}

    # The GRPOTrainer's own error (sampling from NaN weights) is recorded too: exit 1.
    return train_and_record(trainer, model, guard, out, outcome, failures=RuntimeError, resume=a.resume)


if __name__ == "__main__":
    example_cli.exit_now(main())
