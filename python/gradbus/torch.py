"""The gradbus guard as a PyTorch DistributedDataParallel communication hook.

    guard = gradbus.torch.Guard(policy="skip", names=model, run_dir="runs/job")
    ddp.register_comm_hook(guard, gradbus.torch.allreduce_hook)
    opt = gradbus.torch.GuardedOptimizer(torch.optim.AdamW(ddp.parameters()), guard)
    ...
    guard.backward(loss)        # or loss.backward(): the loss is then not judged
    opt.step()                  # runs the optimizer only when every rank agreed to proceed

Per bucket, the hook tallies the rank's OWN gradients before they are reduced (CPU float32 buckets:
the runtime's fused Rust scan, in place on the bucket's memory; other buckets, CUDA ones included:
torch ops on the bucket's device, and only four numbers per bucket ever reach the host), then starts
the bucket's all-reduce as DDP does without a hook (scale by 1/world, sum), so a clean run is
bitwise plain DDP. At the last bucket it starts ONE small all-gather of every rank's
table (4 float64 per bucket plus the loss); `Guard.verdict()` (called by `GuardedOptimizer.step`)
waits for it and runs the runtime's `decide` on it. The table, the layout (DDP builds the same
buckets on every rank) and the history are the same on every rank, so every rank reaches the same
verdict with no broadcast: proceed, skip (bounded), rerun, or abort, which raises the same
`NonFiniteGradients` on every rank and has rank 0 write `run_dir/report.json` (the runtime's
`Report`, same schema).

Invariants: the hook never changes a gradient; the optimizer (weights, moments, step count) is
touched only on "proceed"; every rank issues the same collectives in the same order (one
all-reduce per bucket, one all-gather per backward).
"""

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from gradbus import _core

log = logging.getLogger("gradbus")

POLICIES = ("abort", "skip", "rerun")


class NonFiniteGradients(RuntimeError):
    """Every rank agreed to abort on non-finite gradients; the same on every rank.

    `report` is the runtime's report (a dict: step, minibatch, attempt, verdict, ranks, bucket,
    param, element, nan, inf, per_rank, loss_finite, classification); `path` is where rank 0 wrote
    it as JSON, or None without a run_dir.
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

    @property
    def proceeded(self) -> bool:
        return self.action == "proceed"


def describe(report: Dict[str, Any], path: Optional[str]) -> str:
    """One line about a non-finite report, the same on every rank."""
    r = report
    where = f"report {path}" if path else "no run_dir: report not written"
    cls = f" ({r['classification']})" if r.get("classification") else ""
    return (
        f"gradbus: non-finite gradients at step {r['step']} (attempt {r['attempt']}): rank(s) {r['ranks']}, "
        f"bucket #{r['bucket']}, param {r['param']} element {r['element']}, {r['nan']} NaN, {r['inf']} Inf, "
        f"loss {'finite' if r['loss_finite'] else 'NON-FINITE'}; verdict {r['verdict']}{cls}; {where}"
    )


def _torch_health(x: torch.Tensor) -> torch.Tensor:
    """The bucket's health with torch ops on its own device: float64 [nan, inf, sumsq, first_bad]
    (first_bad -1: none), the same fields as the Rust scan. Counts and first_bad are exact; the sum
    of squares (finite elements, in float64) may differ from the Rust scan's in the last bits: it only
    feeds spike detection, never the finite/non-finite decision."""
    x = x.reshape(-1)
    bad = ~torch.isfinite(x)
    nan = torch.isnan(x).sum()
    nbad = bad.sum()
    finite = torch.where(bad, torch.zeros((), dtype=x.dtype, device=x.device), x)
    sumsq = finite.double().square().sum()
    # argmax returns the first maximal index: the first non-finite element when there is one.
    first = torch.where(nbad > 0, bad.to(torch.uint8).argmax(), torch.full((), -1, device=x.device))
    return torch.stack([nan.double(), (nbad - nan).double(), sumsq, first.double()])


class Guard:
    """Validates every rank's gradients inside DDP's all-reduce and agrees on one verdict.

    policy: "abort" | "skip" | "rerun" (as the runtime's `policy` key).
    names: the model (its `named_parameters()`; a DDP wrapper is looked through) or a dict
        name -> parameter, so that reports name the parameter; without it, "bucketB.paramJ".
    run_dir: where rank 0 writes report.json on abort (created when missing).
    process_group: the DDP process group (None: the default group).
    max_consecutive, max_fraction, window: the skip policy's bounds (the runtime's defaults).
    spike: None, "warn" or "skip": the runtime's spike detectors on the agreed mean loss and on the
        gradient norm (sqrt of the ranks' summed local squared norms / world); "skip" skips a spike.
    scan: "auto" (Rust scan for CPU float32 buckets, torch ops otherwise) or "torch" (always torch ops).
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
    ):
        if policy not in POLICIES:
            raise ValueError(f"gradbus.torch.Guard: policy {policy!r}: expected one of {POLICIES}")
        if scan not in ("auto", "torch"):
            raise ValueError(f"gradbus.torch.Guard: scan {scan!r}: expected 'auto' or 'torch'")
        self.policy = policy
        self.run_dir = None if run_dir is None else os.fspath(run_dir)
        self.process_group = process_group
        self._agreement = _core.Agreement(policy, max_consecutive, max_fraction, window, spike)
        self._scan = scan
        self._params = self._names(names)
        self.step = 0
        """Updates judged so far (skipped ones included): the step of the next report (assign your
        own step number before a backward to label reports with it)."""
        self.attempt = 0
        """0, or 1 while a rerun of the current update is due."""
        self.buckets = 0
        """DDP buckets in the last backward."""
        self.last: Optional[Verdict] = None
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
        backward; `backward` does it)."""
        self._loss = loss

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`set_loss(loss)` then `loss.backward(**kwargs)`."""
        self.set_loss(loss)
        loss.backward(**kwargs)

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
        """Wait for this backward's table exchange and decide; the same on every rank. Raises
        `NonFiniteGradients` on abort (on every rank; rank 0 writes run_dir/report.json)."""
        if self._pending is None:
            raise RuntimeError(
                "gradbus.torch.Guard.verdict: no gradients were exchanged since the last verdict "
                "(hint: backward through the DDP model after ddp.register_comm_hook(guard, gradbus.torch.allreduce_hook))"
            )
        work, outs, layout, world = self._pending
        self._pending = None
        work.wait()
        table = torch.cat(outs).cpu().tolist()
        action, report_json, spike = self._agreement.decide(table, world, layout, self.step, self.attempt)
        report = None if report_json is None else json.loads(report_json)
        v = Verdict(action, report, spike, self.step, self.attempt)
        self.last = v
        self._verdicts += 1
        if action == "rerun":
            self.attempt += 1
        else:
            self.step += 1
            self.attempt = 0
        if action == "abort":
            path = self._write_report(report_json)
            raise NonFiniteGradients(describe(report, path), report, path)
        if report is not None:
            log.warning("%s", describe(report, None))
        if spike is not None:
            log.warning("gradbus: step %d: %s%s", v.step, spike, "; skipped" if action == "skip" else "")
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

    def _tally(self, bucket: dist.GradBucket) -> None:
        """Record the health and the parameter layout of one bucket before its all-reduce."""
        buf = bucket.buffer()
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

    def _exchange(self, last: int) -> None:
        """At the last bucket: start the one all-gather of every rank's table."""
        if self._pending is not None:
            raise RuntimeError(
                "gradbus.torch.Guard: a second backward before the verdict on the first "
                "(hint: call opt.step() or guard.verdict() after every backward; gradient accumulation "
                "runs its inner steps under ddp.no_sync())"
            )
        n = last + 1
        if sorted(self._cells) != list(range(n)):
            raise RuntimeError(f"gradbus: buckets {sorted(self._cells)} seen before the last bucket #{last}")
        pg = self.process_group
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pg) == "nccl" else torch.device("cpu")
        loss = 0.0 if self._loss is None else self._loss
        cells = [self._cells[b] for b in range(n)]
        # Built where the tallies are (the buckets' device), then moved once: a single small copy
        # to the host for CUDA buckets under gloo, none under NCCL or for CPU buckets.
        at = next((c.device for c in cells if isinstance(c, torch.Tensor)), torch.device("cpu"))
        parts = [c if isinstance(c, torch.Tensor) else torch.tensor(c, dtype=torch.float64, device=at) for c in cells]
        parts.append(torch.as_tensor(loss).detach().to(device=at, dtype=torch.float64).reshape(1))
        row = torch.cat(parts).to(device)
        world = dist.get_world_size(pg)
        outs = [torch.empty_like(row) for _ in range(world)]
        work = dist.all_gather(outs, row, group=pg, async_op=True)
        self._pending = (work, outs, [self._layout[b] for b in range(n)], world)
        self.buckets = n
        self._cells, self._layout, self._loss = {}, {}, None

    def _write_report(self, text: Optional[str]) -> Optional[str]:
        """Rank 0 writes report.json atomically; every rank returns the same path."""
        if self.run_dir is None or text is None:
            return None
        path = os.path.join(self.run_dir, "report.json")
        if dist.get_rank(self.process_group) == 0:
            os.makedirs(self.run_dir, exist_ok=True)
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                f.write(text + "\n")
            os.replace(tmp, path)
        return path


def allreduce_hook(guard: Guard, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: tally the bucket's local health, then all-reduce it as DDP does
    without a hook (mean over ranks); at the last bucket, start the table exchange.
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


class GuardedOptimizer:
    """An optimizer whose `step()` first takes the guard's verdict and steps only on "proceed":
    on "skip" and "rerun" the weights and the optimizer's state (moments, step count) stay untouched
    on every rank. Other attributes are the wrapped optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, guard: Guard):
        self.optimizer = optimizer
        self.guard = guard

    def step(self, closure: Any = None) -> Verdict:
        v = self.guard.verdict()
        if v.proceeded:
            if closure is None:
                self.optimizer.step()
            else:
                self.optimizer.step(closure)
        return v

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)
