#!/usr/bin/env python3
"""CPU time the guard adds per update, measured in one process (DDP over gloo, world size 1) so that
the number is the hook's own work - the Rust scan of every bucket, the Python bookkeeping, the
agreement and `decide` - and not the scheduling of several ranks on a busy machine. Alternates
PyTorch's Python `default_hooks.allreduce_hook`, the gradbus guard (policy skip) and the guard with
its replica check on every update (`replica_every=1`: the parameters hashed on every update, so its
difference to the guard is the cost of one check), and the guard with its silent-data-corruption
checks (`sdc=True`: the reduced buckets hashed twice - as the all-reduce returned them and as the
optimizer consumes them - and every bucket's peak tallied for the outlier rule; and with
`replica_every=1` on top: the weights hashed after the step and read back before the next) on the
same model, `--iters` backward+step per round, and prints CPU milliseconds per update (process time,
so a loaded machine inflates it less than wall time) and the differences. A benchmark: asserts
nothing.

Usage: hook_cpu.py [--params-m 10] [--iters 30] [--rounds 3]
"""

import argparse
import os
import socket
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import gradbus.torch as gbt  # noqa: E402


def setup(width, layers, guard, replica_every=0, sdc=False):
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    ddp = DDP(net)
    opt = torch.optim.SGD(net.parameters(), lr=1e-6)
    if guard:
        g = gbt.Guard(policy="skip", names=net, replica_every=replica_every, sdc=sdc)
        ddp.register_comm_hook(g, gbt.allreduce_hook)
        return ddp, gbt.GuardedOptimizer(opt, g)
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    return ddp, opt


def round_ms(ddp, opt, x, iters):
    t0 = time.process_time()
    for _ in range(iters):
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
    return (time.process_time() - t0) * 1e3 / iters


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params-m", type=float, default=10.0, help="model size, millions of parameters")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    width, layers = 1024, max(1, round(a.params_m * 1e6 / (1024 * 1025)))
    x = torch.randn(8, width)
    variants = {
        "allreduce_hook": setup(width, layers, False),
        "gradbus guard": setup(width, layers, True),
        "guard + replica": setup(width, layers, True, replica_every=1),
        "guard + sdc": setup(width, layers, True, sdc=True),
        "sdc + replica": setup(width, layers, True, replica_every=1, sdc=True),
    }
    for ddp, opt in variants.values():
        round_ms(ddp, opt, x, 3)  # warm-up: DDP's bucket rebuild, allocations
    ms = {k: [] for k in variants}
    for r in range(a.rounds):
        for k, (ddp, opt) in variants.items():
            ms[k].append(round_ms(ddp, opt, x, a.iters))
            print(f"round {r} {k:15s} {ms[k][-1]:8.2f} CPU ms/update", flush=True)
    n = layers * 1024 * 1025
    base, guard = statistics.median(ms["allreduce_hook"]), statistics.median(ms["gradbus guard"])
    replica = statistics.median(ms["guard + replica"])
    print(f"{n / 1e6:.1f} M params ({n * 4 / 2**20:.0f} MiB of gradients): allreduce_hook {base:.2f}, "
          f"gradbus guard {guard:.2f} CPU ms/update; the guard adds {guard - base:+.2f} ms ({(guard / base - 1) * 100:+.1f}%)")
    print(f"replica check: {replica:.2f} CPU ms/update when every update checks, {replica - guard:+.2f} ms per check "
          f"({(replica / guard - 1) * 100:+.1f}% of a guarded update; every 100 updates: {(replica / guard - 1):+.2f}%)")
    sdc, both = statistics.median(ms["guard + sdc"]), statistics.median(ms["sdc + replica"])
    print(f"sdc=True (reduced buckets + outliers): {sdc:.2f} CPU ms/update, {sdc - guard:+.2f} ms ({(sdc / guard - 1) * 100:+.1f}%) "
          f"over the guard; with replica_every=1 too: {both:.2f}, {both - guard:+.2f} ms ({(both / guard - 1) * 100:+.1f}%)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
