"""The gradbus guard inside Megatron-core's DistributedDataParallel, in place of its `check_grads`.

    guard = gradbus.megatron.Guard(model, policy="skip", run_dir="runs/job")   # model: Megatron DDP (or the list of chunks)
    optimizer = gradbus.megatron.GuardedOptimizer(optimizer, guard)           # Megatron's optimizer
    ...                                                                       # Megatron's loop, unchanged

Megatron's DDP calls `check_grads` on each bucket group right before the group's all-reduce or
reduce-scatter (after the local gradients of every micro-batch are accumulated into its grad buffer,
before its scaling by 1/dp). Its own check takes one norm per bucket and raises on the rank that
sees a NaN ("found NaN in local grad norm for bucket #0", the seed's message) while the other ranks
block in the next collective. The guard replaces that method on every bucket group: it scans each
bucket's `grad_data` in place (Megatron's own buffer, no copy; float32 CPU buffers by the runtime's
Rust scan, other dtypes and CUDA buffers by torch ops on the device, in their own dtype) and records
the bucket's health and layout (Megatron's parameter names and offsets in the bucket, padding
included). `GuardedOptimizer.step()` exchanges every rank's table, runs the runtime's `decide`, and
steps Megatron's optimizer only on "proceed"; otherwise it returns Megatron's own answer for an
update not applied, `(False, None, None)`, so Megatron's loop counts a skipped iteration and leaves
the learning-rate schedule where it is, as after an fp16 overflow. "abort" raises the same
`gradbus.torch.NonFiniteGradients` on every rank (rank 0 writes run_dir/report.json), naming the
rank, Megatron's parameter name and the element.

Invariants: the guard never writes a gradient, so a clean run is bitwise Megatron's; every rank
issues the same collectives (Megatron's, plus one all-gather per update); the bucket numbering
(model chunk, then buffer, then Megatron's bucket order) and the layout are the same on every rank.
Megatron's `check_for_large_grads`, when configured, still runs (it is not fatal in Megatron).

Supported: megatron-core 0.16 to 0.19, data parallelism only (tensor, pipeline, context and expert
parallel sizes 1: the table is exchanged over the data-parallel group), fp32 and bf16. fp16 with
Megatron's loss scaler is refused: an overflow there is the scaler's business, and the guard does not
cooperate with the scaler yet.
"""

import functools
from importlib import metadata
from typing import Any, Dict, List, Tuple

from gradbus import guard as core
from gradbus.guard import BucketGuard, NonFiniteGradients, Verdict

__all__ = ["Guard", "GuardedOptimizer", "NonFiniteGradients", "Verdict", "SUPPORTED"]

SUPPORTED = ((0, 16), (0, 19))
"""The megatron-core (major, minor) range the adapter was written against, inclusive."""

PADDING = "(padding)"
"""Layout name of the alignment padding between parameters in a Megatron bucket (never written: zero)."""


def check_version(version: str) -> None:
    """Raise a clear error when `version` (megatron-core's) is outside `SUPPORTED`."""
    try:
        mm = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        mm = None
    lo, hi = SUPPORTED
    if mm is None or not lo <= mm <= hi:
        raise RuntimeError(
            f"gradbus.megatron: megatron-core {version} is not supported: the adapter replaces the "
            f"bucket groups' check_grads of megatron-core {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]} "
            "(hint: pip install 'megatron-core>=0.16,<0.20', or read docs/megatron.md on what a new "
            "version must keep)"
        )


def _version() -> str:
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        raise ImportError("gradbus.megatron: megatron-core is not installed (hint: pip install 'megatron-core>=0.16,<0.20')") from None


def _bucket_entries(buffer: Any, bucket: Any, names: Dict[Any, str]) -> List[Tuple[str, int]]:
    """(name, numel) of what `bucket.grad_data` holds back to back: its parameters at their offsets in
    Megatron's buffer (`param_index_map`, padded for the distributed optimizer; the bucket's own
    `param_to_index` is packed in 0.16), the alignment padding between them (and at the end) as
    `PADDING` entries."""
    spans = []
    for j, p in enumerate(bucket.params_list):
        start, end, _ = buffer.param_index_map[p]
        spans.append((start - bucket.offset, end - bucket.offset, names.get(p, f"bucket{bucket.bucket_id}.param{j}")))
    spans.sort()
    entries, at = [], 0
    for start, end, name in spans:
        if start < at:
            raise RuntimeError(f"gradbus.megatron: parameters overlap in a Megatron bucket at {name} (offset {start} < {at})")
        if start > at:
            entries.append((PADDING, start - at))
        entries.append((name, end - start))
        at = end
    total = bucket.grad_data.numel()
    if total < at:
        raise RuntimeError(f"gradbus.megatron: a Megatron bucket's grad_data holds {total} elements, its parameters reach {at}")
    if total > at:
        entries.append((PADDING, total - at))
    return entries


class Guard(BucketGuard):
    """The guard on Megatron-core DDP model chunks: replaces each bucket group's `check_grads`.

    model: a megatron.core.distributed.DistributedDataParallel, or the list of them (model chunks).
    policy, run_dir, and the keyword arguments: as `gradbus.torch.Guard`.
    """

    def __init__(self, model: Any, policy: str = "abort", run_dir: Any = None, **kwargs: Any):
        check_version(_version())
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        for c in chunks:
            missing = [a for a in ("bucket_groups", "buffers", "module", "ddp_config") if not hasattr(c, a)]
            if missing:
                raise TypeError(
                    f"gradbus.megatron.Guard: {type(c).__name__} has no {', '.join(missing)}: not a "
                    "megatron.core.distributed.DistributedDataParallel (hint: wrap the model in Megatron's DDP first)"
                )
        self._check_parallelism()
        groups = [g for c in chunks for g in c.bucket_groups + getattr(c, "expert_parallel_bucket_groups", [])]
        if not groups:
            raise ValueError("gradbus.megatron.Guard: the model has no gradient buckets (no parameter requires grad)")
        pg = getattr(groups[0], "data_parallel_group", None) or getattr(groups[0], "intra_distributed_optimizer_instance_group")
        # Bucket numbering and layout: model chunk, then buffer, then Megatron's bucket order.
        layouts: List[List[Tuple[str, int]]] = []
        self._index: Dict[int, int] = {}
        self._buckets = []  # kept: `_index` is keyed by their id()
        for k, c in enumerate(chunks):
            prefix = f"chunk{k}." if len(chunks) > 1 else ""
            names = {p: prefix + n for n, p in c.module.named_parameters()}
            for buf in c.buffers + getattr(c, "expert_parallel_buffers", []):
                for bucket in buf.buckets:
                    self._index[id(bucket)] = len(layouts)
                    self._buckets.append(bucket)
                    layouts.append(_bucket_entries(buf, bucket, names))
        super().__init__("gradbus.megatron", layouts, policy, run_dir, pg, **kwargs)
        for c in chunks:
            large = c.ddp_config.check_for_large_grads
            # start_grad_sync calls check_grads only when one of the two checks is configured; the
            # flag is read nowhere else in Megatron's DDP.
            c.ddp_config.check_for_nan_in_grad = True
            for g in c.bucket_groups + getattr(c, "expert_parallel_bucket_groups", []):
                if not callable(getattr(g, "check_grads", None)):
                    raise RuntimeError("gradbus.megatron: a Megatron bucket group has no check_grads (hint: see SUPPORTED)")
                g.check_grads = functools.partial(self._check_grads, g, g.check_grads, large)

    @staticmethod
    def _check_parallelism() -> None:
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return  # Megatron's DDP built on explicit process groups: the data-parallel group is all there is.
        sizes = {
            "tensor": ps.get_tensor_model_parallel_world_size(),
            "pipeline": ps.get_pipeline_model_parallel_world_size(),
            "context": ps.get_context_parallel_world_size(),
            "expert": ps.get_expert_model_parallel_world_size(),
        }
        other = {k: v for k, v in sizes.items() if v != 1}
        if other:
            raise NotImplementedError(
                f"gradbus.megatron: model parallelism {other} is not supported yet: the guard's table is "
                "exchanged over the data-parallel group, so ranks of other data-parallel groups would not "
                "share the verdict (hint: data parallelism only for now, see docs/megatron.md)"
            )

    def _check_grads(self, group: Any, megatron_check: Any, large: bool, check_for_nan_or_inf: bool, check_for_large: bool) -> None:
        """The replacement of `group.check_grads`: record every bucket's local health, in place."""
        for bucket in group.buckets:
            # Megatron reads and writes grad_data only after check_grads returns (scaling, then the
            # collective); autograd has accumulated every micro-batch into it before.
            self.check(self._index[id(bucket)], self.health(bucket.grad_data))
        if large and check_for_large:
            megatron_check(check_for_nan_or_inf=False, check_for_large=True)


class GuardedOptimizer(core.GuardedOptimizer):
    """Megatron's optimizer behind the guard's verdict (`gradbus.guard.GuardedOptimizer`, the one
    step-on-proceed of every adapter). `step()` returns Megatron's (update_successful, grad_norm,
    num_zeros_in_grad): the inner step's on "proceed", else (False, None, None) with the optimizer
    untouched (weights, moments, step count). Other attributes are the wrapped optimizer's."""

    def __init__(self, optimizer: Any, guard: Guard):
        scaler = getattr(optimizer, "grad_scaler", None)
        if scaler is not None:
            raise NotImplementedError(
                "gradbus.megatron: fp16 with Megatron's loss scaler is not supported yet (an overflow there "
                "is the scaler's business; the guard does not cooperate with it yet) (hint: bf16 or fp32)"
            )
        super().__init__(optimizer, guard)

    def _runner(self, *args: Any, **kwargs: Any) -> Any:
        return lambda: self.optimizer.step(*args, **kwargs)

    def _result(self, v: Verdict, out: Any) -> Any:
        return (False, None, None) if out is None else out
