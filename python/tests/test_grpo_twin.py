"""The guard on a real training script: bench/pytorch_grpo.py, the PyTorch DDP twin of the runtime's
GRPO workload (gloo, CPU, 2 processes), on examples/roll-193.toml made fast for CI: a higher learning
rate (3e-2) drives the trainer away from stale rollouts (synced every 200 steps) until ROLL's loss
(exp first, mask after) overflows, and the gradients turn NaN from the training dynamics alone
(at RL step 13 with today's twin) while the loss stays finite - ROLL's "found NaN in local grad norm". Without the guard the
script trains on with NaN weights (`loss nan` from then on); these tests run it with the guard."""

import json
import os
import re
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TWIN = [sys.executable, os.path.join(ROOT, "bench", "pytorch_grpo.py"), os.path.join(ROOT, "examples", "roll-193.toml"),
        "--np", "2", "--set", "optim.lr=3e-2"]


def twin(*args):
    r = subprocess.run(TWIN + list(args), capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    return r, f"command: {' '.join(TWIN + list(args))}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"


def test_nan_from_dynamics_stops_every_rank_with_the_same_report(tmp_path):
    run_dir = tmp_path / "run"
    r, log = twin("--set", "rollout_sync_interval=200", "--set", "steps=30", "--guard", "abort", "--run-dir", str(run_dir))
    assert r.returncode == 3, log
    # Not anchored to lines: the two processes share the pipe, and their lines may interleave.
    lines = re.findall(r"\[rank (\d)\] (gradbus: non-finite gradients .*?report\.json)", r.stdout)
    assert sorted(k for k, _ in lines) == ["0", "1"], log
    assert lines[0][1] == lines[1][1], "every rank states the same verdict"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["verdict"] == "abort" and report["nan"] > 0 and report["ranks"], report
    assert report["loss_finite"], "ROLL's signature: a finite loss, NaN gradients"
    assert f"param {report['param']} element {report['element']}" in lines[0][1]
    # Named as the model names it (Gpt's named_parameters()), not as a bucket offset.
    assert re.fullmatch(r"(wte|wpe|head|ln_f|blocks\.\d+\.\w+)\.(weight|bias)", report["param"]), report["param"]
    # Stopped inside the RL step of the failing update (reports count updates): the step before it
    # finished, that one did not, and no loss went NaN before the stop.
    with open(TWIN[2], "rb") as f:
        rl = tomllib.load(f)["rl"]
    step = report["step"] // (rl["epochs"] * rl["minibatches"])
    assert step > 0 and f"step {step - 1} done" in r.stdout and f"step {step} done" not in r.stdout, log
    assert "loss nan" not in r.stdout, log


def test_skip_trains_on_past_the_nan_with_identical_finite_replicas(tmp_path):
    out = tmp_path / "out.json"
    # The rollout weights are synced at step 20, which ends the overflow; the skips before are
    # allowed by a loose budget (the runtime's skip.* keys).
    r, log = twin("--set", "rollout_sync_interval=20", "--set", "steps=24", "--guard", "skip",
                  "--set", "skip.max_consecutive=1000", "--set", "skip.max_fraction=1.0", "--out", str(out))
    assert r.returncode == 0, log
    res = json.loads(out.read_text())
    assert res["skipped"] > 0, res
    assert res["replicas_identical"] and res["params_finite"], res
    assert "loss nan" not in r.stdout.split("step 20 done")[1], log
