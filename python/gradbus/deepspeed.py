"""The gradbus guard inside a DeepSpeed ZeRO engine: one call after `deepspeed.initialize`.

    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, config=ds_config, ...)
    guard = gradbus.deepspeed.guard(engine, policy="skip", run_dir="runs/job")   # the one added line
    ...                                                                           # the loop, unchanged:
    loss = loss_fn(engine(batch)); engine.backward(loss); engine.step()

`guard` wraps four methods of this engine's objects (instance attributes: nothing global changes):
- the ZeRO optimizer's reduce of a gradient bucket (ZeRO 1/2: `reduce_ipg_grads`, which hands each
  dtype's bucket to `average_tensor` or the non-contiguous fallback; ZeRO 3:
  `__reduce_and_partition_ipg_grads`, before its reduce-scatter): right before DeepSpeed reduces a
  bucket, the guard reads the rank's OWN gradients in it, in place (the runs of gradients lying back
  to back in one buffer are read as one span: the Rust scan for float32 CPU memory, torch ops in the
  bucket's own dtype and on its device otherwise), and records the span's health and layout
  (DeepSpeed's parameter names, `engine.module`'s FQNs, and their sizes). ZeRO 2 and 3 reduce in
  every micro-step, ZeRO 1 at the accumulation boundary; every reduce of an update is recorded.
- the ZeRO optimizer's `step` (which `engine.step()` calls at the accumulation boundary): first the
  agreed verdict over every rank's spans (one exchange: the core's, `gradbus.guard`), then DeepSpeed's
  own step. "abort" raises `gradbus.torch.NonFiniteGradients` on every rank from `engine.step()`
  (rank 0 writes run_dir/report.json) naming the rank, the parameter and the element.
- the ZeRO optimizer's `_update_scale(overflow)`, which DeepSpeed's step calls once, after its own
  overflow check and before it acts on `optimizer.overflow`: on a skip the guard sets `overflow`, so
  the skip is DeepSpeed's own overflow path: the gradients are dropped, the optimizer (master weights,
  moments, step count) is untouched, the engine counts it in `skipped_steps` and does not advance
  the LR scheduler. With fp16's dynamic loss scaler a non-finite update is the scaler's overflow
  (the guard reads the scale as it reads a GradScaler's): skipped on every rank, DeepSpeed lowers the
  scale exactly as it does alone, and the guard records the report in `guard.skips`; an overflow at
  a scale at or below `min_scale` (default: DeepSpeed's `min_loss_scale`), or past the skip budget,
  aborts. A skip that is not an overflow (a spike) leaves the scaler as it is.
- `engine.backward(loss)`: hands the micro-batches' mean loss to the guard (a `loss.backward()`
  straight through autograd is not seen: the loss is then not judged).

Invariants: the guard never writes a gradient, the weights or the optimizer, so a clean run is
bitwise DeepSpeed's; DeepSpeed's own overflow check still runs and still skips what it finds (the
guard only adds skips); every rank issues the same collectives (DeepSpeed's, plus the guard's
exchange once per update); the spans and their layout are the same on every rank, because
DeepSpeed's reduce needs the same buckets on every rank.

Supported: deepspeed 0.19 (tested: 0.19.8), ZeRO stages 1, 2 and 3, fp32, bf16 and fp16 (dynamic or
static loss scale), data parallelism; policies "abort" and "skip" ("rerun" is refused: the engine
has no loop that recomputes an update from the same batch). Refused with the reason: ZeRO stage 0 and
the optimizers that are not ZeRO's (BF16_Optimizer for ZeRO 1 with fp32 gradient accumulation),
offload, ZeRO++ quantization, pipeline, tensor, sequence and expert parallelism.
"""

from importlib import metadata
from typing import Any, Dict, List, Tuple

import torch

from gradbus.guard import GuardCore, NonFiniteGradients, Verdict

__all__ = ["guard", "Guard", "NonFiniteGradients", "Verdict", "SUPPORTED"]

SUPPORTED = ((0, 19), (0, 19))
"""The deepspeed (major, minor) range the adapter was written against, inclusive."""

_HINT = "hint: pip install 'deepspeed>=0.19,<0.20', or read docs/deepspeed.md on what a new version must keep"


def check_version(version: str) -> None:
    """Raise a clear error when `version` (deepspeed's) is outside `SUPPORTED`."""
    try:
        mm = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        mm = None
    lo, hi = SUPPORTED
    if mm is None or not lo <= mm <= hi:
        raise RuntimeError(
            f"gradbus.deepspeed: deepspeed {version} is not supported: the adapter wraps the ZeRO "
            f"optimizers' bucket reduce and _update_scale of deepspeed {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]} ({_HINT})"
        )


def _version() -> str:
    try:
        return metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        raise ImportError("gradbus.deepspeed: deepspeed is not installed (hint: see docs/deepspeed.md)") from None


class _LossScale:
    """DeepSpeed's dynamic loss scaler as the guard's core reads a GradScaler: the scale the
    current gradients were computed at (read at the exchange, before DeepSpeed's step updates it)."""

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer

    def get_scale(self) -> float:
        return float(self.optimizer.loss_scale)

    def is_enabled(self) -> bool:
        return True


def _spans(grads: List[torch.Tensor]) -> List[Tuple[torch.Tensor, List[int]]]:
    """Group `grads` (in bucket order) into runs that lie back to back in one storage; each run as one
    flat view of that memory and the indices of its gradients. DeepSpeed's contiguous buckets are
    one run; a non-contiguous bucket is one run per gradient."""
    runs: List[Tuple[torch.Tensor, List[int]]] = []
    at = None  # (storage pointer, dtype, device, next storage offset) of the current run
    for k, g in enumerate(grads):
        here = (g.untyped_storage().data_ptr(), g.dtype, g.device, g.storage_offset())
        if at is not None and g.is_contiguous() and here == at:
            base, idx = runs[-1]
            runs[-1] = (base.as_strided((base.numel() + g.numel(),), (1,), base.storage_offset()), idx + [k])
        else:
            runs.append((g.reshape(-1) if g.is_contiguous() else g.contiguous().view(-1), [k]))
        at = (here[0], g.dtype, g.device, g.storage_offset() + g.numel()) if g.is_contiguous() else None
    return runs


class Guard(GuardCore):
    """The guard in one DeepSpeed engine (made by `guard`; the core's verdicts, reports, `skips`,
    `skipped`). `spans`: the spans read in the last update."""

    def __init__(self, engine: Any, policy: str, run_dir: Any, **kwargs: Any):
        opt = engine.optimizer
        scaler = _LossScale(opt) if getattr(opt, "dynamic_loss_scale", False) else None
        if scaler is not None and "min_scale" not in kwargs:
            kwargs["min_scale"] = float(opt.loss_scaler.min_scale)
        params = {id(p): (p, n) for n, p in engine.module.named_parameters()}
        super().__init__(policy, params, run_dir, opt.dp_process_group, scaler=scaler, **kwargs)
        self.engine = engine
        self.spans = 0
        self._next = 0
        self._loss_sum: Any = None
        self._loss_n = 0
        self._skip: Any = None  # the verdict of the step in progress, when it is not "proceed"

    def name(self, param: Any, fallback: str) -> str:
        """The parameter's name in `engine.module`, else `fallback` (a name DeepSpeed's numbering
        gives alike on every rank)."""
        known = self._params.get(id(param))
        return fallback if known is None else known[1]

    def _check_bucket(self, grads: List[torch.Tensor], names: List[str]) -> None:
        """Record the health of one bucket's gradients (in DeepSpeed's order, named), before its reduce."""
        for flat, idx in _spans(grads):
            self.record(self._next, [(names[k], grads[k].numel()) for k in idx], self.health(flat))
            self._next += 1

    def _backward(self, loss: Any) -> None:
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().float()
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
            self._loss_n += 1

    def _verdict(self) -> Verdict:
        if self._next == 0:
            raise RuntimeError(
                "gradbus.deepspeed: the optimizer steps but DeepSpeed reduced no gradient bucket since the last "
                "step (hint: engine.backward(loss) before engine.step())"
            )
        if self._loss_n:
            self.set_loss(self._loss_sum / self._loss_n)
        self._loss_sum, self._loss_n = None, 0
        self.spans, self._next = self._next, 0
        self.step = int(self.engine.global_steps)
        self.exchange()
        return self.verdict()


def _refuse(what: str, why: str) -> None:
    raise NotImplementedError(f"gradbus.deepspeed: {what} is not supported: {why}")


def guard(engine: Any, policy: str = "abort", run_dir: Any = None, **kwargs: Any) -> Guard:
    """Put the gradbus guard into a DeepSpeed engine (call once, after `deepspeed.initialize`, before
    the first backward); returns the Guard. policy, run_dir and the keyword arguments: as
    `gradbus.torch.Guard` (without names, process_group and scaler, which come from the engine)."""
    check_version(_version())
    if policy == "rerun":
        raise ValueError(
            "gradbus.deepspeed: policy 'rerun' needs a training loop that recomputes the update from the same "
            "batch, and engine.step() has none (hint: policy 'skip' or 'abort')"
        )
    for k in ("names", "params", "process_group", "scaler"):
        if k in kwargs:
            raise TypeError(f"gradbus.deepspeed.guard: {k!r} comes from the engine; do not pass it")
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(engine, DeepSpeedEngine):
        raise TypeError(f"gradbus.deepspeed.guard: {type(engine).__name__} is not a DeepSpeedEngine (hint: the first value deepspeed.initialize returns)")
    if getattr(engine, "_gradbus_guard", None) is not None:
        raise RuntimeError("gradbus.deepspeed.guard: this engine is guarded already")
    opt = engine.optimizer
    if not isinstance(opt, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)):
        _refuse(
            f"the engine's optimizer {type(opt).__name__} (ZeRO stage {engine.zero_optimization_stage()})",
            "the guard reads the gradients in the ZeRO optimizers' reduce (hint: ZeRO stage 1, 2 or 3; with bf16 "
            "and ZeRO 1, DeepSpeed picks BF16_Optimizer when data_types.grad_accum_dtype is fp32)",
        )
    for cfg in (engine.zero_offload_optimizer(), engine.zero_offload_param()):
        if cfg is not None and cfg.device != "none":
            _refuse(f"ZeRO offload to {cfg.device}", "not tested (hint: keep the optimizer state and parameters on the device)")
    if engine.zero_quantized_gradients() or engine.zero_quantized_weights():
        _refuse("ZeRO++ quantized gradients or weights", "not tested (hint: zero_quantized_gradients and zero_quantized_weights off)")
    import torch.distributed as dist

    if engine.has_moe_layers or dist.get_world_size(opt.dp_process_group) != dist.get_world_size():
        _refuse(
            "model parallelism (pipeline, tensor, sequence or expert)",
            "the guard's exchange runs over the data-parallel group, so ranks of other data-parallel groups "
            "would not share the verdict (hint: data parallelism only, see docs/deepspeed.md)",
        )
    stage3 = isinstance(opt, DeepSpeedZeroOptimizer_Stage3)
    if stage3 and kwargs.get("replica_every"):
        _refuse(
            "replica_every with ZeRO 3",
            "each rank holds only its partition of the weights, so there are no replicas to compare "
            "(hint: ZeRO 1 or 2, where every rank holds the whole model)",
        )
    g = Guard(engine, policy, run_dir, **kwargs)
    _wrap_reduce(opt, g, stage3)
    _wrap_step(opt, g)
    backward = engine.backward

    def judged_backward(loss: Any, *a: Any, **kw: Any) -> Any:
        g._backward(loss)
        return backward(loss, *a, **kw)

    engine.backward = judged_backward
    engine._gradbus_guard = g
    return g


def _wrap_reduce(opt: Any, g: Guard, stage3: bool) -> None:
    if stage3:
        name = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"
        reduce = getattr(opt, name)
        from deepspeed.accelerator import get_accelerator

        def guarded_reduce(comm_dtype: torch.dtype) -> None:
            bucket = opt.ipg_buckets[comm_dtype]
            if bucket.params:
                # The gradients were copied into the bucket on reduce_and_partition_stream, where the
                # reduce-scatter runs after this returns (and which DeepSpeed synchronizes at the end
                # of every backward, before the exchange reads the cells).
                with get_accelerator().stream(opt.reduce_and_partition_stream):
                    g._check_bucket([p.grad for p in bucket.params], [g.name(p, f"ds_id{p.ds_id}") for p in bucket.params])
            reduce(comm_dtype)

        setattr(opt, name, guarded_reduce)
        return
    from deepspeed.runtime.torch_autocast import sort_dtypes

    reduce = opt.reduce_ipg_grads

    def guarded_reduce_ipg_grads(comm_dtype: Any = None) -> None:
        # The dtypes, in the order, that reduce_ipg_grads reduces.
        for dt in [comm_dtype] if comm_dtype is not None else sort_dtypes(opt.ipg_buckets.keys()):
            bucket = opt.ipg_buckets[dt]
            if bucket.params:
                names = [g.name(opt.bit16_groups[i][j], f"group{i}.param{j}") for i, j, _ in bucket.params]
                g._check_bucket(list(bucket.grads), names)
        reduce(comm_dtype)

    opt.reduce_ipg_grads = guarded_reduce_ipg_grads


def _wrap_step(opt: Any, g: Guard) -> None:
    step = opt.step
    update_scale = opt._update_scale

    def guarded_step(*a: Any, **kw: Any) -> Any:
        v = g._verdict()  # raises NonFiniteGradients on abort, on every rank
        g._skip = None if v.proceeded else v
        try:
            out = step(*a, **kw)
            g.stepped()  # the replica check's own check (sdc): the weights as this step wrote them
            return out
        finally:
            g._skip = None

    def guarded_update_scale(has_overflow: bool = False) -> None:
        v = g._skip
        if v is None:
            return update_scale(has_overflow)
        # The guard's skip, on every rank: DeepSpeed's overflow path follows (no update, skipped_steps,
        # the LR schedule held). The scaler moves only for an overflow, as DeepSpeed moves it alone.
        opt.overflow = True
        if v.overflow or has_overflow:
            update_scale(True)

    opt.step = guarded_step
    opt._update_scale = guarded_update_scale
