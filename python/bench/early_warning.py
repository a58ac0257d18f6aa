"""How far ahead the guard warns and stops, on both RL examples (python/examples/trl_grpo.py: TRL's
GRPOTrainer; python/examples/grpo_loop.py: a plain PyTorch GRPO loop), seeds 0-4, 2 ranks under
torchrun, and how close the controls come: the numbers behind the forecast rule's thresholds
(collectives/src/forecast.rs, `Rule::default_for`; docs/pytorch.md and docs/hf-trainer.md).

    python python/bench/early_warning.py [--example loop|trl|both] [--updates 10] [--out DIR]

Per example, four runs of every seed (each a torchrun of the example with --seed 0,1,2,3,4):
stale rollouts (the default) with the guard warning, the same with --watch-policy stop, and the
controls --num-iterations 1 (on-policy) and --no-kl-bias-correction (plain k3), as long. Printed:
per seed, the first update whose k3 exponent (the largest over the ranks) passed ln(FLT_MAX), the
first warning and the stop, how many updates before the overflow, the exponent at the stop; per
control and seed, the largest exponent, the shortest forecast (`_core.forecasts`, the guard's own
forecast over the agreed maxima) and the warnings. Not a speed benchmark: nothing is timed.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

from gradbus import _core

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = {"trl": "trl_grpo.py", "loop": "grpo_loop.py"}
LIMIT = _core.exp_ceiling("float32")
SEEDS = [0, 1, 2, 3, 4]
RUNS = {"stale": [], "stop": ["--watch-policy", "stop"], "on-policy": ["--num-iterations", "1"],
        "plain-k3": ["--no-kl-bias-correction"]}


def run(example, name, extra, updates, out):
    """Each seed's [rank 0's, rank 1's] results of one torchrun."""
    d = os.path.join(out, example, name)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(HERE, "..", "examples", EXAMPLES[example]), "--policy", "abort", "--steps", str(updates),
           "--seed", ",".join(map(str, SEEDS)), "--run-dir", os.path.join(d, "run"), "--out", d, *extra]
    subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    return {s: [json.load(open(os.path.join(d, f"seed-{s}", f"result-rank{r}.json"))) for r in range(2)] for s in SEEDS}


def agreed(res):
    """Per update, the k3 exponent's largest value over the ranks (inf once the loss was not finite)."""
    out = []
    for a, b in zip(res[0]["gaps"], res[1]["gaps"]):
        x = max(a["k3_exp"], b["k3_exp"])
        out.append(x if math.isfinite(a["loss"]) and math.isfinite(b["loss"]) or x > LIMIT else math.inf)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--example", choices=["loop", "trl", "both"], default="both")
    ap.add_argument("--updates", type=int, default=10)
    ap.add_argument("--out", default=None, help="where the runs go (default: a temporary folder)")
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="early-warning-")
    for example in (["loop", "trl"] if a.example == "both" else [a.example]):
        got = {name: run(example, name, extra, a.updates, out) for name, extra in RUNS.items()}
        print(f"{EXAMPLES[example]}: k3 exponent ref - logp, the largest over 2 ranks, {a.updates} updates per run")
        print("| seed | overflow at update | first warning (updates before) | stop (updates before) | exponent at the stop |")
        print("|---|---|---|---|---|")
        for s in SEEDS:
            x = agreed(got["stale"][s])
            over = next((u for u, v in enumerate(x) if not v < LIMIT), None)
            warned = [w["update"] for w in got["stale"][s][0]["warnings"]]
            stop = got["stop"][s][0]["stopped"]
            ahead = (lambda u: "-" if u is None or over is None else f"{u} ({over - u})")
            at_stop = "-" if stop is None else f"{x[stop]:.1f}"
            print(f"| {s} | {over} | {ahead(warned[0] if warned else None)} | {ahead(stop)} | {at_stop} |")
        print("| control | seed | largest exponent | shortest forecast (updates) | warnings |")
        print("|---|---|---|---|---|")
        for name in ("on-policy", "plain-k3"):
            for s in SEEDS:
                x = agreed(got[name][s])
                f = [u for u in _core.forecasts(x, LIMIT) if u is not None]
                short = f"{min(f):.1f}" if f else "none"
                print(f"| {name} | {s} | {max(x):.1f} | {short} | {len(got[name][s][0]['warnings'])} |")
        print()


if __name__ == "__main__":
    main()
