#!/usr/bin/env python3
"""The guard's agreement paths on a small DDP update, against PyTorch's own hook: W processes over
gloo on the CPU train the same small MLP (`--width`, 3 layers: ~100K parameters at 256, the GRPO
twin's tiny size, one DDP bucket) with PyTorch's Python `default_hooks.allreduce_hook` and with the
gradbus guard on each agreement path (`auto`, the default: here the scan path, the reduced sums
scanned and no rows on a healthy update; `ride`: the rows in the last bucket's all-reduce; `table`:
one all-gather; `summary`: two all-reduces), alternated in rounds of `--iters`
updates (forward, backward, step). Rank 0 prints per update the wall time and its process's CPU
time (its own and its gloo threads': a busy machine disturbs it less than the wall), the medians of
the rounds, each against the hook's, and the median of the per-round ratios (each variant against
the hook's rounds next to it in time, which a machine whose speed drifts disturbs less) with their
quartiles, and the ratio of the fastest rounds (another machine's load only adds time: the least
disturbed round of each). `--control` adds `allreduce_hook` a second time: its ratios show what the machine's own
noise makes of the same code. `--scans-only` adds a variant that does the guard's native work on
the scan path and nothing else (not a guard: no records, no verdict, no report): the hook's fused
pre-division and scan (`_core.scale_scan_f32`) and, before the optimizer step, the check of the
reduced sums (`_core.finite_f32`); the guard's distance from it is its Python bookkeeping.
`--general` adds the guard with the hook's fast path off (`Guard._fast`: every update on the
general path, as before session 13). `--pin` binds rank r to CPU r (as `mpirun --bind-to core`).
`--alternate update` alternates the variants at every update instead
(no barrier: each update's all-reduce keeps the ranks in step) for `--rounds` updates each, and
prints the medians and quartiles of the single updates' wall and CPU times, and of the main
thread's CPU alone (the training loop's, DDP's hook and the verdict included; not gloo's threads):
a load that comes and goes then falls on every variant alike, which rounds of many updates cannot
promise on a shared machine. The order of the variants turns by one every round (none always first
or last). `--copies N` builds every variant N times (its own model, optimizer and DDP buffers) and pools the
copies' samples per variant: identical code built twice can run a few percent apart for where its
memory landed, which pooled copies share out alike. A benchmark: asserts nothing.

Usage: paths.py [--world 2] [--width 256] [--iters 200] [--rounds 7] [--paths auto,ride,table,summary] [--control]
                [--alternate round|update] [--copies 1] [--scans-only] [--general] [--pin]
"""

import argparse
import os
import socket
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

PATHS = ("auto", "ride", "table", "summary")


class _ScansOnly:
    """`--scans-only`: the guard's native work on the scan path alone (see the module doc), as a
    DDP comm hook (`hook`) and an optimizer whose step checks the reduced sums first."""

    def __init__(self, optimizer, world):
        self.optimizer, self.scale, self.buffers = optimizer, 1.0 / world, {}

    def hook(self, _, bucket):
        from gradbus import _core

        buf = bucket.buffer()
        _core.scale_scan_f32(buf.data_ptr(), buf.numel(), self.scale)
        self.buffers[bucket.index()] = buf
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])

    def zero_grad(self):
        self.optimizer.zero_grad()

    def step(self):
        from gradbus import _core

        if all(_core.finite_f32(b.data_ptr(), b.numel()) for b in self.buffers.values()):
            self.optimizer.step()


def build(agreement, width, world):
    """One variant: (the DDP model, its optimizer, the guard or None). `agreement`: None (PyTorch's
    `allreduce_hook`), "scans only" (`_ScansOnly`), "general" (the guard with its hook's fast path
    off) or a guard's agreement value."""
    import gradbus.torch as gbt

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                              torch.nn.GELU(), torch.nn.Linear(width, 64))
    ddp = DDP(net)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    if agreement == "scans only":
        bound = _ScansOnly(opt, world)
        ddp.register_comm_hook(None, bound.hook)
        return ddp, bound, None
    if agreement is None:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        return ddp, opt, None
    g = gbt.Guard(policy="skip", names=net, agreement="auto" if agreement == "general" else agreement)
    if agreement == "general":
        g._scan_path = lambda: None  # no fast path: every update on the hook's general path
    ddp.register_comm_hook(g, gbt.allreduce_hook)
    return ddp, gbt.GuardedOptimizer(opt, g), g


def worker(rank, world, port, width, iters, rounds, paths, control, alternate, copies, scans_only, general, pin, q):

    torch.set_num_threads(1)
    if pin:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(rank))
    kinds = {"allreduce_hook": None, **({"control": None} if control else {}),
             **({"scans only": "scans only"} if scans_only else {}),
             **({"general": "general"} if general else {}), **{p: p for p in paths}}
    # Each kind `copies` times (its own model, optimizer and DDP buffers): what the memory a variant
    # happens to get does to its speed falls on every kind alike when pooled over the copies.
    variants = {(k, c): build(g, width, world) for c in range(copies) for k, g in kinds.items()}

    def update(ddp, opt, g):
        opt.zero_grad()
        loss = ddp(x).square().mean()
        loss.backward() if g is None else g.backward(loss)
        opt.step()

    for v in variants.values():
        for _ in range(10):  # DDP's bucket rebuild, allocations
            update(*v)
    wall = {k: [] for k in kinds}
    cpu = {k: [] for k in kinds}
    main = {k: [] for k in kinds}
    if alternate == "update":
        iters = 1
    order = list(variants)
    for r in range(rounds):
        # Every variant once per round, starting one further along each round: no variant is always
        # first or last. A kind's samples pool its copies'.
        for key in order[r % len(order):] + order[: r % len(order)]:
            k, v = key[0], variants[key]
            if alternate == "round":
                dist.barrier()
            t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
            for _ in range(iters):
                update(*v)
            wall[k].append((time.perf_counter() - t0) * 1e6 / iters)
            cpu[k].append((time.process_time() - c0) * 1e6 / iters)
            main[k].append((time.thread_time() - m0) * 1e6 / iters)
    if rank == 0:
        q.put((wall, cpu, main, sum(p.numel() for p in variants[("allreduce_hook", 0)][0].parameters()),
               variants[("auto", 0)][2].path if "auto" in kinds else None))
    dist.destroy_process_group()
    # Skip the interpreter's teardown, where torch 2.15's gloo sometimes aborts a finished worker
    # (SIGABRT: "terminate called without an active exception"), which failed whole runs here. Rank
    # 0's result is flushed to the parent first.
    q.close()
    q.join_thread()
    os._exit(0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--paths", default=",".join(PATHS), help="the guard's agreement values to run")
    ap.add_argument("--control", action="store_true", help="allreduce_hook a second time")
    ap.add_argument("--alternate", default="round", choices=["round", "update"],
                    help="alternate the variants every round of --iters updates, or every update (--rounds updates each)")
    ap.add_argument("--scans-only", action="store_true",
                    help="add the guard's native scans alone (no records, no verdict): its Python bookkeeping's baseline")
    ap.add_argument("--general", action="store_true",
                    help="add the guard with the hook's fast path off (the general path on every update)")
    ap.add_argument("--pin", action="store_true", help="bind rank r to CPU r")
    ap.add_argument("--copies", type=int, default=1,
                    help="build each variant this many times (its own model and DDP buffers), alternated and pooled")
    a = ap.parse_args()
    paths = [p for p in a.paths.split(",") if p]
    if not set(paths) <= set(PATHS):
        ap.error(f"--paths {a.paths}: expected some of {','.join(PATHS)}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    if a.copies < 1:
        ap.error(f"--copies {a.copies}: expected 1 or more")
    ranks = mp.start_processes(worker, args=(a.world, port, a.width, a.iters, a.rounds, paths, a.control, a.alternate, a.copies, a.scans_only,
                                     a.general, a.pin, q),
                               nprocs=a.world, join=False, start_method="spawn")
    # Read rank 0's result before joining: a result larger than a pipe's buffer (--alternate update's
    # single updates) blocks rank 0's exit until it is read.
    wall, cpu, main, params, path = q.get()
    while not ranks.join():
        pass
    took = f"; 'auto' took the {path} path" if path else ""
    if a.alternate == "update":
        print(f"{a.world} ranks, {params} parameters, {a.rounds} updates per variant x {a.copies} copies, alternated update by update; "
              f"us per update{took}")
        print(f"{'variant':>15} {'wall: median':>13} {'vs hook':>8} {'[quartiles]':>17} {'CPU: median':>12} {'vs hook':>8} {'[quartiles]':>17}"
              f" {'main thread':>12} {'vs hook':>8} {'[quartiles]':>17}")
        for k in wall:
            row = f"{k:>15}"
            for t in (wall, cpu, main):
                q1, m, q3 = statistics.quantiles(t[k], n=4)
                h = statistics.median(t["allreduce_hook"])
                row += f" {m:>13.1f} {m / h:>8.3f} [{q1:>7.1f}, {q3:>7.1f}]"
            print(row)
        return
    print(f"{a.world} ranks, {params} parameters, {a.iters} updates x {a.rounds} rounds x {a.copies} copies; us per update, medians of the rounds{took}")
    print(f"{'variant':>15} {'wall us':>9} {'vs hook':>8} {'CPU us':>9} {'vs hook':>8}   paired wall ratio: median [quartiles]"
          "   fastest rounds: wall us, vs hook")
    med = {k: statistics.median(w) for k, w in wall.items()}
    cmed = {k: statistics.median(c) for k, c in cpu.items()}
    for k in wall:
        ratios = sorted(x / h for x, h in zip(wall[k], wall["allreduce_hook"]))
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        print(f"{k:>15} {med[k]:>9.1f} {med[k] / med['allreduce_hook']:>8.3f} {cmed[k]:>9.1f} "
              f"{cmed[k] / cmed['allreduce_hook']:>8.3f}   {statistics.median(ratios):.3f} [{q1:.3f}, {q3:.3f}]"
              f"   {min(wall[k]):9.1f} {min(wall[k]) / min(wall['allreduce_hook']):.3f}")


if __name__ == "__main__":
    main()
