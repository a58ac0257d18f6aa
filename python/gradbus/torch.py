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

At the last bucket the rank's row (its cells, loss, loss scale, replica checksum) becomes its
contribution to the runtime's O(buckets) agreement summary (`collectives/src/agreement.rs`), which
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
below `min_scale`, or past the skip fraction of the window, aborts. With `replica_every=N`, every
N-th update each rank also hashes its parameters on their device; ranks whose hash differs from rank
0's stop every rank with `ReplicasDiverged`.

Invariants: the hook never changes a gradient (nor a compressed bucket beyond DDP's own hook); the
optimizer (weights, moments, step count) and the scaler are touched only as a run without the guard
would touch them on "proceed" and on a loss-scale skip; every rank issues the same collectives in the
same order (one all-reduce per bucket, two per backward, and an all-gather on every rank or none).
"""

import collections
import json
import logging
import os
import struct
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from gradbus import _core

log = logging.getLogger("gradbus")

POLICIES = ("abort", "skip", "rerun")
AGREEMENTS = ("auto", "summary", "table")


class NonFiniteGradients(RuntimeError):
    """Every rank agreed to abort on non-finite gradients; the same on every rank.

    `report` is the runtime's report (a dict: step, minibatch, attempt, verdict, cause, ranks,
    bucket, param, element, nan, inf, per_rank, loss_finite, classification, format, crc32c);
    `path` is where rank 0 wrote it as JSON, or None without a run_dir.
    """

    def __init__(self, message: str, report: Dict[str, Any], path: Optional[str]):
        super().__init__(message)
        self.report = report
        self.path = path


class ReplicasDiverged(RuntimeError):
    """The replica check found parameters that differ between ranks; the same on every rank.

    `report` is a dict: step, attempt, ranks (those whose checksum differs from rank 0's), checksums
    (every rank's, hex); `path` is where rank 0 wrote it (run_dir/replicas.json), or None.
    """

    def __init__(self, message: str, report: Dict[str, Any], path: Optional[str]):
        super().__init__(message)
        self.report = report
        self.path = path


@dataclass
class Verdict:
    """The agreed verdict on one update, the same on every rank."""

    action: str
    """"proceed", "skip", "rerun" or "abort"."""
    report: Optional[Dict[str, Any]]
    """The report when some gradient was non-finite (or a rerun came back finite)."""
    spike: Optional[str]
    """A loss or gradient-norm spike, described, when spike detection is on and flagged one."""
    step: int
    attempt: int
    loss_scale: Optional[float] = None
    """The loss scale of the update (None without a GradScaler)."""
    loss: Optional[float] = None
    """The ranks' mean loss (of the losses given to `backward`/`set_loss`; 0.0 for a rank without)."""

    @property
    def proceeded(self) -> bool:
        return self.action == "proceed"

    @property
    def overflow(self) -> bool:
        """A loss-scale overflow the GradScaler skips (and lowers its scale for)."""
        return self.action == "skip" and self.report is not None and self.report.get("classification") == "loss-scale"


def _where(path: Optional[str]) -> str:
    return f"report {path}" if path else "no run_dir: report not written"


def describe(report: Dict[str, Any], path: Optional[str], loss_scale: Optional[float] = None) -> str:
    """One line about a non-finite report, the same on every rank. `path`: where an abort's report
    was written (a skip's report stays in `Guard.skips`; a rerun's in the verdict)."""
    r = report
    if r["verdict"] == "proceed":  # a rerun that came back finite
        return (f"gradbus: step {r['step']}: the recomputation (attempt {r['attempt']}) is finite: "
                f"a {r['classification']} fault; proceeding with it")
    where = {"abort": f"; {_where(path)}", "skip": "; report in guard.skips"}.get(r["verdict"], "")
    cls = f" ({r['classification']})" if r.get("classification") else ""
    scale = "" if loss_scale is None else f"; loss scale {loss_scale:g}"
    return (
        f"gradbus: non-finite gradients at step {r['step']} (attempt {r['attempt']}): rank(s) {r['ranks']}, "
        f"bucket #{r['bucket']}, param {r['param']} element {r['element']}, {r['nan']} NaN, {r['inf']} Inf, "
        f"loss {'finite' if r['loss_finite'] else 'NON-FINITE'}{scale}; verdict {r['verdict']}{cls}{where}"
    )


def _torch_health(x: torch.Tensor) -> torch.Tensor:
    """The bucket's health with torch ops on its own device and in its own dtype: float64
    [nan, inf, sumsq, first_bad] (first_bad -1: none), the fields of the Rust scan. Counts and
    first_bad are exact. The sum of squares is one fused reduction (float32 accumulation, float64
    for a float64 bucket) over every element: NaN or Inf when some element is not finite (the Rust
    scan sums the finite ones only) or when the squares overflow float32. It only feeds spike
    detection, which runs only on finite updates, never the finite/non-finite decision."""
    x = x.reshape(-1)
    finite = torch.isfinite(x)
    nbad = x.numel() - finite.sum()
    nan = torch.isnan(x).sum()
    # argmin returns the first minimal index: the first non-finite element when there is one.
    first = torch.where(nbad > 0, finite.view(torch.uint8).argmin(), torch.full((), -1, device=x.device))
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    sumsq = torch.linalg.vector_norm(x, dtype=acc).double().square()
    return torch.stack([nan.double(), (nbad - nan).double(), sumsq, first.double()])


_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _i64(x: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _torch_checksum(p: torch.Tensor, chunk: int = 1 << 22) -> int:
    """A 64-bit checksum of one tensor's bits with torch ops on its device: the wrapping sum over its
    elements of splitmix64(bits ^ index * golden). A change to any one element always changes it
    (each term is a bijection of the element's bits at its index); other changes collide with
    probability ~2^-64. `chunk` bounds the int64 temporaries; only the result reaches the host."""
    flat = p.detach().reshape(-1)
    bits = flat.view(_INT[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for s in range(0, flat.numel(), chunk):
        v = bits[s : s + chunk].to(torch.int64)
        x = v ^ (torch.arange(s, s + v.numel(), device=v.device, dtype=torch.int64) * _GOLDEN)
        x = x ^ _shr(x, 30)
        x = x * _MIX1
        x = x ^ _shr(x, 27)
        x = x * _MIX2
        x = x ^ _shr(x, 31)
        total += x.sum()
    return int(total.item()) & ((1 << 64) - 1)


def replica_checksum(params: List[torch.Tensor]) -> int:
    """A 64-bit checksum of the parameters, each hashed on its device: float32 CPU tensors
    by the runtime's own replica checksum (Rust, in place, memory speed), others - CUDA, other
    dtypes - by `_torch_checksum`; the per-parameter hashes folded in order through splitmix64's
    bijective finaliser. Every rank must hold each parameter on the same kind of device (as DDP
    runs them), or the hashes differ."""
    h = 0
    mask = (1 << 64) - 1
    for p in params:
        t = p.detach()
        if t.device.type == "cpu" and t.dtype == torch.float32:
            t = t.contiguous()  # a no-op for a parameter; `t` stays referenced during the call
            hp = _core.checksum_f32(t.data_ptr(), t.numel())
        else:
            hp = _torch_checksum(t)
        h = (h ^ hp) * 0xBF58476D1CE4E5B9 & mask
        h ^= h >> 31
    return h


def _as_bytes(t: torch.Tensor) -> bytes:
    """An int64 tensor's words as little-endian bytes (on the host; exact: tolist of int64)."""
    words = t.cpu().tolist()
    return struct.pack(f"<{len(words)}q", *words)


class Guard:
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
        on their device; a mismatch raises `ReplicasDiverged` on every rank.
    agreement: "auto" (the runtime's cost model picks, for this world size and bucket count, the
        cheaper of the two below, as `gradbus run` does: the table for small jobs, the summary at
        scale), "summary" (the O(buckets) summary; the table only on an anomaly) or "table" (the
        per-rank table on every update). The verdicts and reports are the same on every path.
    """

    def __init__(
        self,
        policy: str = "abort",
        names: Any = None,
        run_dir: Optional[str] = None,
        process_group: Any = None,
        *,
        max_consecutive: int = 3,
        max_fraction: float = 0.1,
        window: int = 100,
        spike: Optional[str] = None,
        scan: str = "auto",
        scaler: Any = None,
        min_scale: float = 1.0,
        replica_every: int = 0,
        agreement: str = "auto",
    ):
        if policy not in POLICIES:
            raise ValueError(f"gradbus.torch.Guard: policy {policy!r}: expected one of {POLICIES}")
        if scan not in ("auto", "torch"):
            raise ValueError(f"gradbus.torch.Guard: scan {scan!r}: expected 'auto' or 'torch'")
        if agreement not in AGREEMENTS:
            raise ValueError(f"gradbus.torch.Guard: agreement {agreement!r}: expected one of {AGREEMENTS}")
        if not isinstance(replica_every, int) or replica_every < 0:
            raise ValueError(f"gradbus.torch.Guard: replica_every {replica_every!r}: expected a whole number >= 0 (0: off)")
        if scaler is not None and not hasattr(scaler, "get_scale"):
            raise ValueError(f"gradbus.torch.Guard: scaler {scaler!r} is not a torch.amp.GradScaler")
        if scaler is not None and not scaler.is_enabled():
            scaler = None  # GradScaler(enabled=False) scales nothing: the guard works as without it
        if scaler is not None and policy == "rerun":
            raise ValueError(
                "gradbus.torch.Guard: policy 'rerun' with a GradScaler: an overflow recomputed at the same "
                "loss scale overflows again (hint: policy 'skip' or 'abort'; the scaler's overflows are skipped either way)"
            )
        self.policy = policy
        self.run_dir = None if run_dir is None else os.fspath(run_dir)
        self.process_group = process_group
        self._agreement = _core.Agreement(policy, max_consecutive, max_fraction, window, spike, min_scale=min_scale)
        self._scan = scan
        self._params = self._names(names)
        if replica_every and not self._params:
            raise ValueError(
                "gradbus.torch.Guard: replica_every needs the parameters to hash (hint: pass names=model)"
            )
        self.scaler = scaler
        self.replica_every = replica_every
        self.agreement = agreement
        self.step = 0
        """Updates judged so far (skipped ones included): the step of the next report (assign your
        own step number before a backward to label reports with it)."""
        self.attempt = 0
        """0, or 1 while a rerun of the current update is due."""
        self.buckets = 0
        """DDP buckets in the last backward."""
        self.last: Optional[Verdict] = None
        self.skips: Deque[Verdict] = collections.deque(maxlen=1024)
        """The most recent skipped updates' verdicts, with their reports (oldest first)."""
        self.tabled = 0
        """Updates whose verdict needed the full per-rank table (an anomaly, or the table path)."""
        self.path: Optional[str] = None
        """The agreement path of the last update: "table" or "summary" (see `agreement`)."""
        self._cells: Dict[int, Any] = {}
        self._layout: Dict[int, List[Tuple[str, int]]] = {}
        self._loss: Any = None
        self._pending: Any = None
        self._verdicts = 0

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

    # --- called by the user ------------------------------------------------------------------------

    def set_loss(self, loss: Any) -> None:
        """This rank's loss for the update being computed, judged with the gradients (call before
        backward; `backward` does it). With a scaler: the unscaled loss."""
        self._loss = loss

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`set_loss(loss)` then `loss.backward(**kwargs)` (with a scaler: `scaler.scale(loss).backward()`)."""
        self.set_loss(loss)
        (loss if self.scaler is None else self.scaler.scale(loss)).backward(**kwargs)

    def attempts(self) -> Iterator[int]:
        """Iterate over the attempts of one update: yields 0, and 1 again when the verdict asked for
        a rerun (policy "rerun"). The body must compute the update and call `verdict()` (or the
        guarded optimizer's `step()`) once."""
        while True:
            before = self._verdicts
            yield self.attempt
            if self._verdicts == before:
                raise RuntimeError(
                    "gradbus.torch.Guard.attempts: the attempt ended without a verdict "
                    "(hint: call opt.step() of the GuardedOptimizer, or guard.verdict(), in the loop body)"
                )
            if self.last is None or self.last.action != "rerun":
                return

    def verdict(self) -> Verdict:
        """Wait for this backward's agreement and decide; the same on every rank. Raises
        `NonFiniteGradients` on abort and `ReplicasDiverged` on a replica mismatch (on every rank;
        rank 0 writes the report into run_dir)."""
        if self._pending is None:
            raise RuntimeError(
                "gradbus.torch.Guard.verdict: no gradients were exchanged since the last verdict "
                "(hint: backward through the DDP model after ddp.register_comm_hook(guard, gradbus.torch.allreduce_hook))"
            )
        d = self._finish(self._pending)
        self._pending = None
        if d.action == "diverged":
            return self._diverged(d)
        report = None if d.report is None else json.loads(d.report)
        scale = d.loss_scale if d.loss_scale > 0 else None
        v = Verdict(d.action, report, d.spike, self.step, self.attempt, scale, d.loss)
        self.last = v
        self._verdicts += 1
        if d.action == "rerun":
            self.attempt += 1
        else:
            self.step += 1
            self.attempt = 0
        if d.action == "abort":
            path = self._write("report.json", d.report)
            raise NonFiniteGradients(describe(report, path, scale), report, path)
        if d.action == "skip":
            self.skips.append(v)
        if report is not None:
            # A loss-scale overflow is the scaler's routine business: recorded, logged quietly.
            (log.info if v.overflow else log.warning)("%s", describe(report, None, scale))
        if d.spike is not None:
            log.warning("gradbus: step %d: %s%s", v.step, d.spike, "; skipped" if d.action == "skip" else "")
        return v

    @property
    def skipped(self) -> int:
        """Updates skipped so far (the same on every rank)."""
        return self._agreement.skipped

    @property
    def suspects(self) -> List[int]:
        """Ranks classified suspect after a transient fault (policy "rerun")."""
        return self._agreement.suspects

    # --- called by the hook, and by the framework adapters (gradbus.megatron, gradbus.fsdp) ------------

    def health(self, flat: torch.Tensor) -> Any:
        """The local health of one flat gradient buffer, read in place (no copy): the Rust scan's
        (nan, inf, sumsq, first_bad) for contiguous float32 CPU memory, else the same four fields as a
        float64 tensor computed with torch ops on the buffer's device (any dtype, CUDA included).
        The caller guarantees that nothing writes `flat` during the call (a framework hands the buffer
        over before its reduction starts)."""
        if self._scan == "auto" and flat.device.type == "cpu" and flat.dtype == torch.float32 and flat.is_contiguous():
            # Zero-copy: the Rust scan reads the buffer's memory in place. `flat` is a live reference
            # for the whole call, contiguous float32 on the CPU, and not written meanwhile (see above).
            nan, inf, sumsq, first = _core.scan_f32(flat.data_ptr(), flat.numel())
            return (float(nan), float(inf), sumsq, -1.0 if first is None else float(first))
        return _torch_health(flat)

    def record(self, index: int, entries: List[Tuple[str, int]], cell: Any) -> None:
        """Record bucket `index`'s local health `cell` (from `health`) and its layout `entries`, the
        (name, numel) of what it holds back to back; the same layout on every rank."""
        self._layout[index] = entries
        self._cells[index] = cell

    def exchange(self) -> None:
        """Start the table exchange over the buckets 0..n-1 recorded since the last verdict (the DDP
        hook does it at DDP's last bucket; an adapter whose framework has no such moment calls it
        before `verdict`)."""
        self._exchange(max(self._cells, default=-1))

    def _tally(self, bucket: dist.GradBucket, buf: Optional[torch.Tensor] = None) -> None:
        """Record the health of one bucket before its all-reduce (of `buf`, the tensor that is
        reduced, when it is not the bucket's buffer: a compressed copy) and its parameter layout."""
        buf = bucket.buffer() if buf is None else buf
        b = bucket.index()
        entries = []
        total = 0
        for j, p in enumerate(bucket.parameters()):
            known = self._params.get(id(p))
            entries.append((known[1] if known is not None else f"bucket{b}.param{j}", p.numel()))
            total += p.numel()
        if total != buf.numel():
            raise RuntimeError(
                f"gradbus: DDP bucket #{b} holds {buf.numel()} elements but its parameters {total} "
                "(hint: sparse gradients are not supported by the gradbus hook)"
            )
        # DDP calls the hook after autograd has written every gradient in the bucket, and does not
        # write the bucket until the hook returns.
        self.record(b, entries, self.health(buf))

    def _row(self, n: int) -> bytes:
        """This rank's row: `CELL` float64 per bucket, its loss, its loss scale, its replica checksum
        (`gradbus._core`'s layout). Device tallies come to the host in one copy."""
        cells = [self._cells[b] for b in range(n)]
        on_device = [c for c in cells if isinstance(c, torch.Tensor)]
        moved = iter(torch.stack(on_device).cpu().tolist()) if on_device else iter(())
        flat: List[float] = []
        for c in cells:
            flat.extend(next(moved) if isinstance(c, torch.Tensor) else c)
        loss = 0.0 if self._loss is None else float(self._loss.detach() if isinstance(self._loss, torch.Tensor) else self._loss)
        scale = 0.0 if self.scaler is None else float(self.scaler.get_scale())
        replica = 0
        if self.replica_every and self.attempt == 0 and self.step % self.replica_every == 0:
            replica = replica_checksum([p for p, _ in self._params.values()])
        return struct.pack(f"<{len(flat) + 2}dQ", *flat, loss, scale, replica)

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.process_group) == "nccl" else torch.device("cpu")

    def _gather(self, row: bytes, async_op: bool) -> Tuple[Any, List[torch.Tensor]]:
        """All-gather every rank's row (int64 words: the bits travel unchanged)."""
        t = torch.frombuffer(bytearray(row), dtype=torch.int64).to(self._device())
        outs = [torch.empty_like(t) for _ in range(dist.get_world_size(self.process_group))]
        return dist.all_gather(outs, t, group=self.process_group, async_op=async_op), outs

    def _exchange(self, last: int) -> None:
        """At the last bucket: start the agreement's collectives (the summary's two all-reduces, or
        the table's all-gather)."""
        if self._pending is not None:
            raise RuntimeError(
                "gradbus.torch.Guard: a second backward before the verdict on the first "
                "(hint: call opt.step() or guard.verdict() after every backward; gradient accumulation "
                "runs its inner steps under ddp.no_sync())"
            )
        n = last + 1
        if sorted(self._cells) != list(range(n)):
            raise RuntimeError(f"gradbus: buckets {sorted(self._cells)} seen before the last bucket #{last}")
        row = self._row(n)
        layout = [self._layout[b] for b in range(n)]
        world = dist.get_world_size(self.process_group)
        path = _core.cheaper_path(world, n) if self.agreement == "auto" else self.agreement
        self.path = path
        if path == "table":
            work, outs = self._gather(row, async_op=True)
            self._pending = ("table", [work], outs, row, layout, world)
        else:
            pg, dev = self.process_group, self._device()
            parts = [torch.frombuffer(bytearray(w), dtype=torch.int64).to(dev) for w in _core.contribute(row, n)]
            works = [
                dist.all_reduce(parts[0], op=dist.ReduceOp.SUM, group=pg, async_op=True),
                dist.all_reduce(parts[1], op=dist.ReduceOp.MAX, group=pg, async_op=True),
            ]
            self._pending = ("summary", works, parts, row, layout, world)
        self.buckets = n
        self._cells, self._layout, self._loss = {}, {}, None

    def _finish(self, pending: Any) -> Any:
        """Wait for the agreement's collectives and decide; on an anomaly of the summary, gather the
        table (every rank sees the same summary, so every rank gathers)."""
        mode, works, parts, row, layout, world = pending
        for w in works:
            w.wait()
        if mode == "summary":
            d = self._agreement.decide_summary(_as_bytes(parts[0]), _as_bytes(parts[1]), world, layout, self.step, self.attempt)
            if d is not None:
                return d
            _, parts = self._gather(row, async_op=False)
        self.tabled += 1
        table = b"".join(_as_bytes(t) for t in parts)
        return self._agreement.decide_table(table, world, layout, self.step, self.attempt)

    def _diverged(self, d: Any) -> Verdict:
        report = {
            "step": self.step,
            "attempt": self.attempt,
            "ranks": list(d.diverged),
            "checksums": [f"{c:016x}" for c in d.replicas],
        }
        path = self._write("replicas.json", json.dumps(report))
        raise ReplicasDiverged(
            f"gradbus: replicas differ at step {self.step}: rank(s) {report['ranks']} hold parameters that differ "
            f"from rank 0's (checksums {report['checksums']}); {_where(path)}",
            report,
            path,
        )

    def _write(self, name: str, text: Optional[str]) -> Optional[str]:
        """Rank 0 writes run_dir/name atomically; every rank returns the same path."""
        if self.run_dir is None or text is None:
            return None
        path = os.path.join(self.run_dir, name)
        if dist.get_rank(self.process_group) == 0:
            os.makedirs(self.run_dir, exist_ok=True)
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                f.write(text + "\n")
            os.replace(tmp, path)
        return path


def allreduce_hook(guard: Guard, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: tally the bucket's local health, then all-reduce it as DDP does
    without a hook (mean over ranks); at the last bucket, start the agreement.
    Register with `ddp.register_comm_hook(guard, gradbus.torch.allreduce_hook)`."""
    guard._tally(bucket)
    pg = guard.process_group
    buf = bucket.buffer()
    # Scale then sum, as DDP's built-in reduction does (a multiply by 1/world: the Python
    # default_hooks.allreduce_hook divides instead, which differs in the last bit when the world size
    # is not a power of two), so that a guarded clean run is bitwise the run without any hook.
    buf.mul_(1.0 / dist.get_world_size(pg))
    fut = dist.all_reduce(buf, group=pg, async_op=True).get_future().then(lambda f: f.value()[0])
    if bucket.is_last():
        guard._exchange(bucket.index())
    return fut


def _compress_hook(dtype: torch.dtype, guard: Guard, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's `default_hooks._compress_hook` with the guard: the same operations (cast, divide by the
    world size, all-reduce, copy back), so a clean run is bitwise DDP's compression hook; the cast
    bucket is scanned in its own dtype before the division."""
    pg = guard.process_group
    buffer = bucket.buffer()
    compressed = buffer.to(dtype)
    guard._tally(bucket, compressed)
    compressed.div_(dist.get_world_size(pg))

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    fut = dist.all_reduce(compressed, group=pg, async_op=True).get_future().then(decompress)
    if bucket.is_last():
        guard._exchange(bucket.index())
    return fut


def fp16_compress_hook(guard: Guard, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's `fp16_compress_hook` guarded: register with
    `ddp.register_comm_hook(guard, gradbus.torch.fp16_compress_hook)`. A gradient beyond float16's
    range (65504) becomes Inf in the cast and is reported like any other."""
    return _compress_hook(torch.float16, guard, bucket)


def bf16_compress_hook(guard: Guard, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's `bf16_compress_hook` guarded: register with
    `ddp.register_comm_hook(guard, gradbus.torch.bf16_compress_hook)`."""
    return _compress_hook(torch.bfloat16, guard, bucket)


def apply_verdict(v: Verdict, scaler: Any, run: Callable[[], None]) -> bool:
    """The optimizer step as the agreed verdict `v` says; True when `run()` ran. `run` is the step:
    with a GradScaler one that calls `scaler.step` and `scaler.update`, as a script without the guard
    does. Without a scaler it runs on "proceed" only. With one it runs on "proceed" and on a
    loss-scale overflow (the scaler skips the overflow and lowers its scale); on another skip (a
    spike) there is no step, the scale stays, and any unscale_() of this iteration is forgotten, as
    update() does."""
    if scaler is None:
        if v.proceeded:
            run()
        return v.proceeded
    if not (v.proceeded or v.overflow):
        scaler.update(new_scale=scaler.get_scale())
        return False
    before = scaler.get_scale()
    run()
    after = scaler.get_scale()
    if v.proceeded and after < before or v.overflow and scaler.get_backoff_factor() < 1 and not after < before:
        raise RuntimeError(
            f"gradbus: the guard's verdict {v.action!r} and the GradScaler disagree (scale {before:g} -> {after:g}) "
            "(hint: the guard's scaler must be the one whose scale() the loss went through: use guard.backward(loss))"
        )
    return True


class GuardedOptimizer:
    """An optimizer whose `step()` first takes the guard's verdict and steps only on "proceed":
    on "skip" and "rerun" the weights and the optimizer's state (moments, step count) stay untouched
    on every rank. With the guard's GradScaler, "proceed" and a loss-scale overflow run
    `scaler.step(optimizer)` and `scaler.update()` exactly as a script without the guard does (the
    scaler skips the overflow and lowers its scale); another skip (a spike) leaves the scale as it
    is. Other attributes are the wrapped optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, guard: Guard):
        self.optimizer = optimizer
        self.guard = guard

    def step(self, closure: Any = None) -> Verdict:
        scaler = self.guard.scaler
        if scaler is not None and closure is not None:
            raise RuntimeError("gradbus.torch.GuardedOptimizer.step: a closure with a GradScaler (torch.amp.GradScaler.step does not support closures either)")
        v = self.guard.verdict()
        args = () if closure is None else (closure,)

        def run() -> None:
            if scaler is None:
                self.optimizer.step(*args)
            else:
                scaler.step(self.optimizer, *args)
                scaler.update()

        apply_verdict(v, scaler, run)
        return v

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)
