"""What the framework examples share, apart from the lines a user writes: the command line (--policy,
--plant, --steps, --run-dir), the process group under torchrun, the planted NaN (the examples'
stand-in for a loss gone non-finite) and the exit after an agreed abort.

--plant RANK:STEP:PARAM:ELEMENT writes a NaN into PARAM's gradient element ELEMENT on rank RANK at
update STEP, through a tensor hook on the tensor autograd accumulates PARAM's gradient into.
"""

import argparse
import os
import sys
from datetime import timedelta
from typing import Any, Callable, Optional, Tuple

import torch
import torch.distributed as dist


def parser(doc: str, run_dir: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--policy", choices=["abort", "skip", "none"], default="abort",
                    help="the guard's policy; none: the framework alone")
    ap.add_argument("--plant", default=None, help="RANK:STEP:PARAM:ELEMENT: a NaN into that gradient element")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--run-dir", default=run_dir, help="where rank 0 writes report.json on abort")
    return ap


def plant(spec: Optional[str], rank: int, step: int, tensor_of: Callable[[str], Any]) -> Any:
    """The hook handle of the planted NaN when `spec` names this rank and step, else None;
    `tensor_of(PARAM)` is the tensor to hook. Remove the handle after the backward."""
    if not spec:
        return None
    r, s, name, element = spec.split(":")
    if (int(r), int(s)) != (rank, step):
        return None
    e = int(element)

    def nan(g):
        g = g.clone()
        g.view(-1)[e] = float("nan")
        return g

    return tensor_of(name).register_hook(nan)


def init(cuda: bool) -> Tuple[int, str]:
    """(rank, device) under torchrun, with the default process group: NCCL on the local GPU, or gloo
    on the CPU (one thread per process)."""
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=120))
    return dist.get_rank(), "cuda" if cuda else "cpu"


def run(train: Callable[[], None], aborted: type) -> int:
    """Run `train()`; 0, or 3 after the guard's agreed abort (`aborted`), whose line every rank prints.
    Every rank is healthy after an agreed abort: they meet at a barrier before any exits (torchrun
    stops the others as soon as one exits non-zero)."""
    rc = 0
    try:
        train()
    except aborted as e:
        print(f"[rank {dist.get_rank()}] {e}", flush=True)
        rc = 3
    dist.barrier()
    dist.destroy_process_group()
    return rc


def exit_now(rc: int) -> None:
    """Exit with `rc` once everything is printed and the process group is gone, skipping the
    interpreter's teardown: there torch 2.15's gloo sometimes aborts ("terminate called without an
    active exception", SIGABRT: a joinable C++ thread destroyed), which would turn a finished run's
    exit code into a crash."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
