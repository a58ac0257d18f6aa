"""The guard in TRL's GRPOTrainer: python/examples/trl_grpo.py (a tiny GPT-2 from a config, GRPO on
stale rollouts) under torchrun, 2 processes, DDP over gloo on the CPU. Nothing is planted: the NaN
comes from the training dynamics (TRL's k3 KL overflowing float32, exp(ref - logp) with ref - logp
past ln(FLT_MAX)), and the tests check that mechanism from each rank's measured exponents; the
guard watches the same exponents (gradbus.hf, no line in the script), warns ahead of the overflow,
and with watch_policy "stop" saves and stops before it.

Several seeds run one after the other in one torchrun (the example's --seed 0,1,...: startup is most
of a run's time); a seed's run there is bitwise the run of that seed alone."""

import json
import math
import os

import pytest

from skip import framework

framework("trl", "trl")

import example_run  # noqa: E402
from example_run import warnings_file  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "trl_grpo.py")
LN_FLT_MAX = math.log(3.4028234663852886e38)  # 88.72
SEEDS = (0, 1, 2, 3, 4)
UPDATES = 10
"""Updates per run: the stale rollouts overflow by update 9 on seeds 0-4; the controls run as long."""


def torchrun(tmp_path, name, *args, seeds=None):
    return example_run.torchrun(EXAMPLE, tmp_path, name, *args, seeds=seeds)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each seed 0-4, guarded (abort, warnings), UPDATES updates: the stale rollouts (the example's
    default), and the two controls: on-policy (--num-iterations 1) and the plain k3
    (--no-kl-bias-correction); and the on-policy runs unguarded."""
    tmp = tmp_path_factory.mktemp("trl")
    steps = ("--steps", str(UPDATES))
    return {
        "stale": torchrun(tmp, "stale", "--policy", "abort", *steps, seeds=SEEDS),
        "on-policy": torchrun(tmp, "on-policy", "--policy", "abort", "--num-iterations", "1", *steps, seeds=SEEDS),
        "plain-k3": torchrun(tmp, "plain-k3", "--policy", "abort", "--no-kl-bias-correction", *steps, seeds=SEEDS),
        "on-policy-alone": torchrun(tmp, "alone", "--policy", "none", "--num-iterations", "1", *steps, seeds=SEEDS),
        "tmp": tmp,
    }


def overflow_step(result):
    """The first update whose loss was not finite on this rank, after checking that it is the k3 KL's
    exp that overflowed there and nothing before it: (step, its row); None when the rank's loss
    stayed finite (the run stopped at another rank's overflow)."""
    rows = result["gaps"]
    k = next((i for i, g in enumerate(rows) if not math.isfinite(g["loss"])), None)
    if k is None:
        assert all(g["k3_exp"] < LN_FLT_MAX for g in rows), rows
        return None
    before, at = rows[:k], rows[k]
    assert k >= 2 and all(g["k3_exp"] < LN_FLT_MAX for g in before), rows
    assert not math.isfinite(at["loss"]) and at["k3_exp"] > LN_FLT_MAX, at
    # The PPO ratio's exponent never came near: it is the KL to the reference that overflowed.
    assert all(g.get("ratio_exp", 0) < 10 for g in rows[: k + 1]), rows
    return at["step"], at


def first_overflow(res):
    """The first update whose loss was not finite on some rank."""
    return min(o[0] for o in map(overflow_step, res) if o is not None)


def test_unguarded_grpo_turns_nonfinite_from_the_k3_kl_overflow(tmp_path):
    rc, out, res = torchrun(tmp_path, "none", "--policy", "none")
    assert rc != 0, out
    steps = [overflow_step(r)[0] for r in res]
    for k, r in enumerate(res):
        s = steps[k]
        # Logged by the Trainer as step s + 1: grad_norm NaN from then on, the KL Inf (or NaN).
        logged = [e for e in r["log_history"] if "grad_norm" in e]
        assert all(math.isfinite(e["grad_norm"]) for e in logged[:s]), f"rank {k}"
        assert all(math.isnan(e["grad_norm"]) for e in logged[s:]) and not math.isfinite(logged[s]["kl"]), f"rank {k}"
        # The optimizer stepped on NaN gradients: every weight NaN on both replicas, and the next
        # generation's sampling fails (the run's only error message, at a later step).
        assert r["nonfinite_params"] and r["global_step"] > s + 1, r["global_step"]
        assert "probability tensor contains either `inf`, `nan` or element < 0" in r["error"], r["error"]
    assert res[0]["weights"] == res[1]["weights"]


def test_guarded_grpo_stops_every_rank_with_the_report(runs):
    rc, out, by_seed = runs["stale"]
    for seed, res in by_seed.items():
        errors = {r["error"] for r in res}
        assert len(errors) == 1 and None not in errors, (seed, errors)
        msg = errors.pop()
        report = json.loads((runs["tmp"] / "stale" / "run" / f"seed-{seed}" / "report.json").read_text())
        # The update where the k3 exponent first passed ln(FLT_MAX), on the ranks where it did.
        overflows = [overflow_step(r) for r in res]
        step = first_overflow(res)
        assert report["step"] == step and f"at step {step} " in msg, (report, msg)
        assert report["ranks"] == [k for k, o in enumerate(overflows) if o is not None and o[0] == step], report
        assert report["verdict"] == "abort" and report["nan"] > 0 and report["loss_finite"] is False, report
        assert report["param"].startswith("transformer.") and f"param {report['param']} element {report['element']}" in msg
        for k, r in enumerate(res):
            assert f"[rank {k}] {msg}" in out, f"seed {seed}: rank {k} did not print the report line"
            assert r["report"] == report
            assert r["global_step"] == step, "stopped before the poisoned update"
        assert res[0]["weights"] == res[1]["weights"] and res[0]["nonfinite_params"] == []
    assert "probability tensor" not in out


def test_the_guard_warns_at_least_two_updates_ahead_on_every_seed(runs):
    _, _, by_seed = runs["stale"]
    ahead = {}
    for seed, res in by_seed.items():
        lines = warnings_file(runs["tmp"] / "stale" / "run" / f"seed-{seed}")
        overflow = first_overflow(res)
        assert lines and lines[0]["update"] <= overflow - 2, (seed, overflow, lines)
        ahead[seed] = overflow - lines[0]["update"]
        for w in lines:
            # The agreed maximum over the ranks' measured exponents, and a rank that holds it.
            measured = [next(g for g in r["gaps"] if g["step"] == w["update"])["k3_exp"] for r in res]
            assert w["quantity"] == "k3_exp" and w["limit"] == LN_FLT_MAX and w["action"] == "warn", w
            assert w["value"] == max(measured) == measured[w["rank"]], (w, measured)
            assert w["limit"] - w["value"] < 0.225 * LN_FLT_MAX or w["forecast_updates"] <= 7, w
        # Every rank keeps the same warnings (what rank 0 wrote).
        assert res[0]["warnings"] == res[1]["warnings"] == lines
    print(f"warned ahead of the overflow, updates per seed: {ahead}")


@pytest.mark.parametrize("control", ["on-policy", "plain-k3"])
def test_the_controls_never_warn(runs, control):
    rc, out, by_seed = runs[control]
    assert rc == 0, out
    for seed, res in by_seed.items():
        assert warnings_file(runs["tmp"] / control / "run" / f"seed-{seed}") == [], (control, seed)
        for r in res:
            assert r["error"] is None and r["global_step"] == UPDATES and r["warnings"] == []
            # Far from the ceiling: the largest exponent a quarter of it or less.
            assert max(g["k3_exp"] for g in r["gaps"]) < LN_FLT_MAX / 4, (control, seed, r["gaps"])


def test_on_policy_the_guard_leaves_the_grpotrainers_bits(runs):
    # The guard (watching the k3 exponent too) leaves the run as the GRPOTrainer alone does it.
    _, _, plain = runs["on-policy-alone"]
    _, _, guarded = runs["on-policy"]
    for seed in SEEDS:
        for k in range(2):
            g, p = guarded[seed][k], plain[seed][k]
            assert g["error"] is None and g["nonfinite_params"] == []
            assert g["weights"] == p["weights"], f"seed {seed}, rank {k}: weights differ from the GRPOTrainer alone"
            assert [x["loss"] for x in g["gaps"]] == [x["loss"] for x in p["gaps"]]
            assert [e.get("loss") for e in g["log_history"]] == [e.get("loss") for e in p["log_history"]]


def test_stop_saves_before_the_overflow_and_a_resume_passes_it(runs, tmp_path):
    # Seed 0, stale rollouts, watch_policy "stop": every rank saves through the Trainer's own
    # checkpoint and stops before the update the forecast says would overflow.
    rc, out, res = torchrun(tmp_path, "stop", "--policy", "abort", "--watch-policy", "stop", "--steps", str(UPDATES))
    assert rc != 0, out
    overflow = first_overflow(runs["stale"][2][0])
    stop = res[0]["stopped"]
    assert stop is not None and stop <= overflow - 2, (stop, overflow)
    lines = warnings_file(tmp_path / "stop" / "run")
    assert lines[-1]["update"] == stop and lines[-1]["action"] == "stop" and lines[-1]["value"] < LN_FLT_MAX, lines
    assert lines[-1]["forecast_updates"] <= 3.5, lines[-1]
    checkpoint = str(tmp_path / "stop" / "run" / f"checkpoint-{stop}")
    for k, r in enumerate(res):
        assert r["stopped"] == stop and r["checkpoint"] == checkpoint and r["error"] == res[0]["error"]
        assert f"[rank {k}] {r['error']}" in out and f"saved {checkpoint}" in r["error"]
        # Before the update: the Trainer's step, the optimizer's state (its step count) and the weights
        # are those after `stop` updates, finite and the same on both ranks.
        assert r["global_step"] == stop and r["optimizer_steps"] == [stop] and r["nonfinite_params"] == []
    assert res[0]["weights"] == res[1]["weights"]
    state = json.loads((tmp_path / "stop" / "run" / f"checkpoint-{stop}" / "trainer_state.json").read_text())
    assert state["global_step"] == stop
    # The resume passes that update and the ones after it: on-policy, and with TRL's plain k3.
    for name, change in [("on-policy", ["--num-iterations", "1"]), ("plain-k3", ["--no-kl-bias-correction"])]:
        rc, out, res = torchrun(tmp_path, name, "--policy", "abort", "--watch-policy", "stop", "--steps", str(UPDATES),
                                "--resume", checkpoint, *change)
        assert rc == 0, out
        for r in res:
            assert r["error"] is None and r["global_step"] == UPDATES and r["nonfinite_params"] == [], (name, r["error"])
            assert [g["step"] for g in r["gaps"]] == list(range(stop, UPDATES)), (name, r["gaps"])
            assert all(math.isfinite(g["loss"]) and g["k3_exp"] < LN_FLT_MAX for g in r["gaps"]), (name, r["gaps"])
            assert r["optimizer_steps"] == [UPDATES]
        assert res[0]["weights"] == res[1]["weights"]
