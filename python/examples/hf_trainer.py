"""A Hugging Face Trainer run with the gradbus guard: a tiny GPT-2 from a config (random weights, no
download) trained with DDP over gloo on the CPU, optionally with a NaN planted in one rank's gradient.

    torchrun --standalone --nproc-per-node 2 python/examples/hf_trainer.py --policy abort --plant 1:3:transformer.h.1.mlp.c_fc.weight:42
    torchrun --standalone --nproc-per-node 2 python/examples/hf_trainer.py --policy skip  --plant 1:3:transformer.h.1.mlp.c_fc.weight:42

--plant RANK:STEP:PARAM:ELEMENT writes a NaN into PARAM's gradient element ELEMENT on rank RANK at
global step STEP (0-based; example_cli.py: a stand-in for a loss gone non-finite).
--fp16 trains in fp16 with accelerate's GradScaler (on the CPU the example attaches autocast and the
scaler, as accelerate does on a GPU); --min-scale is then the guard's loss-scale floor.
--policy none runs the Trainer alone. --out DIR writes each rank's outcome (result-rankK.json: the
Trainer's global_step, log history, the scheduler's step count, the optimizer's step count, a
checksum of the weights, the parameters holding a non-finite value, the error and report) for the tests. Exit: 0, or 3 when the guard aborted.
"""

import hashlib
import json
import os
from typing import Optional

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import example_cli
import gradbus.hf
import gradbus.torch as gbt


class Tokens(torch.utils.data.Dataset):
    """Random token sequences (the same on every run; the Trainer's sampler splits them by rank);
    item `empty` has no label token (every label -100: an empty response)."""

    def __init__(self, n: int, seq: int, vocab: int, empty: Optional[int] = None):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)
        self.empty = empty

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        labels = torch.full_like(self.ids[i], -100) if i == self.empty else self.ids[i]
        return {"input_ids": self.ids[i], "labels": labels}


def per_sequence_loss(outputs, labels, num_items_in_batch=None) -> torch.Tensor:
    """A GRPO-style loss: each sequence's mean token loss over its labelled tokens, then the mean
    over the sequences; no clamp, so a sequence without a labelled token divides 0 by 0 (NaN)."""
    target = labels[:, 1:]
    mask = (target != -100).float()
    token = torch.nn.functional.cross_entropy(outputs.logits[:, :-1].transpose(1, 2), target.clamp(min=0), reduction="none")
    return ((token * mask).sum(-1) / mask.sum(-1)).mean()


class Plant(TrainerCallback):
    """The planted NaN (example_cli.plant) at its global step, on its rank."""

    def __init__(self, model: torch.nn.Module, spec: str):
        self.model, self.spec, self.handle = model, spec, None

    def on_step_begin(self, args, state, control, **kw):
        self.handle = example_cli.plant(self.spec, args.process_index, state.global_step, dict(self.model.named_parameters()).__getitem__)

    def on_step_end(self, args, state, control, **kw):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def checksum(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for n, p in model.named_parameters():
        h.update(n.encode())
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def train_and_record(trainer, model: torch.nn.Module, guard, out_dir, outcome=dict, failures=(), resume=None) -> int:
    """`trainer.train()` on this rank (from checkpoint `resume` when given); 0, 3 after the guard's
    agreed abort or stop, 1 after one of `failures` (the trainer's own error), each printed. Then
    writes the rank's outcome to out_dir/result-rankK.json when out_dir is set: the error and report
    (or the stop's update and checkpoint), the Trainer's global_step and log history, a checksum of
    the weights, the parameters holding a non-finite value, the guard's skips and warnings, and what
    `outcome()` adds; and waits for every rank (the process group stays: the caller destroys it)."""
    rank = trainer.args.process_index
    out = {"error": None, "report": None, "stopped": None, "checkpoint": None}
    rc = 0
    try:
        trainer.train(resume_from_checkpoint=resume)
    except gbt.NonFiniteGradients as e:
        print(f"[rank {rank}] {e}", flush=True)
        out.update(error=str(e), report=e.report, checkpoint=getattr(e, "checkpoint", None))
        rc = 3
    except gbt.OverflowAhead as e:
        print(f"[rank {rank}] {e}", flush=True)
        out.update(error=str(e), stopped=e.update, checkpoint=e.checkpoint)
        rc = 3
    except failures as e:
        print(f"[rank {rank}] the {type(trainer).__name__} raised {type(e).__name__}: {e}", flush=True)
        out.update(error=f"{type(e).__name__}: {e}")
        rc = 1
    out.update(
        global_step=trainer.state.global_step,
        log_history=trainer.state.log_history,
        weights=checksum(model),
        nonfinite_params=[n for n, p in model.named_parameters() if not torch.isfinite(p).all()],
        skipped=None if guard is None else guard.skipped,
        warnings=None if guard is None else list(guard.warnings),
        **outcome(),
    )
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"result-rank{rank}.json"), "w") as f:
            json.dump(out, f, default=str)
    if torch.distributed.is_initialized():
        # After an agreed abort every rank is healthy: wait until all have recorded their outcome
        # (torchrun stops the others as soon as one exits non-zero).
        torch.distributed.barrier()
    return rc


def main() -> int:
    ap = example_cli.parser(__doc__, "runs/hf")
    ap.set_defaults(steps=6)
    ap.add_argument("--out", default=None, help="where each rank writes result-rankK.json (for the tests)")
    ap.add_argument("--fp16", action="store_true", help="fp16 mixed precision (accelerate's GradScaler)")
    ap.add_argument("--min-scale", type=float, default=1.0, help="the guard's loss-scale floor (with --fp16)")
    ap.add_argument("--per-sequence-loss", action="store_true", help="each sequence's mean token loss, then their mean")
    ap.add_argument("--empty-response", type=int, default=None, metavar="ID", help="item ID has no label token")
    ap.add_argument("--quarantine", action="store_true", help="gradbus.hf.guard(..., quarantine=True)")
    ap.add_argument("--resume", default=None, metavar="CHECKPOINT", help="resume from a checkpoint")
    a = ap.parse_args()
    torch.set_num_threads(1)

    torch.manual_seed(0)  # the same random weights on every rank and every run
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=a.run_dir, max_steps=a.steps, per_device_train_batch_size=4, learning_rate=1e-3,
        lr_scheduler_type="linear", logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        ddp_backend="gloo", ddp_find_unused_parameters=False, seed=0, disable_tqdm=True, dataloader_num_workers=0,
        fp16=a.fp16,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(64, 16, 64, a.empty_response),
                      compute_loss_func=per_sequence_loss if a.per_sequence_loss else None)
    if a.fp16 and trainer.accelerator.scaler is None:
        # accelerate runs fp16 with autocast and a GradScaler on GPUs only (on the CPU: fp32, no
        # scaler); give it both here, as it would on a GPU, so the CPU test runs fp16's path.
        trainer.accelerator.native_amp = True
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
    if a.plant:
        trainer.add_callback(Plant(model, a.plant))
    guard = None
    if a.policy != "none":
        guard = gradbus.hf.guard(trainer, policy=a.policy, run_dir=a.run_dir, min_scale=a.min_scale,
                                 quarantine=a.quarantine)  # the line a user adds
    seen = []  # the dataset indices of each step's batch on this rank (with --quarantine)
    if a.quarantine:
        judged = trainer.compute_loss

        def recorded(model, inputs, *args, **kw):
            seen.append({"step": trainer.state.global_step, "ids": inputs[gradbus.hf.SAMPLE_KEY].tolist()})
            return judged(model, inputs, *args, **kw)

        trainer.compute_loss = recorded

    def counters() -> dict:
        opt = trainer.optimizer.optimizer
        scaler = trainer.accelerator.scaler
        return dict(scheduler_steps=trainer.lr_scheduler.last_epoch,
                    optimizer_steps=sorted({int(s["step"]) for s in opt.state.values()}),
                    loss_scale=None if scaler is None else scaler.get_scale(),
                    skips=None if guard is None else [{"loss_scale": s.loss_scale, **s.report} for s in guard.skips],
                    seen=seen)

    rc = train_and_record(trainer, model, guard, a.out, counters, resume=a.resume)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return rc


if __name__ == "__main__":
    example_cli.exit_now(main())
