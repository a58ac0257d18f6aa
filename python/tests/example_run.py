"""Run a framework example (python/examples/*.py) under torchrun, 2 processes, for the tests; each
rank writes its outcome to OUT/result-rankK.json (the examples' --out)."""

import json
import subprocess
import sys

from ddp_case import free_port


def torchrun(example, tmp_path, name, *args, seeds=None, run_dir=None):
    """(exit code, output, [result of rank 0, rank 1]) of `example` with `args`, --run-dir (default
    tmp_path/name/run) and --out under tmp_path/name. With `seeds` (an example that runs several seeds
    in one process group, each into OUT/seed-S): the results are {seed: [rank 0's, rank 1's]}."""
    out = tmp_path / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           example, "--run-dir", str(run_dir or out / "run"), "--out", str(out), *args]
    if seeds is not None:
        cmd += ["--seed", ",".join(map(str, seeds))]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)

    def results(folder):
        got = []
        for r in range(2):
            path = folder / f"result-rank{r}.json"
            assert path.exists(), f"rank {r} wrote no {path}; exit {p.returncode}\n{p.stdout}\n{p.stderr}"
            got.append(json.loads(path.read_text()))
        return got

    found = results(out) if seeds is None else {s: results(out / f"seed-{s}") for s in seeds}
    return p.returncode, p.stdout + p.stderr, found


WARNING_KEYS = ["format", "update", "quantity", "value", "limit", "rank", "forecast_updates", "action", "crc32c"]


def warnings_file(run_dir):
    """run_dir/warnings.jsonl's lines as dicts, each with exactly the keys of the format ([] when
    there is no such file)."""
    path = run_dir / "warnings.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    for w in lines:
        assert list(w) == WARNING_KEYS, w
    return lines
