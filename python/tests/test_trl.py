"""The guard in TRL's GRPOTrainer: python/examples/trl_grpo.py (a tiny GPT-2 from a config, GRPO on
stale rollouts) under torchrun, 2 processes, DDP over gloo on the CPU. Nothing is planted: the NaN
comes from the training dynamics (TRL's k3 KL overflowing float32, exp(ref - logp) with ref - logp
past ln(FLT_MAX)), and the tests check that mechanism from each rank's measured exponents."""

import json
import math
import os

from skip import framework

framework("trl", "trl")

import example_run  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "trl_grpo.py")
LN_FLT_MAX = math.log(3.4028234663852886e38)  # 88.72


def torchrun(tmp_path, name, *args):
    return example_run.torchrun(EXAMPLE, tmp_path, name, *args)


def overflow_step(result):
    """The first update whose loss was not finite on this rank, after checking that it is the k3 KL's
    exp that overflowed there and nothing before it: (step, its row)."""
    rows = result["gaps"]
    k = next(i for i, g in enumerate(rows) if not math.isfinite(g["loss"]))
    before, at = rows[:k], rows[k]
    assert k >= 2 and all(g["k3_exponent"] < LN_FLT_MAX for g in before), rows
    assert not math.isfinite(at["loss"]) and at["k3_exponent"] > LN_FLT_MAX, at
    # The PPO ratio's exponent never came near: it is the KL to the reference that overflowed.
    assert all(g["log_ratio"] is None or g["log_ratio"] < 10 for g in rows[: k + 1]), rows
    return at["step"], at


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


def test_guarded_grpo_stops_every_rank_with_the_report(tmp_path):
    rc, out, res = torchrun(tmp_path, "abort", "--policy", "abort")
    assert rc != 0, out
    errors = {r["error"] for r in res}
    assert len(errors) == 1 and None not in errors, errors
    msg = errors.pop()
    report = json.loads((tmp_path / "abort" / "run" / "report.json").read_text())
    # The update where the k3 exponent first passed ln(FLT_MAX), on the ranks where it did.
    overflows = [overflow_step(r) for r in res]
    step = min(s for s, _ in overflows)
    assert report["step"] == step and f"at step {step} " in msg, (report, msg)
    assert report["ranks"] == [k for k, (s, _) in enumerate(overflows) if s == step], report
    assert report["verdict"] == "abort" and report["nan"] > 0 and report["loss_finite"] is False, report
    assert report["param"].startswith("transformer.") and f"param {report['param']} element {report['element']}" in msg
    for k, r in enumerate(res):
        assert f"[rank {k}] {msg}" in out, f"rank {k} did not print the report line"
        assert r["report"] == report
        assert r["global_step"] == step, "stopped before the poisoned update"
    assert res[0]["weights"] == res[1]["weights"] and res[0]["nonfinite_params"] == []
    assert "probability tensor" not in out


def test_on_policy_the_same_run_stays_finite_and_the_guard_leaves_its_bits(tmp_path):
    # One update per generation batch (on-policy): the same learning rate and steps stay far from
    # the overflow, and the guarded run is the GRPOTrainer's alone, bit for bit.
    _, _, plain = torchrun(tmp_path, "plain", "--policy", "none", "--num-iterations", "1")
    rc, out, guarded = torchrun(tmp_path, "guarded", "--policy", "abort", "--num-iterations", "1")
    assert rc == 0, out
    for k in range(2):
        assert guarded[k]["error"] is None and guarded[k]["nonfinite_params"] == []
        assert max(g["k3_exponent"] for g in guarded[k]["gaps"]) < LN_FLT_MAX / 4, guarded[k]["gaps"]
        assert guarded[k]["weights"] == plain[k]["weights"], f"rank {k}: weights differ from the GRPOTrainer alone"
        assert [g["loss"] for g in guarded[k]["gaps"]] == [g["loss"] for g in plain[k]["gaps"]]
        assert [e.get("loss") for e in guarded[k]["log_history"]] == [e.get("loss") for e in plain[k]["log_history"]]
