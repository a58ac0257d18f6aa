#!/usr/bin/env python3
"""The Python work on the main thread of one small DDP update, counted (deterministic, whatever the
machine's load): one rank over gloo trains paths.py's MLP (`--width`, ~100K parameters at 256, one
bucket) with PyTorch's `allreduce_hook`, with paths.py's `--scans-only` variant (the scan path's
native work alone), with the guard with its hook's fast path off (`general`) and with the guard as it
is (`auto`, the scan path); after 20 updates, `sys.settrace` with opcode events counts over 10
updates the Python opcodes executed, the Python calls and the C calls (`sys.setprofile`), per
update, and the opcodes in the guard's own functions (gradbus/*.py; paths.py's for `scans only`).
A benchmark: asserts nothing.

Usage: opcodes.py [--width 256]
"""

import argparse
import collections
import os
import socket
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paths import build  # noqa: E402

# Each variant as paths.py builds it (None: PyTorch's allreduce_hook).
KINDS = {"allreduce_hook": None, "scans only": "scans only", "general": "general", "auto": "auto"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=256)
    a = ap.parse_args()
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    n = 10
    print(f"1 rank, width {a.width}; per update, over {n} updates after 20")
    print(f"{'variant':>15} {'opcodes':>8} {'Python calls':>13} {'C calls':>8} {'own opcodes':>12}")
    for kind, agreement in KINDS.items():
        ddp, opt, g = build(agreement, a.width, 1)

        def update():
            opt.zero_grad()
            loss = ddp(x).square().mean()
            loss.backward() if g is None else g.backward(loss)
            opt.step()

        for _ in range(20):
            update()
        count = collections.Counter()
        own = ("/gradbus/",) if g is not None else ("paths.py",)

        def trace(frame, event, arg):
            frame.f_trace_opcodes = True
            if event == "opcode":
                count["op"] += 1
                if any(o in frame.f_code.co_filename for o in own):
                    count["own"] += 1
            elif event == "call":
                count["call"] += 1
            return trace

        def profile(frame, event, arg):
            if event == "c_call":
                count["c"] += 1

        sys.setprofile(profile)
        sys.settrace(trace)
        for _ in range(n):
            update()
        sys.settrace(None)
        sys.setprofile(None)
        print(f"{kind:>15} {count['op'] / n:>8.1f} {count['call'] / n:>13.1f} {count['c'] / n:>8.1f} {count['own'] / n:>12.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
