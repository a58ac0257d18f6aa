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
`guard.step` follows `state.global_step` (set at each step's beginning): a report's step is the
global step the update would have completed (0-based: the Trainer logs it as step + 1).

Supported: transformers 5.x with accelerate (tested: 5.24.0, accelerate 1.15.0), DDP (torchrun, >= 2
processes), fp32, bf16 and fp16; policies "abort" and "skip" ("rerun" is refused: the Trainer has no
loop that recomputes an update from the same batch); TRL's GRPOTrainer (a Trainer subclass) as it is
(tested: trl 1.16.0; python/examples/trl_grpo.py). FSDP and DeepSpeed in the Trainer are refused (gradbus.fsdp guards
FSDP2 outside the Trainer).
"""

import functools
from importlib import metadata
from typing import Any

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


def guard(trainer: Any, policy: str = "abort", run_dir: Any = None, **kwargs: Any) -> gbt.Guard:
    """Put the gradbus guard into `trainer` (call before `trainer.train()`); returns the Guard.
    policy, run_dir and the keyword arguments: as `gradbus.torch.Guard`."""
    from transformers import TrainerCallback

    check_version(metadata.version("transformers"))
    if policy == "rerun":
        raise ValueError(
            "gradbus.hf: policy 'rerun' needs a training loop that recomputes the update from the same batch, "
            "and the Trainer has none: the update would be dropped and the next batch judged as its "
            "recomputation (hint: policy 'skip' or 'abort')"
        )
    # fp16: accelerate's GradScaler (None for bf16, fp32, and fp16 on the CPU, which accelerate runs
    # unscaled in fp32).
    scaler = getattr(trainer.accelerator, "scaler", None)
    g = gbt.Guard(policy, names=trainer.model, run_dir=run_dir, scaler=scaler, **kwargs)

    class GradbusCallback(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            _install(trainer, g)

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            g.step = state.global_step

    compute_loss = trainer.compute_loss

    def judged_compute_loss(*args: Any, **kw: Any) -> Any:
        out = compute_loss(*args, **kw)
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


def _install(trainer: Any, g: gbt.Guard) -> None:
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
        v = g.verdict()
        # With a scaler, accelerate's step runs scaler.step and scaler.update (the scaler skips an
        # overflow and lowers its scale).
        gbt.apply_verdict(v, g.scaler, lambda: step(*a, **kw))
        # accelerate's "step was skipped", which the Trainer reads to hold the LR schedule: set for
        # every update not proceeded with. accelerate's own flag misses a GradScaler's overflow with
        # a fused optimizer (the Trainer's default adamw_torch_fused): its step is called and skips
        # inside, so the Trainer alone advances the schedule over an overflow.
        opt._is_overflow = not v.proceeded

    opt.step = guarded_step
