"""The guard in a Hugging Face Trainer run: python/examples/hf_trainer.py (a tiny GPT-2 from a config)
under torchrun, 2 processes, DDP over gloo on the CPU."""

import json
import math
import os

import pytest

from skip import framework

framework("transformers", "transformers")

import example_run  # noqa: E402
import gradbus.hf as ghf  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "hf_trainer.py")
PARAM = "transformer.h.1.mlp.c_fc.weight"
STEPS = 6


def torchrun(tmp_path, name, *args):
    """Run the example under torchrun; (exit code, output, [result of rank 0, rank 1])."""
    return example_run.torchrun(EXAMPLE, tmp_path, name, "--steps", str(STEPS), *args)


def steps_of(result):
    return [e for e in result["log_history"] if "loss" in e]


def test_version_outside_the_supported_range_is_refused_with_a_hint():
    ghf.check_version("5.24.0")
    for bad in ("4.57.6", "6.0.0"):
        with pytest.raises(RuntimeError, match=rf"transformers {bad} is not supported.*hint: pip install"):
            ghf.check_version(bad)


def test_policy_rerun_is_refused_with_a_hint():
    with pytest.raises(ValueError, match=r"policy 'rerun'.*the Trainer has none.*hint: policy 'skip' or 'abort'"):
        ghf.guard(object(), policy="rerun")


def test_planted_nan_stops_every_rank_with_the_report(tmp_path):
    rc, out, res = torchrun(tmp_path, "abort", "--policy", "abort", "--plant", f"1:3:{PARAM}:42")
    assert rc != 0, out
    errors = {r["error"] for r in res}
    assert len(errors) == 1 and None not in errors, errors
    msg = errors.pop()
    assert f"param {PARAM} element 42" in msg and "rank(s) [1]" in msg and "step 3 " in msg, msg
    for r in (0, 1):
        assert f"[rank {r}] {msg}" in out, f"rank {r} did not print the report line"
    report = json.loads((tmp_path / "abort" / "run" / "report.json").read_text())
    assert (report["step"], report["ranks"], report["param"], report["element"], report["nan"]) == (3, [1], PARAM, 42, 1)
    assert all(r["report"] == report for r in res)
    assert all(r["global_step"] == 3 and r["optimizer_steps"] == [3] for r in res), "stopped before the poisoned update"
    assert res[0]["weights"] == res[1]["weights"] and res[0]["nonfinite_params"] == []


def test_clean_run_is_the_trainer_alone_bitwise(tmp_path):
    _, _, plain = torchrun(tmp_path, "plain", "--policy", "none")
    rc, out, guarded = torchrun(tmp_path, "guarded", "--policy", "abort")
    assert rc == 0, out
    for r in range(2):
        assert guarded[r]["weights"] == plain[r]["weights"], f"rank {r}: weights differ from the Trainer alone"
        assert [e["loss"] for e in steps_of(guarded[r])] == [e["loss"] for e in steps_of(plain[r])]
        assert [e["gradbus_skipped"] for e in steps_of(guarded[r])] == [0] * STEPS


def test_skip_keeps_the_trainers_step_counter_lr_schedule_and_logs_consistent(tmp_path):
    _, _, clean = torchrun(tmp_path, "clean", "--policy", "skip")
    rc, out, res = torchrun(tmp_path, "skip", "--policy", "skip", "--plant", f"1:3:{PARAM}:42")
    assert rc == 0, out
    lr = [e["learning_rate"] for e in steps_of(clean[0])]
    for k, r in enumerate(res):
        assert r["error"] is None and r["skipped"] == 1
        # The Trainer's own bookkeeping of a skipped update, as for an fp16 overflow: global_step
        # counts it, the LR scheduler and the optimizer (its step count) do not.
        assert r["global_step"] == STEPS and r["scheduler_steps"] == STEPS - 1 and r["optimizer_steps"] == [STEPS - 1]
        logged = steps_of(r)
        assert [e["step"] for e in logged] == list(range(1, STEPS + 1)), f"rank {k}: one log entry per global step"
        # Step 4 (global step 3, skipped) logs the LR it would have used; the schedule then resumes
        # from where it stood, one step behind the clean run's.
        assert [e["learning_rate"] for e in logged] == lr[:4] + lr[3:STEPS - 1], f"rank {k}"
        assert math.isnan(logged[3]["grad_norm"]) and all(math.isfinite(e["grad_norm"]) for i, e in enumerate(logged) if i != 3)
        assert [e["gradbus_skipped"] for e in logged] == [0, 0, 0, 1, 1, 1]
    assert res[0]["weights"] == res[1]["weights"], "replicas differ"
    assert res[0]["weights"] != clean[0]["weights"] and res[0]["nonfinite_params"] == []


def test_fp16_clean_run_is_the_trainer_alone_bitwise_and_an_overflow_is_the_scalers(tmp_path):
    # fp16 with accelerate's GradScaler (on the CPU the example attaches autocast and the scaler as
    # accelerate does on a GPU). A clean run: the Trainer's bits. A NaN: the scaler's overflow,
    # skipped on every rank, the scale halved, recorded with its report, the LR schedule held.
    _, _, plain = torchrun(tmp_path, "plain", "--fp16", "--policy", "none")
    rc, out, clean = torchrun(tmp_path, "clean", "--fp16", "--policy", "skip")
    assert rc == 0, out
    scale = plain[0]["loss_scale"]
    assert scale is not None, "the Trainer ran without a GradScaler"
    for r in range(2):
        assert clean[r]["weights"] == plain[r]["weights"], f"rank {r}: weights differ from the Trainer alone"
        assert [e["loss"] for e in steps_of(clean[r])] == [e["loss"] for e in steps_of(plain[r])]
        assert clean[r]["skips"] == [] and clean[r]["loss_scale"] == scale
    rc, out, res = torchrun(tmp_path, "overflow", "--fp16", "--policy", "skip", "--plant", f"1:3:{PARAM}:42")
    assert rc == 0, out
    lr = [e["learning_rate"] for e in steps_of(plain[0])]
    for k, r in enumerate(res):
        assert r["error"] is None, r["error"]
        (s,) = r["skips"]
        assert (s["step"], s["ranks"], s["param"], s["element"], s["nan"]) == (3, [1], PARAM, 42, 1), s
        assert (s["classification"], s["verdict"], s["loss_scale"]) == ("loss-scale", "skip", scale), s
        assert r["loss_scale"] == scale / 2, "the scaler lowered its scale once"
        assert r["global_step"] == STEPS and r["scheduler_steps"] == STEPS - 1 and r["optimizer_steps"] == [STEPS - 1]
        logged = steps_of(r)
        assert [e["loss"] for e in logged[:4]] == [e["loss"] for e in steps_of(plain[k])[:4]]
        assert [e["learning_rate"] for e in logged] == lr[:4] + lr[3:STEPS - 1], f"rank {k}: LR schedule not held"
        assert [e["gradbus_skipped"] for e in logged] == [0, 0, 0, 1, 1, 1]
    assert res[0]["skips"] == res[1]["skips"]
    assert res[0]["weights"] == res[1]["weights"] and res[0]["nonfinite_params"] == []


def test_fp16_overflow_at_the_scale_floor_stops_every_rank_with_the_report(tmp_path):
    rc, out, res = torchrun(tmp_path, "floor", "--fp16", "--policy", "skip", "--min-scale", "65536",
                            "--plant", f"1:3:{PARAM}:42")
    assert rc != 0, out
    errors = {r["error"] for r in res}
    assert len(errors) == 1 and None not in errors, errors
    msg = errors.pop()
    assert f"param {PARAM} element 42" in msg and "loss scale 65536" in msg and "verdict abort (loss-scale)" in msg, msg
    report = json.loads((tmp_path / "floor" / "run" / "report.json").read_text())
    assert (report["step"], report["ranks"], report["classification"]) == (3, [1], "loss-scale")
    assert all(r["global_step"] == 3 and r["optimizer_steps"] == [3] for r in res), "stopped before the poisoned update"
    assert res[0]["weights"] == res[1]["weights"] and res[0]["nonfinite_params"] == []
