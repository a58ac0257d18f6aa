#!/usr/bin/env python3
"""Where the DDP guard's time goes on a small update: one process (gloo, world 1) trains the small
MLP of paths.py (~100K parameters, one bucket) with the guard on one agreement path, every guard
method and native call it makes timed in place (cumulative: a method's time includes the calls it
makes), and prints microseconds per update beside the update's own; then the native scans of the
bucket timed alone in a loop beside torch's division and product of it (what the hooks without the
guard do), for what the calls cost off the update's hot path. The wrappers add a little to every
part. A benchmark: asserts nothing.

Usage: guard_parts.py [--agreement auto|ride|table|summary] [--updates 2000] [--width 256]
"""

import argparse
import functools
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--agreement", default="auto", choices=["auto", "ride", "table", "summary"])
    ap.add_argument("--updates", type=int, default=2000)
    ap.add_argument("--width", type=int, default=256)
    a = ap.parse_args()

    import gradbus.guard as gg
    import gradbus.torch as gbt

    spent = {}

    def timed(name, f):
        @functools.wraps(f)
        def w(*args, **kw):
            t = time.perf_counter_ns()
            try:
                return f(*args, **kw)
            finally:
                spent[name] = spent.get(name, 0) + time.perf_counter_ns() - t

        return w

    class Timed:
        """A native object (the `_core` module, the Agreement) whose calls are timed."""

        def __init__(self, inner, prefix):
            self._inner, self._prefix = inner, prefix

        def __getattr__(self, name):
            v = getattr(self._inner, name)
            return timed(f"{self._prefix}.{name}", v) if callable(v) else v

    gg._core = Timed(gg._core, "_core")
    for cls in (gbt.Guard, gg.GuardCore):
        for name, f in list(vars(cls).items()):
            if callable(f) and not name.startswith("__") and not isinstance(f, (staticmethod, classmethod, type)):
                setattr(cls, name, timed(f"{cls.__name__}.{name}", f))
    hook = timed("allreduce_hook", gbt.allreduce_hook)
    gg.GuardedOptimizer.step = timed("GuardedOptimizer.step", gg.GuardedOptimizer.step)

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, a.width), torch.nn.GELU(), torch.nn.Linear(a.width, a.width),
                              torch.nn.GELU(), torch.nn.Linear(a.width, 64))
    ddp = DDP(net)
    guard = gbt.Guard(policy="skip", names=net, agreement=a.agreement)
    guard._agreement = Timed(guard._agreement, "Agreement")

    def comm_hook(state, bucket):  # DDP checks the parameter's name
        return hook(state, bucket)

    ddp.register_comm_hook(guard, comm_hook)
    opt = gbt.GuardedOptimizer(torch.optim.AdamW(ddp.parameters(), lr=1e-4), guard)
    x = torch.randn(32, 64)

    def update():
        opt.zero_grad()
        guard.backward(ddp(x).square().mean())
        opt.step()

    for _ in range(30):
        update()
    spent.clear()
    t = time.perf_counter()
    for _ in range(a.updates):
        update()
    per = (time.perf_counter() - t) / a.updates * 1e6
    params = sum(p.numel() for p in net.parameters())
    print(f"{params} parameters, 1 process, agreement={a.agreement!r} took the {guard.path} path; "
          f"{per:.0f} us per update; the guard's parts, us per update (cumulative):")
    for name, ns in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:32s} {ns / a.updates / 1e3:8.1f}")
    # The scans alone, in a loop, beside what the hook without the guard does to the bucket
    # (default_hooks.allreduce_hook divides it; DDP's own reduction multiplies). Scale 1.0: the
    # bucket keeps its values.
    buf = torch.randn(params)
    core = gg._core._inner
    ptr, n = buf.data_ptr(), buf.numel()
    alone = {
        "_core.scan_f32 (the local scan)": lambda: core.scan_f32(ptr, n),
        "_core.scale_scan_f32 (scan + pre-division)": lambda: core.scale_scan_f32(ptr, n, 1.0),
        "_core.finite_f32 (the reduced sum's check)": lambda: core.finite_f32(ptr, n),
        "torch div_ (the Python hook's division)": lambda: buf.div_(1.0),
        "torch mul_ (DDP's own pre-division)": lambda: buf.mul_(1.0),
    }
    print(f"the bucket's {params} floats alone, in a loop (best of 10 x 500 calls):")
    for name, f in alone.items():
        for _ in range(200):
            f()
        best = float("inf")
        for _ in range(10):
            t = time.perf_counter()
            for _ in range(500):
                f()
            best = min(best, (time.perf_counter() - t) / 500 * 1e6)
        print(f"  {name:44s} {best:6.1f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
