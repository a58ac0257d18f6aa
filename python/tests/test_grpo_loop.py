"""The guard's early warning, stop and quarantine in a plain PyTorch GRPO loop that uses the API directly
(python/examples/grpo_loop.py) under torchrun, 2 processes, DDP over gloo on the CPU: on stale
rollouts the k3 exponent climbs until exp overflows; the guard warns at least 2 updates ahead on
seeds 0-4 and never on the on-policy and plain-k3 controls; the stop saves before the overflow and a
resume passes; an empty response (per-sequence normalisation 0/0) is named by the report, quarantined,
and the resume without it passes; a clean guarded run is the unguarded run bit for bit."""

import json
import math
import os

import pytest

import example_run
from example_run import warnings_file

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "grpo_loop.py")
LN_FLT_MAX = math.log(3.4028234663852886e38)
SEEDS = (0, 1, 2, 3, 4)
UPDATES = 10
"""Updates per run: the stale rollouts overflow by update 8 on seeds 0-4; the controls run as long."""


def torchrun(tmp_path, name, *args, seeds=None):
    return example_run.torchrun(EXAMPLE, tmp_path, name, "--steps", str(UPDATES), *args, seeds=seeds)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo")
    return {
        "stale": torchrun(tmp, "stale", seeds=SEEDS),
        "on-policy": torchrun(tmp, "on-policy", "--num-iterations", "1", seeds=SEEDS),
        "plain-k3": torchrun(tmp, "plain-k3", "--no-kl-bias-correction", seeds=SEEDS),
        "on-policy-alone": torchrun(tmp, "alone", "--policy", "none", "--num-iterations", "1", seeds=SEEDS),
        "tmp": tmp,
    }


def agreed(res, key="k3_exp"):
    """Per update, the largest value over the two ranks."""
    return [max(a[key], b[key]) for a, b in zip(res[0]["gaps"], res[1]["gaps"])]


def overflow(res):
    """The first update whose k3 exponent passed ln(FLT_MAX) on some rank (its loss non-finite there)."""
    x = agreed(res)
    u = next(i for i, v in enumerate(x) if not v < LN_FLT_MAX)
    assert u >= 2 and not any(math.isfinite(r["gaps"][u]["loss"]) for r in res if r["gaps"][u]["k3_exp"] > LN_FLT_MAX)
    return u


def test_warnings_come_two_updates_ahead_on_every_seed(runs):
    _, out, by_seed = runs["stale"]
    ahead = {}
    for seed, res in by_seed.items():
        u = overflow(res)
        lines = warnings_file(runs["tmp"] / "stale" / "run" / f"seed-{seed}")
        assert lines and lines[0]["update"] <= u - 2, (seed, u, lines)
        ahead[seed] = u - lines[0]["update"]
        x = agreed(res)
        for w in lines:
            assert w["quantity"] in ("k3_exp", "ratio_exp") and w["limit"] == LN_FLT_MAX, w
            if w["quantity"] == "k3_exp":
                assert w["value"] == x[w["update"]] == res[w["rank"]]["gaps"][w["update"]]["k3_exp"], w
        # Then the guard's abort at the overflow, on every rank, before the optimizer took it.
        assert {r["report"]["step"] for r in res} == {u} and res[0]["weights"] == res[1]["weights"]
        assert all(r["optimizer_steps"] == [u] and r["nonfinite_params"] == [] for r in res)
    print(f"warned ahead of the overflow, updates per seed: {ahead}")


@pytest.mark.parametrize("control", ["on-policy", "plain-k3"])
def test_the_controls_never_warn(runs, control):
    rc, out, by_seed = runs[control]
    assert rc == 0, out
    for seed, res in by_seed.items():
        assert warnings_file(runs["tmp"] / control / "run" / f"seed-{seed}") == [], (control, seed)
        assert all(r["error"] is None and r["warnings"] == [] and len(r["gaps"]) == UPDATES for r in res)
        assert max(agreed(res)) < LN_FLT_MAX / 3, (control, seed, agreed(res))


def test_a_clean_guarded_run_is_the_unguarded_run_bit_for_bit(runs):
    for seed in SEEDS:
        for g, p in zip(runs["on-policy"][2][seed], runs["on-policy-alone"][2][seed]):
            assert g["weights"] == p["weights"] and [x["loss"] for x in g["gaps"]] == [x["loss"] for x in p["gaps"]], seed


def test_stop_saves_before_the_overflow_and_a_resume_passes_it(runs, tmp_path):
    rc, out, res = torchrun(tmp_path, "stop", "--watch-policy", "stop")
    assert rc != 0
    u = overflow(runs["stale"][2][0])
    stop = res[0]["stopped"]
    assert stop is not None and stop <= u - 2, (stop, u)
    checkpoint = str(tmp_path / "stop" / "run" / "checkpoint.pt")
    for k, r in enumerate(res):
        assert r["stopped"] == stop and r["checkpoint"] == checkpoint and f"[rank {k}] {r['error']}" in out
        assert r["optimizer_steps"] == [stop] and r["nonfinite_params"] == [] and len(r["gaps"]) == stop + 1
    assert res[0]["weights"] == res[1]["weights"] and os.path.exists(checkpoint)
    last = warnings_file(tmp_path / "stop" / "run")[-1]
    assert (last["update"], last["action"]) == (stop, "stop") and last["value"] < LN_FLT_MAX
    # The resume with the plain k3 (whose gradient pulls the policy back) passes that update and the rest.
    rc, out, res = torchrun(tmp_path, "resumed", "--no-kl-bias-correction", "--resume", checkpoint)
    assert rc == 0, out
    for r in res:
        assert r["error"] is None and [g["update"] for g in r["gaps"]] == list(range(stop, UPDATES))
        assert all(math.isfinite(g["loss"]) and g["k3_exp"] < LN_FLT_MAX for g in r["gaps"]), r["gaps"]
        assert r["optimizer_steps"] == [UPDATES] and r["nonfinite_params"] == []
    assert res[0]["weights"] == res[1]["weights"]


def test_an_empty_response_is_named_quarantined_and_the_resume_passes(runs, tmp_path):
    # The sample rank 1 draws at update 2 of the clean on-policy run gets an empty response budget.
    clean = runs["on-policy"][2][0]
    bad = clean[1]["gaps"][2]["ids"][0]
    rc, out, res = torchrun(tmp_path, "empty", "--num-iterations", "1", "--empty-response", str(bad))
    assert rc != 0
    run_dir = tmp_path / "empty" / "run"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["step"] == 2 and report["ranks"] == [1] and report["loss_finite"] is False, report
    assert report["per_rank"] == [dict(report["per_rank"][0], samples=[bad])], report
    assert all(r["report"] == report and f"rank 1 samples [{bad}]" in r["error"] for r in res)
    assert all(r["optimizer_steps"] == [2] and r["nonfinite_params"] == [] for r in res)
    # Up to the poisoned update the run is the clean run.
    assert [g["loss"] for g in res[0]["gaps"][:2]] == [g["loss"] for g in clean[0]["gaps"][:2]]
    q = [json.loads(x) for x in (run_dir / "quarantine.jsonl").read_text().splitlines()]
    assert [(x["update"], x["rank"], x["verdict"], x["samples"]) for x in q] == [(2, 1, "abort", [bad])]
    # The resume from the state before update 2 leaves the sample out and passes.
    rc, out, res = torchrun(tmp_path, "empty", "--num-iterations", "1", "--empty-response", str(bad),
                            "--resume", res[0]["checkpoint"])
    assert rc == 0, out
    for r in res:
        assert r["error"] is None and r["left_out"] == [bad] and [g["update"] for g in r["gaps"]] == list(range(2, UPDATES))
        assert all(math.isfinite(g["loss"]) and bad not in g["ids"] for g in r["gaps"]), r["gaps"]
    assert res[0]["weights"] == res[1]["weights"]


def test_a_skip_names_the_empty_responses_sample_too(runs, tmp_path):
    bad = runs["on-policy"][2][0][1]["gaps"][2]["ids"][0]
    rc, out, res = torchrun(tmp_path, "skip", "--policy", "skip", "--num-iterations", "1", "--empty-response", str(bad))
    assert rc == 0, out
    for r in res:
        assert len(r["skips"]) == 1 and r["skips"][0]["step"] == 2 and r["skips"][0]["verdict"] == "skip"
        assert [p["samples"] for p in r["skips"][0]["per_rank"]] == [[bad]], r["skips"]
    q = [json.loads(x) for x in (tmp_path / "skip" / "run" / "quarantine.jsonl").read_text().splitlines()]
    assert [(x["update"], x["rank"], x["verdict"], x["samples"]) for x in q] == [(2, 1, "skip", [bad])]
