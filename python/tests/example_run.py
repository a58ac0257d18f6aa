"""Run a framework example (python/examples/*.py) under torchrun, 2 processes, for the tests; each
rank writes its outcome to OUT/result-rankK.json (the examples' --out)."""

import json
import subprocess
import sys

from ddp_case import free_port


def torchrun(example, tmp_path, name, *args):
    """(exit code, output, [result of rank 0, rank 1]) of `example` with `args`, --run-dir and --out
    under tmp_path/name."""
    out = tmp_path / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           example, "--run-dir", str(out / "run"), "--out", str(out), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    results = []
    for r in range(2):
        path = out / f"result-rank{r}.json"
        assert path.exists(), f"rank {r} wrote no result; exit {p.returncode}\n{p.stdout}\n{p.stderr}"
        results.append(json.loads(path.read_text()))
    return p.returncode, p.stdout + p.stderr, results
