"""The gradbus guard as a PyTorch DistributedDataParallel communication hook.

    guard = gradbus.torch.Guard(policy="skip", names=model, run_dir="runs/job")
    ddp.register_comm_hook(guard, gradbus.torch.allreduce_hook)
    opt = gradbus.torch.GuardedOptimizer(torch.optim.AdamW(ddp.parameters()), guard)
    ...
    guard.backward(loss)        # or loss.backward(): the loss is then not judged
    opt.step()                  # runs the optimizer only when every rank agreed to proceed

Per bucket, the hook tallies the rank's OWN gradients before they are reduced (CPU float32 buckets:
the runtime's fused Rust scan, in place on the bucket's memory; other buckets - CUDA, float16,
bfloat16, float64 - torch ops on the bucket's device and in the bucket's own dtype; four numbers per
bucket), then starts the bucket's all-reduce as DDP does without a hook (scale by 1/world, sum), so a
clean run is bitwise plain DDP. `fp16_compress_hook` / `bf16_compress_hook` do the same with DDP's
compression (the compressed bucket is what is scanned, so a value the cast overflows is caught).

On the scan path (the default where a healthy update needs no per-rank values: `Guard.scans`) that
is all the hook adds: the verdict scans the reduced sums that the all-reduces left in the buckets,
which are the same on every rank and finite only when every rank's gradients were (NaN and Inf
survive a sum), so the scan is the agreed verdict with no collective of the guard's; on an anomaly
every rank all-gathers the rows, and the table names the rank, bucket, parameter and element. (With
DDP's `gradient_as_bucket_view=True` the gradients are the buckets: what the script does to them
between backward and the step - clipping, `unscale_` - is what the verdict reads, on every rank
alike.)

Elsewhere, at the last bucket the rank's row (its cells, loss, loss scale, replica checksum) rides
the last bucket's all-reduce (2 ranks) or becomes its contribution to the runtime's O(buckets)
agreement summary (`collectives/src/agreement/`), which
two small all-reduces (SUM, MAX of int64 words) combine. `Guard.verdict()` (called by
`GuardedOptimizer.step`) waits for them and decides from the summary when it shows nothing wrong;
otherwise every rank all-gathers the rows and decides from the full table, which names the rank,
bucket, parameter and element (`agreement="table"` gathers it on every update, as before). Both paths
run the runtime's `decide` on data that is bitwise the same on every rank, with the same history, so
every rank reaches the same verdict with no broadcast: proceed, skip (bounded), rerun, or abort,
which raises the same `NonFiniteGradients` on every rank and has rank 0 write `run_dir/report.json`
(the runtime's `Report`, same schema).

With a `torch.amp.GradScaler` (fp16), a non-finite update is the scaler's: skipped on every rank,
the scale lowered, the skip recorded with its report (`Guard.skips`); an overflow at a scale at or
below `min_scale`, or past the skip fraction of the window, aborts.

Silent data corruption (docs/pytorch.md): with `replica_every=N`, every N-th update each rank also
hashes its parameters on their device (and right after its previous step, its own check); with
`sdc=True`, every update each rank hashes every reduced bucket as its all-reduce returned it and as
its optimizer consumes it (the latter rides the next update's row), and tallies every bucket's
peak for the runtime's outlier rule. The runtime's rules (`collectives/src/sdc.rs`) name the damaged
ranks and a donor: `GuardedOptimizer` copies the donor's weights and optimizer state into them and
the update is recomputed ("repair"); with no healthy copy to tell, every rank raises
`ReplicasDiverged`. An outlier is rerun, then judged by the policy (`OutlierGradients` on abort).

The guard's core (the row, the exchange, the decision, the reports, `GuardedOptimizer`) is
`gradbus.guard`, shared with the other adapters; this module is DDP's side of it.

Invariants: the hook never changes a gradient (nor a compressed bucket beyond DDP's own hook); the
optimizer (weights, moments, step count) and the scaler are touched only as a run without the guard
would touch them on "proceed" and on a loss-scale skip; every rank issues the same collectives in the
same order (one all-reduce per bucket, two per backward, and an all-gather on every rank or none).
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from gradbus import _core  # also gradbus.torch._core: the native core, as before
from gradbus.guard import (  # noqa: F401  (the public names of gradbus.torch, defined in the core)
    AGREEMENTS,
    POLICIES,
    Cell,
    GuardCore,
    GuardedOptimizer,
    NonFiniteGradients,
    OverflowAhead,
    OutlierGradients,
    ReplicasDiverged,
    Row,
    Verdict,
    _on_host,
    _torch_checksum,
    _torch_health,
    apply_verdict,
    describe,
    quarantined,
    health_f32,
    peak,
    replica_checksum,
)


_FINITE = (0.0, 0.0, 0.0, -1.0)
"""A finite reduced sum's cell on the scan path: the judge's neutral reduced health (what the other
paths give every bucket), where only its finiteness was checked."""


@dataclass
class _Bucket:
    """One DDP bucket as `Guard._tally_bucket` learnt it (per bucket buffer)."""

    buffer: torch.Tensor
    data_ptr: int
    numel: int
    entries: List[Tuple[str, int]]
    """(name, numel) of the parameters back to back: the layout the reports name."""
    params: List[torch.Tensor]
    in_place: bool
    """Whether the scan reads the scanned tensor in place (contiguous float32 on the CPU, scan "auto")."""
    sum_in_place: bool
    """Whether `Guard.reduced_sums` reads the bucket's buffer in place (as `in_place`; with a
    compression hook the buffer is not the tensor scanned before the all-reduce)."""


class Guard(GuardCore):
    """Validates every rank's gradients inside DDP's all-reduce and agrees on one verdict.

    policy: "abort" | "skip" | "rerun" (as the runtime's `policy` key).
    names: the model (its `named_parameters()`; a DDP wrapper is looked through) or a dict
        name -> parameter, so that reports name the parameter; without it, "bucketB.paramJ".
    run_dir: where rank 0 writes report.json on abort (created when missing).
    process_group: the DDP process group (None: the default group).
    max_consecutive, max_fraction, window: the skip policy's bounds (the runtime's defaults);
        max_fraction and window also bound a GradScaler's overflow skips.
    spike: None, "warn" or "skip": the runtime's spike detectors on the agreed mean loss and on the
        gradient norm (sqrt of the ranks' summed local squared norms / world, unscaled); "skip"
        skips a spike.
    scan: "auto" (Rust scan for CPU float32 buckets, torch ops otherwise) or "torch" (always torch ops).
    scaler: a `torch.amp.GradScaler` (fp16 mixed precision): non-finite updates are its overflows
        (see the module doc); `backward` scales the loss with it and `GuardedOptimizer.step` runs
        `scaler.step` and `scaler.update`. Not with policy "rerun" (an overflow recurs at the same scale).
    min_scale: the loss scale floor: an overflow at a scale at or below it aborts (1.0, as DeepSpeed's
        `min_loss_scale` and Megatron's `--min-loss-scale`).
    replica_every: every N-th update (0: never) each rank hashes its parameters (those of `names`)
        on their device; a damaged replica is repaired from a healthy one (with `GuardedOptimizer`),
        or raises `ReplicasDiverged` on every rank when none can be told healthy.
    sdc: the silent-data-corruption checks on every update: the reduced buckets identical across
        ranks (checked one update late) and the runtime's outlier rule on each rank's local
        gradients (rerun, then the policy). Needs `names`; reruns and repairs need the
        `attempts()` loop.
    agreement: "auto" (the scan path where nothing needs every rank's row on a healthy update:
        each rank's verdict scans the reduced sums, the rows are all-gathered only on an anomaly,
        no collective of the guard's (`Guard.scans`); elsewhere at 2 ranks the rows ride the last
        bucket's all-reduce, and at more the runtime's cost model picks, for this world size and
        bucket count, the cheaper of the two below, as `gradbus run` does: the table for small jobs,
        the summary at scale), "ride" (the rows ride the last bucket's all-reduce on every update),
        "summary" (the O(buckets) summary; the table only on an anomaly) or "table" (the per-rank
        table on every update). The verdicts and reports are the same on every path.
    watch_policy: what a watched quantity (`watch`) forecast to reach its ceiling does: "warn" (a
        line in run_dir/warnings.jsonl and the log) or "stop" (also: past the stop threshold, call
        `on_stop` and raise `OverflowAhead` on every rank before the optimizer step).
    on_stop: the save a stop calls on every rank (the framework's own checkpoint; its return value
        is `OverflowAhead.checkpoint`).
    """

    RIDES = True
    SCANS = True
    SDC = True

    def __init__(self, policy: str = "abort", names: Any = None, run_dir: Optional[str] = None, process_group: Any = None, **kwargs: Any):
        super().__init__(policy, self._names(names), run_dir, process_group, **kwargs)
        # bucket index -> what `_tally_bucket` learns once per bucket buffer (`_Bucket`).
        self._bucket_layouts: Dict[int, _Bucket] = {}
        # sdc: the checksums of what each bucket's all-reduce returned (taken in its future's
        # callback), and what the next row carries.
        self._returned: Dict[int, int] = {}
        self._consumed: Optional[List[int]] = None
        self._hashed: Optional[Tuple[List[int], int]] = None
        # The hook's fast path on the scan path's healthy updates (`_core.ScanPath`, set by a
        # verdict when the next update takes the scan path with every bucket scanned in place).
        self._fast: Optional[_core.ScanPath] = None

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        super().backward(loss, **kwargs)
        if self.sdc and self._pending is not None:
            # DDP has written the reduced gradients (a backward that ran the hook: not under
            # no_sync), and nothing else has touched them yet (clipping, unscale_ come later).
            self._hashed = self._bucket_hashes(own_check=True)

    def verdict(self) -> Verdict:
        fast = self._fast
        if fast is not None:
            if fast.healthy():
                # Every bucket of this update took the hook's fast path and every reduced sum is
                # finite (`reduced_sums`' healthy answer); the tallies stay native. `_fast` stays:
                # the next update takes the scan path too (nothing that `scans` reads has changed:
                # the step matters only with `replica_every`, and no quantity can start being
                # watched after the first exchange).
                self.path = "scan"  # after a rerun's attempt on another path
                return self._proceeded_clean()
            self._leave_fast()
        hashed, self._hashed = self._hashed, None
        v = super().verdict()
        if self.sdc:
            self._consumed = None
            if v.proceeded:
                # Without guard.backward, hashed now (after whatever the script did to the
                # gradients, the same on every rank), and without the own check.
                self._consumed, state = hashed if hashed is not None else self._bucket_hashes(own_check=False)
                self._state |= state
        if not self.replica_every and self.scans():
            self._fast = self._scan_path()
        return v

    def _scan_path(self) -> Optional[_core.ScanPath]:
        """The hook's fast path for the next updates (`_core.ScanPath`): DDP's buckets as learnt,
        when every one is scanned, pre-divided and summed in place (`_Bucket.in_place`,
        `sum_in_place`); else None."""
        layouts = self._bucket_layouts
        known = [layouts.get(b) for b in range(self.buckets)]
        if not known or not all(k is not None and k.in_place and k.sum_in_place for k in known):
            return None
        # The addresses read from the very tensors the ScanPath holds (which keep them alive).
        bufs = [k.buffer for k in known]
        return _core.ScanPath(bufs, [t.data_ptr() for t in bufs], [t.numel() for t in bufs], 1.0 / self.world)

    def _leave_fast(self) -> None:
        """The general path takes over from the hook's fast path (a bucket not as learnt, a sum that
        is not finite, a backward or a verdict out of turn): the update's tallies so far become its
        records, and an update all of whose buckets were tallied is left as `scan_sums` leaves it."""
        fast, self._fast = self._fast, None
        cells = fast.take()
        for b, cell in enumerate(cells):
            self.record(b, self._bucket_layouts[b].entries, cell)
        if len(cells) == fast.buckets:
            self.scan_sums(len(cells))

    def _bucket_hashes(self, own_check: bool) -> Tuple[List[int], int]:
        """With `sdc`: each bucket's reduced gradients hashed as DDP wrote them (the parameters'
        .grad, in the bucket's order), which every rank's must match (they ride the next row), and
        with `own_check` this rank's own finding: the first bucket whose hash differs from what its
        all-reduce returned (`StateFault.consumed`'s word, 0: none)."""
        hashes, state = [], 0
        for b in range(self.buckets):
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._bucket_layouts[b].params]
            h = replica_checksum(grads)
            if own_check and not state and h != self._returned.get(b):
                state = 2 | b << 8  # StateFault.consumed, bucket b
            hashes.append(h)
        return hashes, state

    def _returned_sum(self, b: int, flat: torch.Tensor) -> None:
        """With `sdc`: the checksum of what bucket `b`'s all-reduce returned (`flat`, the bucket's
        parameters back to back), as `_bucket_hashes` hashes the gradients."""
        if not self.sdc:
            return
        numels = [p.numel() for p in self._bucket_layouts[b].params]
        if flat.device.type == "cpu" and flat.dtype == torch.float32 and flat.is_contiguous():
            # Each parameter's part of `flat` by its address (`flat` stays referenced meanwhile).
            base, ptrs = flat.data_ptr(), []
            for n in numels:
                ptrs.append(base)
                base += 4 * n
            self._returned[b] = _core.checksum_f32_fold(ptrs, numels)
        else:
            views, o = [], 0
            for n in numels:
                views.append(flat[o : o + n])
                o += n
            self._returned[b] = replica_checksum(views)

    def _row(self, n: int) -> Row:
        row = super()._row(n)
        if self.sdc:
            # Compared bucket by bucket: dropped when DDP has rebuilt its buckets into another count
            # since (every rank alike: DDP rebuilds them the same way everywhere, once, early).
            if self._consumed is not None and len(self._consumed) == n:
                row.reduced = self._consumed
            self._consumed = None
        return row

    def rides(self, world: int) -> bool:
        """Whether the rows ride the last bucket's all-reduce (no collective of the guard's): with
        `agreement="ride"`, and with "auto" at 2 ranks, where a sum's order of additions cannot
        change a bit (a + b = b + a). At 3 ranks and more an all-reduce's order of additions may
        depend on its length (gloo's and NCCL's rings cut it in chunks), so the appended rows could
        change the gradients' last bits against plain DDP: "auto" takes the cost model's path there."""
        return self.agreement == "ride" or self.agreement == "auto" and world == 2

    @staticmethod
    def _names(names: Any) -> Dict[int, Tuple[torch.Tensor, str]]:
        if names is None:
            return {}
        if isinstance(names, torch.nn.parallel.DistributedDataParallel):
            names = names.module
        items = names.named_parameters() if isinstance(names, torch.nn.Module) else names.items()
        # Keyed by identity: DDP's GradBucket.parameters() returns the model's Parameter objects.
        # The parameter is kept with its name so that the id cannot be reused by another object.
        return {id(p): (p, n) for n, p in items}

    def _tally_bucket(
        self, bucket: dist.GradBucket, b: int, own: torch.Tensor, buf: Optional[torch.Tensor] = None, scale: Optional[float] = None
    ) -> None:
        """Record the health of bucket `b` (`bucket.index()`, whose buffer is `own`) before its
        all-reduce (of `buf`, the tensor that is reduced, when it is not the bucket's buffer: a
        compressed copy) and its parameter layout; with `scale`, then multiply the bucket's buffer
        by it in place (the hook's pre-division: in the scan's own pass where the scan reads the
        buffer in place, the same product as `mul_(scale)`)."""
        known = self._bucket_layouts.get(b)
        if known is None or known.data_ptr != own.data_ptr() or known.numel != own.numel():
            if b == 0:
                # DDP reduces its buckets in index order and reallocates every buffer when it
                # rebuilds them: forget the old ones (and stop holding their memory).
                self._bucket_layouts.clear()
            known = self._bucket_layouts[b] = self._learn_bucket(bucket, b, own, own if buf is None else buf)
        buf = own if buf is None else buf
        # DDP calls the hook after autograd has written every gradient in the bucket, and does not
        # write the bucket until the hook returns.
        top = peak(buf, self._scan) if self.sdc else None
        if scale is None:
            cell = health_f32(buf) if known.in_place else self.health(buf)
        elif known.in_place:
            # health_f32's cell, then `buf.mul_(scale)`'s products, in one pass over the memory.
            cell = _core.scale_scan_f32(buf.data_ptr(), buf.numel(), scale)
        else:
            cell = self.health(buf)
            buf.mul_(scale)
        self.record(b, known.entries, cell, top)

    def _learn_bucket(self, bucket: dist.GradBucket, b: int, own: torch.Tensor, buf: torch.Tensor) -> "_Bucket":
        """What a bucket's layout is, learnt once per bucket buffer: DDP allocates new buffers when
        it rebuilds its buckets (once, early), and keeps a bucket's parameters, dtype and device for
        the buffer's life. The buffer is held (`_Bucket.buffer`), so that its address is not reused
        by another while it is the key."""
        params = bucket.parameters()
        entries = []
        for j, p in enumerate(params):
            named = self._params.get(id(p))
            entries.append((named[1] if named is not None else f"bucket{b}.param{j}", p.numel()))
        total = sum(n for _, n in entries)
        if total != buf.numel():
            raise RuntimeError(
                f"gradbus: DDP bucket #{b} holds {buf.numel()} elements but its parameters {total} "
                "(hint: sparse gradients are not supported by the gradbus hook)"
            )
        # Whether the scans read the tensor in place (`health`'s first case).
        def in_place(t: torch.Tensor) -> bool:
            return self._scan == "auto" and t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()

        return _Bucket(own, own.data_ptr(), own.numel(), entries, params, in_place(buf), in_place(own))

    def reduced_sums(self, n: int) -> Optional[List[Cell]]:
        """The health of buckets 0..n-1's reduced sums: None when they are all finite (the healthy
        update), else every bucket's cell. Read from the buckets' buffers, which hold the sums once
        backward has returned (the all-reduce sums in place; a compression hook copies the cast
        sum back into the buffer) - with `gradient_as_bucket_view=True` the buffers are the
        gradients, as the script has left them by the verdict (clipping, `unscale_`). Read on the
        verdict's thread rather than in each all-reduce's callback, which runs on the collective's
        thread and must take the GIL from it."""
        cells, layouts, on_device = [], self._bucket_layouts, False
        for b in range(n):
            known = layouts[b]
            if not known.sum_in_place:
                cells.append(self.health(known.buffer))
                on_device = True
            elif _core.finite_f32(known.data_ptr, known.numel):
                # Its health matters only when it is not finite (then it names a sum that overflowed).
                cells.append(_FINITE)
            else:
                cells.append(health_f32(known.buffer))
        if not on_device and cells.count(_FINITE) == n:
            return None
        cells = _on_host(cells) if on_device else cells
        return None if all(c[0] == 0 and c[1] == 0 for c in cells) else cells


def _value(f: torch.futures.Future) -> torch.Tensor:
    """An all-reduce future's tensor (what DDP takes from a hook's future)."""
    return f.value()[0]


def allreduce_hook(guard: Guard, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: tally the bucket's local health, then all-reduce it as DDP does
    without a hook (mean over ranks); on the scan path (`Guard.scans`) nothing else (the verdict
    scans the sums in the buckets); else at the last bucket start the agreement - or, where the rows ride it
    (`Guard.rides`), append every rank's row to the last bucket's all-reduce. On the scan path's
    healthy updates after DDP's bucket rebuild, the tally is one native call (`Guard._fast`).
    Register with `ddp.register_comm_hook(guard, gradbus.torch.allreduce_hook)`."""
    buf = bucket.buffer()
    b = bucket.index()
    fast = guard._fast
    if fast is not None:
        if fast.tally(b, buf.data_ptr(), buf.numel()):
            # The scan path's healthy updates (`Guard._fast`): pre-divided and scanned in one pass,
            # tallied natively; all-reduced as below.
            return dist.all_reduce(buf, group=guard.process_group, async_op=True).get_future().then(_value)
        guard._leave_fast()
    pg = guard.process_group
    world = guard.world
    scans = guard.scans()
    in_place = scans or not (bucket.is_last() and guard.rides(world))
    # Scale then sum, as DDP's built-in reduction does (a multiply by 1/world: the Python
    # default_hooks.allreduce_hook divides instead, which differs in the last bit when the world size
    # is not a power of two), so that a guarded clean run is bitwise the run without any hook. In
    # place, the tally scales the bucket as it scans it.
    guard._tally_bucket(bucket, b, buf, scale=1.0 / world if in_place else None)

    def returned(t: torch.Tensor) -> torch.Tensor:
        if guard.sdc:
            guard._returned_sum(b, t)
        return t

    if in_place:
        fut = dist.all_reduce(buf, group=pg, async_op=True).get_future()
        # On the scan path the verdict reads the sum from the bucket (`Guard.reduced_sums`): the
        # callback is the one DDP's own hook has.
        fut = fut.then(_value if scans else lambda f: returned(f.value()[0]))
        if bucket.is_last():
            guard.scan_sums(b + 1) if scans else guard.exchange(b + 1)
        return fut
    n = buf.numel()
    flat = guard.ride_buffer(n + guard.ride_len(bucket.index() + 1, world, buf.dtype), buf.dtype, buf.device)
    torch.mul(buf, 1.0 / world, out=flat[:n])  # the same product, into the tensor the rows ride
    pending = guard.ride(bucket.index() + 1, flat[n:])
    work = dist.all_reduce(flat, group=pg, async_op=True)
    pending.works.append(work)
    # DDP copies the returned sum into the gradients (it is not the bucket's own buffer).
    return work.get_future().then(lambda f: returned(f.value()[0][:n]))


def _compress_hook(dtype: torch.dtype, guard: Guard, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's `default_hooks._compress_hook` with the guard: the same operations (cast, divide by the
    world size, all-reduce, copy back), so a clean run is bitwise DDP's compression hook; the cast
    bucket is scanned in its own dtype before the division. Where the rows ride the last bucket
    (`Guard.rides`), they follow the cast bucket in the same all-reduce."""
    pg = guard.process_group
    buffer = bucket.buffer()
    n = buffer.numel()
    world = guard.world
    scans = guard.scans()
    riding = not scans and bucket.is_last() and guard.rides(world)
    extra = guard.ride_len(bucket.index() + 1, world, dtype) if riding else 0
    flat = guard.ride_buffer(n + extra, dtype, buffer.device) if riding else torch.empty(n, dtype=dtype, device=buffer.device)
    compressed = flat[:n]
    compressed.copy_(buffer)  # the cast, as buffer.to(dtype)
    guard._tally_bucket(bucket, bucket.index(), buffer, compressed)
    compressed.div_(world)
    pending = guard.ride(bucket.index() + 1, flat[n:]) if riding else None

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        # The cast sum widened (Inf and NaN stay), where the scan path's verdict reads it.
        buffer.copy_(fut.value()[0][:n])
        guard._returned_sum(bucket.index(), buffer)
        return buffer

    work = dist.all_reduce(flat, group=pg, async_op=True)
    if pending is not None:
        pending.works.append(work)
    elif bucket.is_last():
        if scans:
            guard.scan_sums(bucket.index() + 1)
        else:
            guard.exchange(bucket.index() + 1)
    return work.get_future().then(decompress)


def fp16_compress_hook(guard: Guard, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's `fp16_compress_hook` guarded: register with
    `ddp.register_comm_hook(guard, gradbus.torch.fp16_compress_hook)`. A gradient beyond float16's
    range (65504) becomes Inf in the cast and is reported like any other."""
    return _compress_hook(torch.float16, guard, bucket)


def bf16_compress_hook(guard: Guard, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's `bf16_compress_hook` guarded: register with
    `ddp.register_comm_hook(guard, gradbus.torch.bf16_compress_hook)`."""
    return _compress_hook(torch.bfloat16, guard, bucket)
