"""The gradbus guard's framework-free core: per-bucket tallies, the per-rank row, the exchange, the
runtime's decision, the reports, and the optimizer step that obeys the verdict.

A framework adapter (`gradbus.torch` for DDP, `gradbus.fsdp`, `gradbus.megatron`, `gradbus.hf`, ...)
only says WHERE a rank's own gradients are before they are reduced and WHICH parameter sits at which
offset; everything else is here and in the native core (`gradbus._core`, the runtime's Rust code):

    adapter, per bucket:  cell = guard.health(flat)          # the bucket's local health, in place
                          guard.record(index, entries, cell) # with its layout [(name, numel), ...]
    adapter, once:        guard.exchange()                   # every bucket recorded: start the agreement
                                                             # (the DDP hook does it at the last bucket)
    user:                 v = GuardedOptimizer(opt, guard).step()   # verdict, then the step on "proceed"

The per-rank row (`Row`) is the one place that says what a rank tells the others about one update:
its cells (per bucket: NaN count, Inf count, sum of squares, first non-finite element), its loss,
its loss scale, its replica checksum, and for the silent-data-corruption checks its peaks, its own
finding about its state and the checksums of the reduced buckets it consumed at the previous update. `GuardCore._row` fills it; `Row.encode` hands it to the native
core, which encodes it with the runtime's one row codec (`collectives/src/wire.rs`). To carry a new
per-rank field: add it to `Row` (with its default), fill it in `GuardCore._row` (an adapter may
override `_row` and call the core's), and pass it through `_core.encode_row` / `_core.decode_row`
(`python/src/lib.rs`) into the codec's row (a per-rank float: a value of the agreement, by name).
Every rank's decoded row of the last gathered table is in `GuardCore.rows`.

Invariants: every rank issues the same collectives in the same order (the agreement's all-reduces or
all-gather, and an all-gather on every rank or none); every rank decides from bitwise-identical data
with the same history, so every rank reaches the same verdict without a broadcast; the guard never
writes a gradient, and the optimizer (weights, moments, step count) and a loss scaler are touched only
as a run without the guard would touch them on "proceed" and on a loss-scale overflow.
"""

import collections
import json
import logging
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from gradbus import _core

log = logging.getLogger("gradbus")

POLICIES = ("abort", "skip", "rerun")
WATCH_POLICIES = ("warn", "stop")
AGREEMENTS = ("auto", "summary", "table", "ride")

Layout = List[Tuple[str, int]]
"""One bucket's layout: the (name, numel) of what it holds back to back, the same on every rank."""


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
    """The replica check found state that differs between ranks and the guard cannot repair it; the
    same on every rank.

    `report` is a dict: step, attempt, ranks (the damaged ones, or every rank when none can be told
    healthy), donor (a healthy rank, or None), why (per rank of `ranks`: what differs), checksums
    (every rank's replica word, hex); `path` is where rank 0 wrote it (run_dir/replicas.json), or
    None.
    """

    def __init__(self, message: str, report: Dict[str, Any], path: Optional[str]):
        super().__init__(message)
        self.report = report
        self.path = path


class OverflowAhead(RuntimeError):
    """A watched quantity (`GuardCore.watch`) is forecast to reach its ceiling within the stop
    threshold: with `watch_policy="stop"`, every rank saved through `on_stop` and stopped BEFORE the
    update's optimizer step (the weights and the optimizer's state are those before it, finite and
    the same on every rank); the same on every rank.

    `update` is the update not taken (the guard's `step`), `warnings` its warnings.jsonl lines (dicts:
    update, quantity, value, limit, rank, forecast_updates, action), `checkpoint` what `on_stop`
    returned (None without it).
    """

    def __init__(self, message: str, update: int, warnings: List[Dict[str, Any]], checkpoint: Any):
        super().__init__(message)
        self.update = update
        self.warnings = warnings
        self.checkpoint = checkpoint


class OutlierGradients(RuntimeError):
    """The silent-data-corruption guard's outlier rule (`sdc=True`) flagged finite gradients of one
    rank many binades above the others' and its own history, again on the rerun, and the policy
    aborts; the same on every rank. `report` is the runtime's report (cause "outlier": rank, bucket,
    param, element of the largest value; classification "deterministic"); `path` is where rank 0
    wrote it (run_dir/report.json), or None."""

    def __init__(self, message: str, report: Dict[str, Any], path: Optional[str]):
        super().__init__(message)
        self.report = report
        self.path = path


@dataclass
class Verdict:
    """The agreed verdict on one update, the same on every rank."""

    action: str
    """"proceed", "skip", "rerun", "repair" (a damaged replica was repaired: recompute the update)
    or "abort"."""
    report: Optional[Dict[str, Any]]
    """The report when some gradient was non-finite (or a rerun came back finite)."""
    spike: Optional[str]
    """A loss or gradient-norm spike, described, when spike detection is on and flagged one."""
    step: int
    attempt: int
    loss_scale: Optional[float] = None
    """The loss scale of the update (None without a loss scaler)."""
    loss: Optional[float] = None
    """The ranks' mean loss (of the losses given to `backward`/`set_loss`; 0.0 for a rank without);
    None on an update the scan path decided healthy (`agreement`: the losses are not exchanged)."""
    finding: Optional[str] = None
    """The silent-data-corruption guard's finding, one line (a repair, an outlier), if any."""
    repair: Optional[Tuple[int, List[int]]] = None
    """"repair": (the donor rank, the damaged ranks): `GuardedOptimizer.step` copies the donor's
    weights and optimizer state into the damaged ranks; the update is then recomputed."""

    @property
    def proceeded(self) -> bool:
        return self.action == "proceed"

    @property
    def overflow(self) -> bool:
        """A loss-scale overflow the scaler skips (and lowers its scale for)."""
        return self.action == "skip" and self.report is not None and self.report.get("classification") == "loss-scale"


def _where(path: Optional[str]) -> str:
    return f"report {path}" if path else "no run_dir: report not written"


def describe(report: Dict[str, Any], path: Optional[str], loss_scale: Optional[float] = None) -> str:
    """One line about a non-finite report, the same on every rank. `path`: where an abort's report
    was written (a skip's report stays in `Guard.skips`; a rerun's in the verdict)."""
    r = report
    if r.get("cause") == "outlier":
        where = {"abort": f"; {_where(path)}", "skip": "; report in guard.skips"}.get(r["verdict"], "")
        return (f"gradbus: finite outlier gradients at step {r['step']} (attempt {r['attempt']}): rank(s) {r['ranks']}, "
                f"bucket #{r['bucket']}, largest value {r['param']} element {r['element']}; verdict {r['verdict']} "
                f"({r['classification']}){where}")
    if r["verdict"] == "proceed":  # a rerun that came back finite
        return (f"gradbus: step {r['step']}: the recomputation (attempt {r['attempt']}) is finite: "
                f"a {r['classification']} fault; proceeding with it")
    where = {"abort": f"; {_where(path)}", "skip": "; report in guard.skips"}.get(r["verdict"], "")
    cls = f" ({r['classification']})" if r.get("classification") else ""
    scale = "" if loss_scale is None else f"; loss scale {loss_scale:g}"
    named = {p["rank"]: p["samples"] for p in r.get("per_rank", []) if p.get("samples")}
    scale += "".join(f"; rank {k} samples {ids}" for k, ids in named.items())
    return (
        f"gradbus: non-finite gradients at step {r['step']} (attempt {r['attempt']}): rank(s) {r['ranks']}, "
        f"bucket #{r['bucket']}, param {r['param']} element {r['element']}, {r['nan']} NaN, {r['inf']} Inf, "
        f"loss {'finite' if r['loss_finite'] else 'NON-FINITE'}{scale}; verdict {r['verdict']}{cls}{where}"
    )


# --- the scans -------------------------------------------------------------------------------------

Cell = Any
"""One bucket's local health: (nan, inf, sumsq, first_bad) floats from the Rust scan, or the same
four fields as a float64 tensor on the bucket's device (torch ops); first_bad -1: none."""


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


_WIDEN = 1 << 20
"""Elements of a bf16/fp16 CPU buffer widened to float32 at a time for the Rust scan (4 MiB)."""


def health_f32(flat: torch.Tensor) -> Cell:
    """`health` of contiguous float32 CPU memory: the Rust scan reads it in place (zero-copy). The
    caller guarantees what `health` says: `flat` is a live reference for the whole call, contiguous
    float32 on the CPU, and not written meanwhile."""
    nan, inf, sumsq, first = _core.scan_f32(flat.data_ptr(), flat.numel())
    return (float(nan), float(inf), sumsq, -1.0 if first is None else float(first))


def health(flat: torch.Tensor, scan: str = "auto") -> Cell:
    """The local health of one flat gradient buffer: the Rust scan's (nan, inf, sumsq, first_bad)
    for contiguous float32 CPU memory with `scan` "auto" (read in place, no copy) and for contiguous
    bfloat16/float16 CPU memory (widened to float32 a chunk at a time: exact, NaN stays NaN and Inf
    Inf), else the same four fields as a float64 tensor computed with torch ops on the buffer's
    device (CUDA, float64, or `scan` "torch"). The caller guarantees that nothing writes `flat`
    during the call (a framework hands the buffer over before its reduction starts)."""
    if scan != "auto" or flat.device.type != "cpu" or not flat.is_contiguous():
        return _torch_health(flat)
    if flat.dtype == torch.float32:
        return health_f32(flat)
    if flat.dtype not in (torch.bfloat16, torch.float16):
        return _torch_health(flat)
    # torch's CPU ops are slow on half types: 3.16M bf16 elements took 101 ms with `_torch_health`
    # and 0.8 ms widened and Rust-scanned (AMD EPYC, one thread; DeepSpeed ZeRO bf16 buckets).
    nan = inf = 0
    sumsq, first = 0.0, None
    for s in range(0, flat.numel(), _WIDEN):
        chunk = flat[s : s + _WIDEN].float()  # a new contiguous float32 tensor, referenced during the scan
        n, i, q, f = _core.scan_f32(chunk.data_ptr(), chunk.numel())
        nan, inf, sumsq = nan + n, inf + i, sumsq + q
        if first is None and f is not None:
            first = s + f
    return (float(nan), float(inf), sumsq, -1.0 if first is None else float(first))


def peak(flat: torch.Tensor, scan: str = "auto") -> Optional[Tuple[float, int]]:
    """The largest finite |value| of a flat gradient buffer and its first index (None when empty):
    the kernels' own scan for contiguous float32 CPU memory with `scan` "auto" (in place; the
    caller guarantees, as for `health`, that nothing writes `flat` meanwhile), else torch ops on
    the buffer's device (non-finite values count as 0)."""
    if flat.numel() == 0:
        return None
    if scan == "auto" and flat.device.type == "cpu" and flat.is_contiguous() and flat.dtype == torch.float32:
        return _core.peak_f32(flat.data_ptr(), flat.numel())
    x = flat.detach().reshape(-1)
    a = torch.where(torch.isfinite(x), x.abs(), torch.zeros((), dtype=x.dtype, device=x.device))
    i = int(a.argmax())  # the first index of the largest value
    return (float(a[i]), i)


# --- the replica checksum --------------------------------------------------------------------------

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
    ts = [p.detach() for p in params]  # referenced during the native call
    if all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in ts):
        # The same fold in one native call (no Python step per tensor).
        return _core.checksum_f32_fold([t.data_ptr() for t in ts], [t.numel() for t in ts])
    h = 0
    mask = (1 << 64) - 1
    for t in ts:
        if t.device.type == "cpu" and t.dtype == torch.float32:
            t = t.contiguous()  # a no-op for a parameter; `t` stays referenced during the call
            hp = _core.checksum_f32(t.data_ptr(), t.numel())
        else:
            hp = _torch_checksum(t)
        h = (h ^ hp) * 0xBF58476D1CE4E5B9 & mask
        h ^= h >> 31
    return h


# --- the per-rank row ------------------------------------------------------------------------------


@dataclass
class Row:
    """What one rank tells the others about one update (see the module doc for how to add a field);
    its words are the runtime's row codec's (`collectives/src/wire.rs`)."""

    cells: List[Sequence[float]]
    """Per bucket: NaN count, Inf count, sum of squares, first non-finite element (-1: none)."""
    loss: float = 0.0
    """The rank's loss (0.0 without one)."""
    loss_scale: float = 0.0
    """The rank's loss scale (0.0: no loss scaler)."""
    replica: int = 0
    """The rank's replica checksum (0 on updates without a replica check)."""
    watched: List[float] = field(default_factory=list)
    """Per watched quantity (`GuardCore.watch`, in the order of `Watches.names`): the rank's largest
    value with its rank, as `_core.ranked` words (-inf: not watched this update)."""
    peaks: Optional[List[Optional[Tuple[float, int]]]] = None
    """Per bucket: the largest finite |value| and its offset (the outlier rule, `sdc`), or None."""
    state: int = 0
    """The rank's own finding about its state (the runtime's `StateFault` word; 0: nothing)."""
    reduced: Optional[List[int]] = None
    """Per bucket: the checksum of the reduced gradient the rank's optimizer consumed at the
    previous update (`sdc`; 0 or None: not checked)."""

    def encode(self) -> bytes:
        """The row's words (little-endian bytes) in the runtime's row codec
        (`collectives/src/wire.rs`, through `_core.encode_row`, which checks the counts)."""
        return _core.encode_row(self.cells, self.loss, self.loss_scale, self.replica, self.watched, self.peaks, self.state, self.reduced)

    @staticmethod
    def decode(data: bytes, buckets: int, watched: int = 0) -> "Row":
        """The row of `encode`'s bytes over `buckets` buckets and `watched` quantities."""
        return Row(*_core.decode_row(data, buckets, watched))

    @staticmethod
    def size(buckets: int, watched: int = 0) -> int:
        """Bytes of a row over `buckets` buckets and `watched` quantities."""
        return 8 * _core.row_words(buckets, watched)


def _as_bytes(t: torch.Tensor) -> bytes:
    """An int64 tensor's words as little-endian bytes (on the host; exact: tolist of int64)."""
    words = t.cpu().tolist()
    return struct.pack(f"<{len(words)}q", *words)


def _on_host(cells: List[Cell]) -> List[Sequence[float]]:
    """Health cells as host sequences: the device ones (`_torch_health`'s tensors) in one copy."""
    on_device = [c for c in cells if isinstance(c, torch.Tensor)]
    moved = iter(torch.stack(on_device).cpu().tolist()) if on_device else iter(())
    return [next(moved) if isinstance(c, torch.Tensor) else c for c in cells]


def _in_place(seg: torch.Tensor) -> bool:
    """Whether the native core reads and writes a ride segment in place: contiguous float32 or
    float64 on the CPU (16-bit chunks); others (CUDA, float16, bfloat16) go through torch ops."""
    return seg.device.type == "cpu" and seg.dtype in (torch.float32, torch.float64) and seg.is_contiguous()


def _unride(seg: torch.Tensor) -> torch.Tensor:
    """The int64 words of a summed ride segment (`GuardCore.ride`): every element is a 16-bit
    (float32, float64) or 8-bit (float16, bfloat16) chunk of the rows' little-endian bytes, exact."""
    c = seg.detach().to(torch.int32).cpu()
    wide = seg.dtype in (torch.float32, torch.float64)
    # int32 -> int16 keeps the low 16 bits (0..65535 -> the same bit pattern).
    return (c.to(torch.int16) if wide else c.to(torch.uint8)).view(torch.int64)


@dataclass
class _Pending:
    """The agreement of one update in flight (started by `exchange`, finished by `verdict`)."""

    path: str
    """"table" (one all-gather of the rows), "summary" (two all-reduces, the table on an anomaly) or
    "ride" (the rows ride an all-reduce the framework runs anyway: no collective of the guard's)."""
    works: List[Any]
    """The collectives' handles, waited for by `verdict`."""
    parts: List[torch.Tensor]
    """Their tensors: every rank's row (table), the summary's SUM and MAX words, or the ride segment."""
    row: bytes
    """This rank's row (the summary path gathers it on an anomaly)."""
    layout: List[Layout]
    """Every bucket's layout."""
    world: int
    watched: int = 0
    """Watched quantities in the row."""


_SCANNING = _Pending("scan", [], [], b"", [], 0)
"""The scan path's agreement in flight: nothing (every rank scans the reduced sums at the verdict,
and the update's records stay in place until then: the row is built only on an anomaly)."""


# --- the core --------------------------------------------------------------------------------------


class GuardCore:
    """The guard's core, framework-free: what a framework adapter records per bucket, the
    agreement, the verdict and the reports. Adapters (`gradbus.torch.Guard` for DDP, `BucketGuard`
    for frameworks with a fixed bucket list) subclass it and call `health`, `record` and `exchange`.

    policy: "abort" | "skip" | "rerun" (as the runtime's `policy` key).
    params: {id(parameter): (parameter, name)} of the parameters to hash for the replica check.
    run_dir: where rank 0 writes report.json on abort (created when missing).
    process_group: the process group of the exchange (None: the default group).
    max_consecutive, max_fraction, window, spike, scan, scaler, min_scale, replica_every, agreement:
        as `gradbus.torch.Guard` documents them.
    """

    RIDES = False
    """Whether the adapter can carry the rows on a gradient all-reduce of its framework (`ride`)."""
    SCANS = False
    """Whether the adapter all-reduces whole buckets, so that every rank holds the same reduced sums
    and their scan is an agreed verdict (the scan path, `scans`)."""
    SDC = False
    """Whether the adapter supports the silent-data-corruption checks (`sdc=True`: it hashes the
    reduced buckets its optimizer consumes, tallies peaks, and can repair a replica in place)."""

    def __init__(
        self,
        policy: str = "abort",
        params: Optional[Dict[int, Tuple[torch.Tensor, str]]] = None,
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
        watch_policy: str = "warn",
        on_stop: Optional[Callable[[], Any]] = None,
        sdc: bool = False,
    ):
        if policy not in POLICIES:
            raise ValueError(f"gradbus.torch.Guard: policy {policy!r}: expected one of {POLICIES}")
        if scan not in ("auto", "torch"):
            raise ValueError(f"gradbus.torch.Guard: scan {scan!r}: expected 'auto' or 'torch'")
        can = {"ride": self.RIDES}
        if agreement not in AGREEMENTS or not can.get(agreement, True):
            ok = tuple(a for a in AGREEMENTS if can.get(a, True))
            raise ValueError(f"gradbus.torch.Guard: agreement {agreement!r}: expected one of {ok}")
        if watch_policy not in WATCH_POLICIES:
            raise ValueError(f"gradbus.torch.Guard: watch_policy {watch_policy!r}: expected one of {WATCH_POLICIES}")
        if not isinstance(replica_every, int) or replica_every < 0:
            raise ValueError(f"gradbus.torch.Guard: replica_every {replica_every!r}: expected a whole number >= 0 (0: off)")
        if sdc and not self.SDC:
            raise ValueError(
                f"{type(self).__module__}.Guard: sdc=True is not supported by this adapter "
                "(hint: the silent-data-corruption checks are DDP's, gradbus.torch.Guard; see docs/pytorch.md)"
            )
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
        self._agreement = _core.Agreement(policy, max_consecutive, max_fraction, window, spike, min_scale=min_scale, outliers=sdc)
        self._scan = scan
        self._params = params or {}
        if (replica_every or sdc) and not self._params:
            raise ValueError(
                f"gradbus.torch.Guard: {'replica_every' if replica_every else 'sdc'} needs the parameters to hash "
                "(hint: pass names=model)"
            )
        self.scaler = scaler
        self.replica_every = replica_every
        self.sdc = sdc
        self._spike = spike
        self.agreement = agreement
        self.step = 0
        """Updates judged so far (skipped ones included): the step of the next report (assign your
        own step number before a backward to label reports with it)."""
        self.attempt = 0
        """0, or 1 while a rerun of the current update is due."""
        self.buckets = 0
        """Buckets in the last backward."""
        self.last: Optional[Verdict] = None
        self.skips: Deque[Verdict] = collections.deque(maxlen=1024)
        """The most recent skipped updates' verdicts, with their reports (oldest first)."""
        self.tabled = 0
        """Updates whose verdict needed the full per-rank table (an anomaly, or the table path)."""
        self.path: Optional[str] = None
        """The agreement path of the last update: "scan", "ride", "table" or "summary" (see `agreement`)."""
        self._rows: Optional[Tuple[List[bytes], int, int]] = None
        self._cells: Dict[int, Cell] = {}
        self._layout: Dict[int, Layout] = {}
        self._loss: Any = None
        self._pending: Optional[_Pending] = None
        self._last_layout: Optional[List[Layout]] = None
        self._world: Optional[int] = None
        self._rank: Optional[int] = None
        self._ride_buffer: Optional[torch.Tensor] = None
        self._verdicts = 0
        self.spikes = 0
        """Updates flagged as a loss or gradient-norm spike so far (`spike`), the same on every rank."""
        self.watch_policy = watch_policy
        self.on_stop = on_stop
        """Called on every rank before a stop (`watch_policy="stop"`), before the optimizer step: the
        framework's own save (what it returns is `OverflowAhead.checkpoint`)."""
        self.warnings: Deque[Dict[str, Any]] = collections.deque(maxlen=1024)
        """The most recent warnings.jsonl lines (dicts), the same on every rank (oldest first)."""
        self._watches = _core.Watches(stop=watch_policy == "stop")
        self._watching = False
        self._watched: Dict[str, torch.Tensor] = {}
        self._batches: List[Tuple[List[Any], Any]] = []
        self._exchanged = False
        self._kept = False
        self._stop_message = ""
        self._peaks: Dict[int, Optional[Tuple[float, int]]] = {}
        self._written: Optional[int] = None
        """The parameters' checksum right after the last optimizer step, when the next update
        checks the replicas (`stepped`): the rank's own check that its weights did not change."""
        self._state = 0
        """The rank's own finding about its state for its next row (`StateFault`'s word)."""
        self._optimizer: Any = None
        """The optimizer whose state a repair copies (set by `GuardedOptimizer`); without one a
        damaged replica stops the job (`ReplicasDiverged`)."""

    # --- called by the user ------------------------------------------------------------------------

    def set_loss(self, loss: Any) -> None:
        """This rank's loss for the update being computed, judged with the gradients (call before
        backward; `backward` does it). With a scaler: the unscaled loss."""
        self._loss = loss
        if self._batches and self._batches[-1][1] is None:
            self._batches[-1] = (self._batches[-1][0], loss)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`set_loss(loss)` then `loss.backward(**kwargs)` (with a scaler: `scaler.scale(loss).backward()`)."""
        self.set_loss(loss)
        (loss if self.scaler is None else self.scaler.scale(loss)).backward(**kwargs)

    def watch(self, name: str, x: torch.Tensor, limit: Optional[float] = None) -> None:
        """Watch `x` as the quantity `name` in this update: the guard keeps the largest element of
        every `x` given for `name` between two verdicts (so over a rank's tokens, and over the
        micro-batches of an accumulated update), agrees the largest over the ranks and which rank
        holds it, forecasts from its trend how many updates remain before it reaches `limit`, and
        warns or stops (`watch_policy`): a line in `run_dir/warnings.jsonl` (rank 0).

        `x`: the argument of an `exp` where it is evaluated (all positions: an Inf at a masked
        position still turns into NaN in the backward), or any quantity with a known ceiling; a
        NaN counts as past the ceiling. `limit`: the ceiling; by default ln of the largest finite
        value of x's dtype, where exp overflows: 88.72 for float32 and bfloat16, 11.09 for float16,
        709.78 for float64. Every rank must watch the same names from the first update on (they are
        fixed at the first exchange); a rank that has nothing for a name in an update simply does
        not call it then. The max is taken on x's device; one value per name reaches the host per
        update, with the gradients' tallies."""
        if not self._watches_name(name):
            if self._exchanged:
                raise RuntimeError(
                    f"gradbus: watch {name!r} first seen after the first update: the watched quantities travel in "
                    "every rank's row and are fixed at the first exchange (hint: watch it from the first update on, on every rank)"
                )
            dtype = str(x.dtype).replace("torch.", "")
            self._watches.add(name, float(limit) if limit is not None else _core.exp_ceiling(dtype))
            self._watching = True
        if x.numel() == 0:
            return
        m = x.detach().max()
        prev = self._watched.get(name)
        self._watched[name] = m if prev is None else torch.maximum(prev, m.to(prev.dtype))

    def _watches_name(self, name: str) -> bool:
        return name in self._watches.names

    def samples(self, ids: Sequence[Any]) -> None:
        """The sample ids (dataset indices, or prompt ids as str) of the micro-batch about to go
        through backward on this rank. When an update is aborted or skipped for non-finite
        gradients, its report names, per bad rank, the ids of the micro-batch that held the first
        non-finite value (the first micro-batch of the update with a non-finite loss; else every
        micro-batch of the update, when the loss stayed finite), and rank 0 appends them to
        `run_dir/quarantine.jsonl`, which `quarantined(run_dir)` reads back for a resume."""
        # Each id once, in the order first seen (a GRPO micro-batch holds a prompt's completions).
        self._batches.append((list(dict.fromkeys(i if isinstance(i, str) else int(i) for i in ids)), None))

    def attempts(self) -> Iterator[int]:
        """Iterate over the attempts of one update: yields 0, and again (1, 2...) while the verdict
        asks for the update to be recomputed: a rerun (policy "rerun", or an outlier with `sdc`) or a
        replica repair. The body must compute the update and call `verdict()` (or the guarded
        optimizer's `step()`) once."""
        while True:
            before = self._verdicts
            yield self.attempt
            if self._verdicts == before:
                raise RuntimeError(
                    "gradbus.torch.Guard.attempts: the attempt ended without a verdict "
                    "(hint: call opt.step() of the GuardedOptimizer, or guard.verdict(), in the loop body)"
                )
            if self.last is None or self.last.action not in ("rerun", "repair"):
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
        p, self._pending = self._pending, None
        d = self._finish(p)
        if d is None:
            return self._proceeded_clean()
        if d.action == "diverged" or d.action == "repair" and (not self.SDC or self._optimizer is None):
            return self._diverged(d)
        text = d.report if d.report is None else self._with_samples(d.report)
        self._batches = []
        report = None if text is None else json.loads(text)
        scale = d.loss_scale if d.loss_scale > 0 else None
        repair = (d.donor, list(d.diverged)) if d.action == "repair" else None
        v = Verdict(d.action, report, d.spike, self.step, self.attempt, scale, d.loss, d.finding, repair)
        alert = None if d.action in ("rerun", "repair") else self._observe(d.watched)
        self.last = v
        self._verdicts += 1
        if d.finding is not None:
            log.warning("gradbus: %s%s", d.finding, "" if repair is None else f" ({'; '.join(f'rank {k}: {w}' for k, w in zip(d.diverged, d.why))})")
        if repair is not None:
            self.repair(self._optimizer, repair)
        if d.action in ("rerun", "repair"):
            self.attempt += 1
        else:
            self.step += 1
            self.attempt = 0
        if report is not None and d.action in ("abort", "skip"):
            self._append("quarantine.jsonl", _core.quarantine_lines(text))
        if d.action == "abort":
            path = self._write("report.json", text)
            if report.get("cause") == "outlier":
                raise OutlierGradients(describe(report, path, scale), report, path)
            raise NonFiniteGradients(describe(report, path, scale), report, path)
        if alert == "stop":
            self._stop(v)
        if d.action == "skip":
            self.skips.append(v)
        if report is not None and d.finding is None:
            # A loss-scale overflow is the scaler's routine business: recorded, logged quietly.
            (log.info if v.overflow else log.warning)("%s", describe(report, None, scale))
        if d.spike is not None:
            self.spikes += 1
            log.warning("gradbus: step %d: %s%s", v.step, d.spike, "; skipped" if d.action == "skip" else "")
        return v

    def _proceeded_clean(self) -> Verdict:
        """The scan path's healthy update (every rank found the reduced sums finite; the agreement
        is no longer pending): proceed, recorded in the history as the table paths record a
        proceed, nothing to report (no loss: not exchanged); the update's records are cleared."""
        self._rows = None
        self._clear_records()
        self._agreement.proceed_clean()
        self._batches = []
        scale = None if self.scaler is None else float(self.scaler.get_scale())
        v = self.last = Verdict("proceed", None, None, self.step, self.attempt, scale)
        self._verdicts += 1
        self.step += 1
        return v

    @property
    def detections(self) -> int:
        """The silent-data-corruption guard's findings so far (repairs, replicas that differ,
        outliers; the same on every rank)."""
        return self._agreement.detections

    def stepped(self) -> None:
        """Called right after the optimizer step ran (`GuardedOptimizer.step` does): when the next
        update checks the replicas, hash the parameters as the step left them, so that the next
        update's read-back tells whether this rank's weights changed in between (its own check,
        which names the rank even at 2 ranks)."""
        if self.replica_every and self.step % self.replica_every == 0:
            self._written = replica_checksum([p for p, _ in self._params.values()])

    def repair(self, optimizer: Any, repair: Tuple[int, List[int]]) -> None:
        """Copy the donor rank's parameters and optimizer state (every tensor of `optimizer.state`,
        per parameter in `param_groups` order and key order) into every rank, on every rank (a
        "repair" verdict: `verdict` calls it with `GuardedOptimizer`'s optimizer): broadcasts over
        the process group. The update is then recomputed (`attempts`)."""
        donor, damaged = repair
        pg = self.process_group
        src = donor if pg is None else dist.get_global_rank(pg, donor)
        with torch.no_grad():
            for p, _ in self._params.values():
                dist.broadcast(p.data, src, group=pg)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    st = optimizer.state.get(p, {})
                    for k in sorted(st):
                        if torch.is_tensor(st[k]):
                            dist.broadcast(st[k], src, group=pg)
        self._written = None
        log.warning("gradbus: step %d: rank(s) %s repaired from rank %d (weights and optimizer state)", self.step, damaged, donor)

    @property
    def skipped(self) -> int:
        """Updates skipped so far (the same on every rank)."""
        return self._agreement.skipped

    @property
    def suspects(self) -> List[int]:
        """Ranks classified suspect after a transient fault (policy "rerun")."""
        return self._agreement.suspects

    @property
    def rows(self) -> Optional[List[Row]]:
        """Every rank's row of the last verdict's update, decoded, when its table was gathered (the
        table path, or an anomaly of the summary); None otherwise."""
        if self._rows is None:
            return None
        rows, buckets, watched = self._rows
        return [Row.decode(r, buckets, watched) for r in rows]

    @property
    def world(self) -> int:
        """The process group's size (asked once: it does not change)."""
        if self._world is None:
            self._world = dist.get_world_size(self.process_group)
        return self._world

    @property
    def rank(self) -> int:
        """This process's rank in the process group (asked once)."""
        if self._rank is None:
            self._rank = dist.get_rank(self.process_group)
        return self._rank

    # --- called by the adapters --------------------------------------------------------------------

    def health(self, flat: torch.Tensor) -> Cell:
        """`health(flat)` with this guard's scan setting (see the module function)."""
        return health(flat, self._scan)

    def record(self, index: int, entries: Layout, cell: Cell, peak: Optional[Tuple[float, int]] = None) -> None:
        """Record bucket `index`'s local health `cell` (from `health`), its layout `entries`, the
        (name, numel) of what it holds back to back (the same layout on every rank), and its peak
        (from `peak`; the outlier rule's, with `sdc`)."""
        self._layout[index] = entries
        self._cells[index] = cell
        if peak is not None:
            self._peaks[index] = peak

    def exchange(self, buckets: Optional[int] = None) -> None:
        """Start the agreement over the buckets 0..buckets-1 recorded since the last verdict (default:
        all recorded ones): the summary's two all-reduces or the table's all-gather. The DDP hook
        calls it at DDP's last bucket (unless the rows ride that bucket: `ride`); an adapter whose
        framework has no such moment, before `verdict`."""
        n, row, layout, world = self._begin(buckets)
        w = len(self._watches.names)
        path = _core.cheaper_path(world, n, w) if self.agreement == "auto" else self.agreement
        self.path = path
        if path == "table":
            work, outs = self._gather(row, async_op=True)
            self._pending = _Pending("table", [work], outs, row, layout, world, w)
        else:
            pg, dev = self.process_group, self._device()
            parts = [torch.frombuffer(bytearray(x), dtype=torch.int64).to(dev) for x in _core.contribute(row, n, w, self.rank)]
            works = [
                dist.all_reduce(parts[0], op=dist.ReduceOp.SUM, group=pg, async_op=True),
                dist.all_reduce(parts[1], op=dist.ReduceOp.MAX, group=pg, async_op=True),
            ]
            self._pending = _Pending("summary", works, parts, row, layout, world, w)

    def scans(self) -> bool:
        """Whether this update is decided from the reduced sums alone (the scan path, `agreement` "auto"):
        the adapter all-reduces whole buckets (pre-divided: a product by 1/world and a sum keep NaN
        and Inf), so the reduced buckets are finite on every rank if and only if every rank's input
        was finite and the sum did not overflow, and every rank holds the same sums: their scan is
        already the agreed verdict, with no collective of the guard's. The rows are all-gathered
        only on an anomaly, to name the ranks. Not when something needs every rank's row on a
        healthy update too: spike detection (the loss and norm), `sdc`, a watched quantity, a
        replica check due, or a rerun's attempt (its report compares with the first attempt's
        table). The same on every rank: all of these are."""
        return (
            self.SCANS
            and self.agreement == "auto"
            and self.attempt == 0
            and self._spike is None
            and not self.sdc
            and not self._watching
            and not (self.replica_every and self.step % self.replica_every == 0)
        )

    def scan_sums(self, buckets: int) -> None:
        """Start the scan path's agreement over buckets 0..buckets-1: nothing to send; `verdict`
        reads the reduced sums' health (`reduced_sums`), and builds and gathers the rows from the
        update's records only on an anomaly."""
        self.buckets = self._recorded(buckets)
        self._exchanged = True
        self.path = "scan"
        self._pending = _SCANNING

    def reduced_sums(self, n: int) -> Optional[List[Cell]]:
        """The scan path's health of buckets 0..n-1's reduced sums: None when they are all finite,
        else every bucket's cell (an adapter with `SCANS`)."""
        raise NotImplementedError(f"{type(self).__name__} has no scan path")

    def ride_len(self, buckets: int, world: int, dtype: torch.dtype) -> int:
        """Elements of `dtype` that every rank's row takes when it rides a bucket's all-reduce
        (`ride`): `world` slots of one row's words as small integers the dtype holds exactly -
        16-bit chunks in float32 and float64, 8-bit chunks in float16 and bfloat16."""
        words = _core.row_words(buckets, len(self._watches.names))
        return world * words * (4 if dtype in (torch.float32, torch.float64) else 8)

    def ride_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of `numel` elements for the all-reduce the rows ride, kept from one update to the
        next while its size, dtype and device stay (the framework has read the previous update's sum
        out of it by then: DDP before backward returns)."""
        b = self._ride_buffer
        if b is None or b.numel() != numel or b.dtype != dtype or b.device != device:
            b = self._ride_buffer = torch.empty(numel, dtype=dtype, device=device)
        return b

    def ride(self, buckets: int, out: torch.Tensor) -> _Pending:
        """Start the agreement over buckets 0..buckets-1 with every rank's row riding a sum
        all-reduce the caller runs anyway (the DDP hook: its last bucket's): fills `out`
        (`ride_len` elements of the bucket's dtype, on its device) with this rank's row as small
        integers in its own slot and zeros in the others', so the sum over ranks is every rank's row,
        exactly (x + 0 = x), whatever else the all-reduce sums. The caller appends the all-reduce's
        work to the returned record's `works`; `verdict` decodes `out` once it has completed. No
        collective of its own."""
        n, row, layout, world = self._begin(buckets)
        rank = self.rank
        if _in_place(out):
            # Rust writes the segment into `out`'s memory: a live contiguous CPU tensor that no
            # collective reads yet.
            _core.ride_fill(out.data_ptr(), out.numel(), out.element_size(), row, rank, world)
        else:
            wide = out.dtype in (torch.float32, torch.float64)
            chunks = torch.frombuffer(bytearray(row), dtype=torch.int16 if wide else torch.uint8)
            if wide:
                chunks = chunks.to(torch.int32) & 0xFFFF
            per = chunks.numel()
            if out.numel() != world * per:
                raise RuntimeError(f"gradbus: a ride segment of {out.numel()} elements for {world} rows of {per}")
            out.zero_()
            out[rank * per : (rank + 1) * per].copy_(chunks.to(out.dtype))
        self.path = "ride"
        self._pending = _Pending("ride", [], [out], row, layout, world, len(self._watches.names))
        return self._pending

    def _begin(self, buckets: Optional[int]) -> Tuple[int, bytes, List[Layout], int]:
        """The start of an agreement: (buckets, this rank's row, the layout, the world size); the
        update's records are cleared for the next backward."""
        n = self._recorded(buckets)
        row = self._row(n).encode()
        layout = [self._layout[b] for b in range(n)]
        if layout == self._last_layout:
            layout = self._last_layout  # the same object: the native core converts it once
        self._last_layout = layout
        self.buckets = n
        self._clear_records()
        self._exchanged = True
        return n, row, layout, self.world

    def _recorded(self, buckets: Optional[int]) -> int:
        """The number of buckets of the update whose agreement starts (`buckets`, default: all
        recorded ones), checked against the records: exactly buckets 0..n-1, and no agreement in
        flight."""
        if self._pending is not None:
            raise RuntimeError(
                "gradbus.torch.Guard: a second backward before the verdict on the first "
                "(hint: call opt.step() or guard.verdict() after every backward; gradient accumulation "
                "runs its inner steps under ddp.no_sync())"
            )
        cells = self._cells
        n = max(cells, default=-1) + 1 if buckets is None else buckets
        # Distinct indices >= 0, n of them, the largest n - 1: exactly 0..n-1.
        if len(cells) != n or n and max(cells) != n - 1:
            raise RuntimeError(f"gradbus: buckets {sorted(self._cells)} seen before the last bucket #{n - 1}")
        return n

    def _clear_records(self) -> None:
        """Forget the update's records (cells, layout, loss, watched maxima, peaks) for the next backward."""
        self._cells, self._layout, self._loss, self._watched, self._peaks = {}, {}, None, {}, {}

    # --- inside ------------------------------------------------------------------------------------

    def _row(self, n: int) -> Row:
        """This rank's row over buckets 0..n-1. Device tallies come to the host in one copy."""
        host = _on_host([self._cells[b] for b in range(n)])
        loss = 0.0 if self._loss is None else float(self._loss.detach() if isinstance(self._loss, torch.Tensor) else self._loss)
        scale = 0.0 if self.scaler is None else float(self.scaler.get_scale())
        replica = 0
        if self.replica_every and self.attempt == 0 and self.step % self.replica_every == 0:
            replica = replica_checksum([p for p, _ in self._params.values()])
            if self._written is not None and self._written != replica:
                self._state |= 1  # StateFault.weights: changed since this rank's optimizer step
        self._written = None
        state, self._state = self._state, 0
        peaks = [self._peaks.get(b) for b in range(n)] if self.sdc else None
        return Row(host, loss, scale, replica, self._watched_words(), peaks, state)

    def _watched_words(self) -> List[float]:
        """This rank's word per watched quantity (`_core.ranked` of its largest value; -inf when not
        watched this update). The device maxima come to the host in one copy."""
        names = self._watches.names
        if not names:
            return []
        got = [self._watched.get(n) for n in names]
        present = [m.double() for m in got if m is not None]
        moved = iter(torch.stack(present).cpu().tolist()) if present else iter(())
        return [_core.ranked(next(moved) if m is not None else float("-inf"), self.rank) for m in got]

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.process_group) == "nccl" else torch.device("cpu")

    def _gather(self, row: bytes, async_op: bool) -> Tuple[Any, List[torch.Tensor]]:
        """All-gather every rank's row (int64 words: the bits travel unchanged)."""
        t = torch.frombuffer(bytearray(row), dtype=torch.int64).to(self._device())
        outs = [torch.empty_like(t) for _ in range(self.world)]
        return dist.all_gather(outs, t, group=self.process_group, async_op=async_op), outs

    def _finish(self, p: _Pending) -> Any:
        """Wait for the agreement's collectives and decide; on an anomaly of the summary, gather the
        table (every rank sees the same summary, so every rank gathers). None: the scan path's
        healthy update (`_proceeded_clean`)."""
        for w in p.works:
            w.wait()
        parts = p.parts
        self._rows = None
        if p is _SCANNING:
            try:
                reduced = self.reduced_sums(self.buckets)
            except BaseException:
                self._clear_records()  # the next update starts from nothing, as after a verdict
                raise
            if reduced is None:
                return None  # the healthy update: `_proceeded_clean`
            # An anomaly, seen alike by every rank: every rank gathers the rows to name the ranks
            # (nothing is watched on the scan path: no watched words in the rows).
            n, row, layout, world = self._begin(self.buckets)
            _, gathered = self._gather(row, async_op=False)
            self.tabled += 1
            rows = [_as_bytes(t) for t in gathered]
            self._rows = (rows, n, 0)
            return self._agreement.decide_table(b"".join(rows), world, layout, self.step, self.attempt, 0, reduced=reduced)
        if p.path == "summary":
            d = self._agreement.decide_summary(
                _as_bytes(parts[0]), _as_bytes(parts[1]), p.world, p.layout, self.step, self.attempt, p.watched
            )
            if d is not None:
                return d
            _, parts = self._gather(p.row, async_op=False)
        self.tabled += 1
        if p.path == "ride":
            seg = parts[0]
            # The all-reduce has completed (DDP waited for it before backward returned; `works` too).
            table = _core.ride_rows(seg.data_ptr(), seg.numel(), seg.element_size()) if _in_place(seg) else _as_bytes(_unride(seg))
            size = len(table) // p.world
            rows = [table[k * size : (k + 1) * size] for k in range(p.world)]
        else:
            rows = [_as_bytes(t) for t in parts]
        self._rows = (rows, len(p.layout), p.watched)
        return self._agreement.decide_table(b"".join(rows), p.world, p.layout, self.step, self.attempt, p.watched)

    def _observe(self, words: List[float]) -> Optional[str]:
        """The watched quantities' agreed words of this update into their forecasts (`_core.Watches`):
        rank 0 appends the warnings to run_dir/warnings.jsonl, every rank logs them and keeps them in
        `warnings`; the action: None, "warn" or "stop" (the same on every rank)."""
        if not words:
            return None
        if not self._kept and self.run_dir is not None and self.rank == 0:
            # A resumed run keeps the warnings of the updates before it, as the runtime does.
            os.makedirs(self.run_dir, exist_ok=True)
            torn = _core.keep_warnings(os.path.join(self.run_dir, "warnings.jsonl"), self.step)
            if torn is not None:
                log.warning("gradbus: dropping the last line of warnings.jsonl, cut short by a crash: %s", torn)
        self._kept = True
        alert, out = self._watches.observe(self.step, list(words))
        self._append("warnings.jsonl", [line for line, _ in out])
        stops = []
        for line, message in out:
            w = json.loads(line)
            self.warnings.append(w)
            if w["action"] == "stop":
                stops.append(message)
            elif self.rank == 0:  # the same on every rank: logged once
                log.warning("%s", message)
        self._stop_message = "; ".join(stops)
        return alert

    def _stop(self, v: Verdict) -> None:
        """Stop every rank before the update `v` (the optimizer has not stepped): save through
        `on_stop`, then raise `OverflowAhead`, the same on every rank."""
        lines = [w for w in self.warnings if w["update"] == v.step]
        checkpoint = self.on_stop() if self.on_stop is not None else None
        saved = f"saved {checkpoint}" if checkpoint is not None else "nothing saved (no on_stop)"
        where = f"; warnings in {os.path.join(self.run_dir, 'warnings.jsonl')}" if self.run_dir else ""
        raise OverflowAhead(f"{self._stop_message}: every rank stopped, {saved}{where}", v.step, lines, checkpoint)

    def _with_samples(self, text: str) -> str:
        """The sealed report `text` with each bad rank's sample ids (see `samples`): every rank takes
        part in one all-gather of the ids (every rank has the same report, so every rank or none)."""
        mine: List[Any] = []
        for ids, loss in self._batches:
            if loss is not None and not bool(torch.isfinite(torch.as_tensor(loss)).all()):
                mine = ids
                break
        else:
            mine = [i for ids, _ in self._batches for i in ids]
        every: List[Any] = [None] * self.world
        dist.all_gather_object(every, mine, group=self.process_group)
        return _core.report_with_samples(text, {k: ids for k, ids in enumerate(every) if ids})

    def _diverged(self, d: Any) -> Verdict:
        report = {
            "step": self.step,
            "attempt": self.attempt,
            "ranks": list(d.diverged),
            "donor": d.donor,
            "why": list(d.why),
            "checksums": [f"{c:016x}" for c in d.replicas],
        }
        path = self._write("replicas.json", json.dumps(report))
        healthy = (f"rank {d.donor} holds a healthy copy, but this adapter cannot repair in place"
                   if d.donor is not None else "no rank can be told healthy (no majority, and no rank found its own state changed)")
        why = "; ".join(f"rank {k}: {w}" for k, w in zip(d.diverged, d.why))
        raise ReplicasDiverged(
            f"gradbus: replicas differ at step {self.step}: rank(s) {report['ranks']} hold state that differs "
            f"({why}); {healthy}; {_where(path)}",
            report,
            path,
        )

    def _append(self, name: str, lines: List[str]) -> None:
        """Rank 0 appends `lines` to run_dir/name (a JSON-lines artifact), each with its newline."""
        if self.run_dir is None or not lines or self.rank != 0:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, name), "a") as f:
            f.write("".join(line + "\n" for line in lines))

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


class BucketGuard(GuardCore):
    """The core over a fixed list of buckets, `layouts[b]` = [(name, numel), ...] for b = 0..n-1, that
    a framework hands over one by one before reducing them, with no "last bucket" moment of its own
    (Megatron's bucket groups, FSDP2's reduce-scatters): the agreement starts when the verdict is
    asked for. A verdict requires every bucket to have been checked since the previous one (else it
    raises, naming the buckets, before any collective, on every rank alike when the ranks run the
    same program)."""

    def __init__(self, framework: str, layouts: List[Layout], policy: str, run_dir: Any, process_group: Any, **kwargs: Any):
        super().__init__(policy, None, run_dir, process_group, **kwargs)
        self.framework = framework
        self.layouts = layouts
        self._seen: set = set()

    def check(self, index: int, cell: Cell) -> None:
        """Record bucket `index`'s local health (from `health`) for the next verdict."""
        self.record(index, self.layouts[index], cell)
        self._seen.add(index)

    def verdict(self) -> Verdict:
        """Exchange every rank's row of this update and decide; the same on every rank."""
        missing = [i for i in range(len(self.layouts)) if i not in self._seen]
        if missing:
            raise RuntimeError(
                f"{self.framework}: buckets {missing} of {len(self.layouts)} were not checked since the last "
                "verdict (hint: step the optimizer once per update, after the gradients are reduced)"
            )
        self._seen = set()
        self.exchange(len(self.layouts))
        return super().verdict()


# --- the step that obeys the verdict ---------------------------------------------------------------


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
    is. `step()` returns the `Verdict`. Other attributes are the wrapped optimizer's.

    A framework whose optimizer steps differently (its own loss scaler inside, another return value)
    overrides `_runner` (the step a script without the guard takes) and `_result`."""

    def __init__(self, optimizer: Any, guard: GuardCore):
        self.optimizer = optimizer
        self.guard = guard
        guard._optimizer = optimizer  # a "repair" verdict copies its state (adapters with SDC)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        run = self._runner(*args, **kwargs)
        v = self.guard.verdict()
        if self.guard.scaler is None:
            # `apply_verdict` without a scaler, inline (every update takes this on the hot path).
            if not v.proceeded:
                return self._result(v, None)
            ran_out = run()
            self.guard.stepped()
            return self._result(v, ran_out)
        out: List[Any] = []
        ran = apply_verdict(v, self.guard.scaler, lambda: out.append(run()))
        if ran:
            self.guard.stepped()
        return self._result(v, out[0] if ran else None)

    def _runner(self, *args: Any, **kwargs: Any) -> Callable[[], Any]:
        """The optimizer step of a script without the guard, with `step()`'s arguments (checked
        before the verdict is taken)."""
        scaler = self.guard.scaler
        if scaler is None:
            return lambda: self.optimizer.step(*args, **kwargs)
        if args or kwargs:
            raise RuntimeError("gradbus.torch.GuardedOptimizer.step: a closure with a GradScaler (torch.amp.GradScaler.step does not support closures either)")

        def run() -> Any:
            out = scaler.step(self.optimizer)
            scaler.update()
            return out

        return run

    def _result(self, v: Verdict, out: Any) -> Any:
        """What `step()` returns: the verdict (`out`: what the step returned, None when it did not run)."""
        return v

    def zero_grad(self, *args: Any, **kwargs: Any) -> Any:
        return self.optimizer.zero_grad(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


def quarantined(run_dir: Any) -> List[Any]:
    """The sample ids that `run_dir/quarantine.jsonl` names (each line verified; empty when there is
    no such file): leave them out when the run resumes."""
    path = os.path.join(os.fspath(run_dir), "quarantine.jsonl")
    return _core.read_quarantine(path) if os.path.exists(path) else []
