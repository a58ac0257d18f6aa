#!/usr/bin/env python3
"""Why the guard's rows ride the last bucket's all-reduce only at 2 ranks by default: an all-reduce
over gloo of a float32 tensor, and of the same tensor with zeros appended (the room for the rows),
compared bit for bit on the tensor's own elements. At 2 ranks every element is a + b either way;
at 3 and more, gloo's ring cuts its input in chunks whose boundaries move with its length, and each
chunk's sum runs in its own rank order, so some elements change in their last bits. Prints, per
world size, size and appended length, how many elements differ. A demonstration: asserts nothing.

Usage: sum_order.py [--world 2,3,4]
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [10, 1000, 100_000, 1_000_000]
APPENDED = [8, 128, 1000]


def worker(rank, world, port, q):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = []
    for n in SIZES:
        for k in APPENDED:
            x = torch.randn(n, generator=torch.Generator().manual_seed(7 * rank + n)) / world
            a = x.clone()
            dist.all_reduce(a)
            b = torch.cat([x, torch.zeros(k)])
            dist.all_reduce(b)
            out.append((n, k, int((a.view(torch.int32) != b[:n].view(torch.int32)).sum())))
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", default="2,3,4")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    print(f"{'world':>5} {'elements':>9} {'appended':>8} {'differ':>6}")
    for world in map(int, a.world.split(",")):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        q = ctx.Queue()
        mp.start_processes(worker, args=(world, port, q), nprocs=world, join=True, start_method="spawn")
        for n, k, d in q.get():
            print(f"{world:>5} {n:>9} {k:>8} {d:>6}", flush=True)


if __name__ == "__main__":
    main()
