"""The gradbus guard in a Hugging Face `transformers.Trainer` run under DDP (torchrun).

    import gradbus.hf
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    gradbus.hf.guard(trainer, policy="skip", run_dir="runs/job")    # the one added line
    trainer.train()

`guard` adds a `TrainerCallback` and wraps three of the Trainer's methods on this Trainer object only:
- `on_train_begin` (after the Trainer wrapped the model in DistributedDataParallel through accelerate):
  registers `gradbus.torch.allreduce_hook` on that DDP model, so every rank's gradients are tallied
  bucket by bucket before DDP's all-reduce (the DDP guard of `gradbus.torch`, unchanged), and wraps
  the accelerate optimizer's `step`: it takes the agreed verdict first and steps only on "proceed".
  Otherwise it marks the step skipped the way accelerate marks an fp16 overflow
  (`optimizer.step_was_skipped`), which the Trainer reads to leave the learning-rate schedule where
  it is; the Trainer's `global_step` still advances and the step is logged, as for an overflow.
  With `fp16=True` the guard takes accelerate's GradScaler (`trainer.accelerator.scaler`, as
  `gradbus.torch.Guard(scaler=...)`): a non-finite update is the scaler's overflow, skipped on every
  rank by accelerate's own step (the scaler lowers its scale) and recorded with its report in
  `guard.skips`; the LR schedule holds, as the Trainer intends for an overflow (without the guard,
  accelerate misses overflows with the default fused AdamW and the schedule advances); an overflow at
  a scale at or below `min_scale` (default 1.0), or past the skip budget, aborts.
  "abort" raises `gradbus.torch.NonFiniteGradients` on every rank from `trainer.train()` (rank 0
  writes run_dir/report.json), naming the rank, the parameter (`transformer.h.K...`) and the element.
- `compute_loss`: hands each micro-batch's loss to the guard before its backward, so the report says
  whether the loss was finite;
- `log`: adds `gradbus_skipped` (updates skipped so far, the same on every rank) to every log entry.
In TRL's GRPOTrainer it also watches the two exps of TRL's loss with `guard.watch`, with no change to
the user's script (`trl_exponents`): "k3_exp", the k3 KL's exponent `ref - logp` (with beta > 0), and
"ratio_exp", the PPO ratio's `logp - logp_old` (when TRL keeps old log-probs: stale rollouts), over
every completion position of each micro-batch; the guard warns in run_dir/warnings.jsonl when one
is forecast to overflow, and with `watch_policy="stop"` saves a checkpoint through the Trainer's own
`_save_checkpoint` (run_dir's checkpoint-STEP, the state before the update: weights, optimizer,
scheduler, RNG, trainer state) and raises `gradbus.torch.OverflowAhead` on every rank before the
update that would overflow; `trainer.train(resume_from_checkpoint=...)` resumes from it.
`guard.step` follows `state.global_step` (set at each step's beginning): a report's step is the
global step the update would have completed (0-based: the Trainer logs it as step + 1).

Supported: transformers 5.x with accelerate (tested: 5.24.0, accelerate 1.15.0), DDP (torchrun, >= 2
processes), fp32, bf16 and fp16; policies "abort" and "skip" ("rerun" is refused: the Trainer has no
loop that recomputes an update from the same batch); TRL's GRPOTrainer (a Trainer subclass) as it is
(tested: trl 1.16.0; python/examples/trl_grpo.py). FSDP and DeepSpeed in the Trainer are refused (gradbus.fsdp guards
FSDP2 outside the Trainer).
"""

import functools
import logging
import os
from importlib import metadata
from typing import Any, Callable, List

import torch

import gradbus.torch as gbt

__all__ = ["guard", "SUPPORTED"]

SUPPORTED = (5,)
"""The transformers major versions the adapter was written against."""


def check_version(version: str) -> None:
    """Raise a clear error when `version` (transformers') is not a supported major version."""
    major = version.split(".")[0]
    if not major.isdigit() or int(major) not in SUPPORTED:
        raise RuntimeError(
            f"gradbus.hf: transformers {version} is not supported: the adapter relies on the Trainer's "
            "callbacks, compute_loss and accelerate's step_was_skipped as in transformers 5 "
            "(hint: pip install 'transformers>=5,<6')"
        )


def guard(trainer: Any, policy: str = "abort", run_dir: Any = None, *, quarantine: bool = False, **kwargs: Any) -> gbt.Guard:
    """Put the gradbus guard into `trainer` (call before `trainer.train()`); returns the Guard.
    policy, run_dir and the keyword arguments: as `gradbus.torch.Guard`.

    quarantine: each training item carries its index in `trainer.train_dataset` (a map-style dataset
    of dict items) to the guard (`Guard.samples`), so that an abort or skip report names the samples
    of the micro-batch with the first non-finite value (and rank 0 lists them in
    run_dir/quarantine.jsonl); an abort saves a checkpoint through the Trainer's own save (the state
    before the update: `NonFiniteGradients.checkpoint`); and the samples run_dir/quarantine.jsonl
    already names are left out of the dataset, so a run resumed from that checkpoint passes the
    update without them. Not for TRL's GRPOTrainer (its generation batches carry no dataset index)."""
    from transformers import TrainerCallback

    check_version(metadata.version("transformers"))
    if policy == "rerun":
        raise ValueError(
            "gradbus.hf: policy 'rerun' needs a training loop that recomputes the update from the same batch, "
            "and the Trainer has none: the update would be dropped and the next batch judged as its "
            "recomputation (hint: policy 'skip' or 'abort')"
        )
    if kwargs.get("sdc"):
        raise ValueError(
            "gradbus.hf: sdc=True reruns an outlier's update and recomputes a repaired one, and the Trainer has "
            "no loop that recomputes an update (hint: replica_every=N alone, which stops the job on a damaged "
            "replica; or a plain DDP loop with guard.attempts(), docs/pytorch.md)"
        )
    # fp16: accelerate's GradScaler (None for bf16, fp32, and fp16 on the CPU, which accelerate runs
    # unscaled in fp32).
    scaler = getattr(trainer.accelerator, "scaler", None)
    g = gbt.Guard(policy, names=trainer.model, run_dir=run_dir, scaler=scaler, **kwargs)
    if g.on_stop is None:
        g.on_stop = functools.partial(_save, trainer)
    if hasattr(trainer, "_get_per_token_logps_and_entropies"):  # TRL's GRPOTrainer (and its kin)
        if quarantine:
            raise ValueError("gradbus.hf: quarantine needs dataset indices in the training batches; TRL's "
                             "GRPOTrainer's generation batches carry none (hint: quarantine=False)")
        trl_exponents(trainer, g.watch)
    if quarantine:
        _carry_sample_ids(trainer, gbt.quarantined(run_dir) if run_dir is not None else [])

    class GradbusCallback(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            _install(trainer, g, quarantine)

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            g.step = state.global_step

    compute_loss = trainer.compute_loss

    def judged_compute_loss(model: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
        if SAMPLE_KEY in inputs:  # quarantine: the batch's dataset indices, for a report
            g.samples(inputs.pop(SAMPLE_KEY).tolist())
        out = compute_loss(model, inputs, *args, **kw)
        g.set_loss((out[0] if isinstance(out, tuple) else out).detach())
        return out

    trainer.compute_loss = judged_compute_loss
    log = trainer.log

    def log_with_skips(logs: dict, *args: Any, **kw: Any) -> None:
        logs["gradbus_skipped"] = g.skipped
        log(logs, *args, **kw)

    trainer.log = log_with_skips
    trainer.add_callback(GradbusCallback())
    return g


def _install(trainer: Any, g: gbt.Guard, quarantine: bool) -> None:
    ddp = trainer.model_wrapped
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        raise RuntimeError(
            f"gradbus.hf: the Trainer's model is a {type(ddp).__name__}, not DistributedDataParallel: the guard "
            "reads each rank's gradients in DDP's all-reduce (hint: run under torchrun with >= 2 processes; "
            "FSDP and DeepSpeed in the Trainer are not supported)"
        )
    ddp.register_comm_hook(g, gbt.allreduce_hook)
    opt = trainer.optimizer
    if not hasattr(opt, "step_was_skipped") or not hasattr(opt, "_is_overflow"):
        raise RuntimeError(
            f"gradbus.hf: the Trainer's optimizer {type(opt).__name__} is not accelerate's AcceleratedOptimizer "
            "with step_was_skipped (hint: accelerate >= 1.0)"
        )
    step = opt.step

    # wraps: the LR scheduler marked `step` as its own wrapper (`_wrapped_by_lr_sched`); keeping the
    # marker keeps torch from warning that the step was overridden after the scheduler was built.
    @functools.wraps(step)
    def guarded_step(*a: Any, **kw: Any) -> None:
        try:
            v = g.verdict()
        except gbt.NonFiniteGradients as e:
            if quarantine:  # every rank healthy, the update not taken: a checkpoint to resume from
                e.checkpoint = _save(trainer)
            raise
        # With a scaler, accelerate's step runs scaler.step and scaler.update (the scaler skips an
        # overflow and lowers its scale).
        gbt.apply_verdict(v, g.scaler, lambda: step(*a, **kw))
        # accelerate's "step was skipped", which the Trainer reads to hold the LR schedule: set for
        # every update not proceeded with. accelerate's own flag misses a GradScaler's overflow with
        # a fused optimizer (the Trainer's default adamw_torch_fused): its step is called and skips
        # inside, so the Trainer alone advances the schedule over an overflow.
        opt._is_overflow = not v.proceeded

    opt.step = guarded_step


def _save(trainer: Any) -> str:
    """The Trainer's own checkpoint of the state now (before the update being judged), on every
    rank as its saves expect: `output_dir/checkpoint-<global_step>`, which resume_from_checkpoint
    takes."""
    trainer._save_checkpoint(trainer.model_wrapped, trial=None)
    return os.path.join(trainer.args.output_dir, f"checkpoint-{trainer.state.global_step}")


def trl_exponents(trainer: Any, watch: Callable[[str, torch.Tensor], None]) -> None:
    """Hand `watch(name, x)` the arguments of the two exps of TRL's GRPO loss for every micro-batch,
    read where TRL computes them (trl 1.16's `_compute_loss`: the per-token log-probs of the loss's
    own forward from `_get_per_token_logps_and_entropies`, and the inputs' `ref_per_token_logps` and
    `old_per_token_logps`): "k3_exp" = ref - logp (the k3 KL's exp(ref - logp), with beta > 0) and
    "ratio_exp" = logp - logp_old (the PPO ratio's exp; its sequence-level variant takes a mean of
    these, which their maximum bounds), each over every completion position (exp is evaluated at
    all of them, padding included). Changes nothing TRL computes; wraps the two methods on this
    trainer object only."""
    logps_of, compute_loss = trainer._get_per_token_logps_and_entropies, trainer._compute_loss
    kept: dict = {}

    def keeping_logps(*a: Any, **kw: Any) -> Any:
        out = logps_of(*a, **kw)
        if torch.is_grad_enabled():  # the loss's own forward (generation and ref run under no_grad)
            kept["logps"] = out[0]
        return out

    def watched_loss(model: Any, inputs: Any, *a: Any, **kw: Any) -> Any:
        out = compute_loss(model, inputs, *a, **kw)
        logps = kept.pop("logps").detach()
        with torch.no_grad():
            if inputs.get("ref_per_token_logps") is not None:
                watch("k3_exp", inputs["ref_per_token_logps"] - logps)
            if inputs.get("old_per_token_logps") is not None:
                watch("ratio_exp", logps - inputs["old_per_token_logps"])
        return out

    trainer._get_per_token_logps_and_entropies, trainer._compute_loss = keeping_logps, watched_loss


SAMPLE_KEY = "gradbus_sample_id"
"""The key under which a training item carries its dataset index (`guard(..., quarantine=True)`)."""


class _Indexed(torch.utils.data.Dataset):
    """A map-style dataset of dict items without the `left_out` indices, each item carrying its index
    in the original dataset under SAMPLE_KEY. With nothing left out it serves the same items in the
    same order, so the Trainer's sampler draws the same batches."""

    def __init__(self, ds: Any, left_out: List[Any]):
        out = set(left_out)
        self.ds, self.keep = ds, [i for i in range(len(ds)) if i not in out]

    def __len__(self) -> int:
        return len(self.keep)

    def __getitem__(self, i: int) -> dict:
        j = self.keep[i]
        return {**self.ds[j], SAMPLE_KEY: j}


def _carry_sample_ids(trainer: Any, left_out: List[Any]) -> None:
    """The quarantine's plumbing: the training set as `_Indexed` (without `left_out`), and SAMPLE_KEY
    kept by the Trainer's column removal (it is popped again before the model sees the batch)."""
    if left_out:
        logging.getLogger("gradbus").warning("gradbus.hf: leaving out %d quarantined sample(s): %s", len(left_out), left_out)
    trainer.train_dataset = _Indexed(trainer.train_dataset, left_out)
    columns = trainer._set_signature_columns_if_needed

    def with_sample_ids() -> None:
        columns()
        if SAMPLE_KEY not in trainer._signature_columns:
            trainer._signature_columns.append(SAMPLE_KEY)

    trainer._set_signature_columns_if_needed = with_sample_ids
