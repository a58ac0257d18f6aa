"""The guard inside DeepSpeed ZeRO: 2 ranks over gloo on the CPU (DeepSpeed's CPU accelerator), a small
transformer (python/examples/deepspeed_guard.py), ZeRO stages 1, 2 and 3 with fp32, bf16 and fp16.
Every case runs in one pair of processes (deepspeed_case.py: a fresh engine per case), started once
for the module."""

import json

import pytest
from skip import framework

framework("deepspeed", "deepspeed")

import gradbus.deepspeed as gds  # noqa: E402
from deepspeed_case import finite, run, same, same_weights  # noqa: E402

STEPS = 4
SMALL = {"zero_optimization": {"reduce_bucket_size": 3000, "allgather_bucket_size": 3000}}
"""Buckets of at most 3000 elements: ~10 per update instead of one."""
NO_BF16_CHECK = {"bf16": {"check_grad_overflow": False}}
"""bf16 without DeepSpeed's overflow check: the default before 2026-05 (DeepSpeed #8035)."""


def plant(rank, step, param, element, value="nan", micro=0):
    return {"rank": rank, "step": step, "param": param, "element": element, "value": value, "micro": micro}


def case(zero, precision, guard=None, plants=(), steps=STEPS, **kw):
    return dict(zero=zero, precision=precision, guard=guard, plants=list(plants), steps=steps, **kw)


ABORT = {"policy": "abort"}
CLEAN = {
    f"{who}-z{z}-{p}": case(z, p, None if who == "plain" else ABORT, steps=3)
    for z in (1, 2, 3) for p in ("fp32", "bf16", "fp16") for who in ("plain", "guarded")
}
# Many buckets, overlapping reduce, gradient accumulation (ZeRO 2 reduces every micro-batch).
for who in ("plain", "guarded"):
    CLEAN[f"{who}-z2-bf16-buckets-overlap-gas2"] = case(
        2, "bf16", None if who == "plain" else ABORT, steps=3, gas=2,
        ds={"zero_optimization": {"reduce_bucket_size": 3000, "overlap_comm": True}})

ABORTS = {
    "abort-z1-bf16-buckets": (case(1, "bf16", ABORT, plants=[plant(1, 1, "layers.0.linear1.weight", 77)], ds=SMALL),
                              {"rank": 1, "step": 1, "param": "layers.0.linear1.weight", "element": 77, "nan": 1}),
    "abort-z2-fp32-noncontiguous-gas2": (
        case(2, "fp32", ABORT, plants=[plant(0, 2, "head.weight", 5, "inf", micro=1)], gas=2,
             ds={"zero_optimization": {"contiguous_gradients": False}}),
        {"rank": 0, "step": 2, "param": "head.weight", "element": 5, "nan": 0}),
    "abort-z3-bf16-buckets": (case(3, "bf16", ABORT, plants=[plant(1, 0, "layers.1.self_attn.in_proj_weight", 1000)], ds=SMALL),
                              {"rank": 1, "step": 0, "param": "layers.1.self_attn.in_proj_weight", "element": 1000, "nan": 1}),
}

SKIPS = {
    f"skip-z{z}-{p}": case(z, p, {"policy": "skip"}, plants=[plant(0, 1, "tok.weight", 11)])
    for z, p in ((1, "fp32"), (2, "bf16"), (3, "bf16"))
}
SKIPS.update({f"plain-4-z{z}-{p}": case(z, p) for z, p in ((1, "fp32"), (2, "bf16"), (3, "bf16"))})

INF = plant(1, 1, "layers.0.linear1.weight", 77, "inf")
BF16_INF = {
    "bf16-inf-plain": case(2, "bf16", plants=[INF], ds=NO_BF16_CHECK),
    "bf16-inf-guarded": case(2, "bf16", {"policy": "skip"}, plants=[INF], ds=NO_BF16_CHECK),
}
FP16 = {
    "fp16-inf-plain-z2": case(2, "fp16", plants=[INF]),
    "fp16-inf-guarded-z2": case(2, "fp16", ABORT, plants=[INF]),
    "fp16-inf-plain-z3": case(3, "fp16", plants=[INF]),
    "fp16-inf-guarded-z3": case(3, "fp16", ABORT, plants=[INF]),
    "fp16-inf-min-scale": case(2, "fp16", {"policy": "skip", "min_scale": 256.0}, plants=[INF]),
}
OTHER = {
    "zero0-refused": case(0, "fp32", ABORT, steps=1),
    # DeepSpeed #8415: every step skipped. DeepSpeed alone skips without end; the guard's budget stops it.
    "skip-budget": case(2, "bf16", {"policy": "skip", "max_consecutive": 2},
                        plants=[plant(1, s, "layers.1.linear2.weight", 3) for s in range(STEPS)]),
    "skip-budget-plain": case(2, "bf16", plants=[plant(1, s, "layers.1.linear2.weight", 3) for s in range(STEPS)]),
    # The replica check: every update, rank 1's copy of one weight nudged before update 2.
    "replicas": case(1, "fp32", {"policy": "abort", "replica_every": 1},
                     diverge={"rank": 1, "step": 2, "param": "norm.weight", "element": 3, "delta": 1e-3}),
    "replicas-z3-refused": case(3, "fp32", {"policy": "abort", "replica_every": 1}, steps=1),
}

CASES = {**CLEAN, **{k: c for k, (c, _) in ABORTS.items()}, **SKIPS, **BF16_INF, **FP16, **OTHER}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """name -> [result of rank 0, rank 1], every case of this module in one 2-process run."""
    root = tmp_path_factory.mktemp("deepspeed")
    names = list(CASES)
    cases = []
    for n in names:
        c = dict(CASES[n])
        if c["guard"] is not None:
            c["guard"] = dict(c["guard"], run_dir=str(root / n))
        cases.append(c)
    res = run(2, cases, str(root / "out"))
    return {n: r for n, r in zip(names, res)}, root


def test_version_outside_the_supported_range_is_refused_with_a_hint():
    gds.check_version("0.19.8")
    for bad in ("0.18.9", "0.20.0", "1.0.0", "dev"):
        with pytest.raises(RuntimeError, match=rf"deepspeed {bad} is not supported.*hint: pip install 'deepspeed>=0.19,<0.20'"):
            gds.check_version(bad)


def test_policy_rerun_is_refused_with_a_hint():
    with pytest.raises(ValueError, match=r"policy 'rerun'.*engine.step\(\) has none.*hint: policy 'skip' or 'abort'"):
        gds.guard(object(), policy="rerun")


def test_zero_stage_0_is_refused_naming_the_optimizer(results):
    res, _ = results
    for r in res["zero0-refused"]:
        assert r["error"].startswith("NotImplementedError: gradbus.deepspeed: the engine's optimizer"), r["error"]
        assert "ZeRO stage 0" in r["error"] and "hint: ZeRO stage 1, 2 or 3" in r["error"]


@pytest.mark.parametrize("name", [n for n in CLEAN if n.startswith("guarded")])
def test_clean_run_is_deepspeed_alone_bitwise(results, name):
    res, root = results
    guarded, plain = res[name], res[name.replace("guarded", "plain", 1)]
    for r in range(2):
        assert guarded[r]["error"] is None and plain[r]["error"] is None, (guarded[r]["error"], plain[r]["error"])
        assert guarded[r]["losses"] == plain[r]["losses"], f"rank {r}: losses differ from DeepSpeed alone"
        for s, (a, b) in enumerate(zip(plain[r]["snapshots"], guarded[r]["snapshots"])):
            assert same(a, b), f"rank {r}: master weights, weights or Adam state differ from DeepSpeed alone before update {s}"
        assert len(guarded[r]["snapshots"]) == 4
        for key in ("skipped_steps", "lrs", "scales"):
            assert guarded[r][key] == plain[r][key], key
        assert guarded[r]["skipped_steps"] == [0, 0, 0] and guarded[r]["skipped"] == 0
    assert guarded[0]["spans"] == guarded[1]["spans"] and min(guarded[0]["spans"]) >= 1
    if "buckets" in name:
        # 2 micro-batches, each reduced in several buckets of at most 3000 elements.
        assert min(guarded[0]["spans"]) >= 2 * 10, guarded[0]["spans"]
    if "z3" not in name:
        assert same_weights(guarded[0]["snapshots"][-1], guarded[1]["snapshots"][-1]), "replicas differ"
    assert not (root / name / "report.json").exists()


@pytest.mark.parametrize("name", list(ABORTS))
def test_planted_non_finite_is_named_on_every_rank_and_stops_every_rank(results, name):
    res, root = results
    rr, want = res[name], ABORTS[name][1]
    errors = {r["error"] for r in rr}
    assert len(errors) == 1 and None not in errors, f"every rank raises the same error: {errors}"
    msg = errors.pop()
    assert msg.startswith("NonFiniteGradients: gradbus: non-finite gradients"), msg
    assert f"param {want['param']} element {want['element']}" in msg and f"rank(s) [{want['rank']}]" in msg, msg
    report = json.loads((root / name / "report.json").read_text())
    assert all(r["report"] == report for r in rr), "each rank's exception carries report.json's content"
    assert (report["step"], report["ranks"], report["param"], report["element"]) == (want["step"], [want["rank"]], want["param"], want["element"])
    assert (report["nan"], report["inf"], report["verdict"], report["cause"]) == (want["nan"], 1 - want["nan"], "abort", "local_gradients")
    for r in rr:
        # Stopped inside engine.step() of the poisoned update, before DeepSpeed's optimizer ran.
        assert len(r["snapshots"]) == want["step"] + 1 and r["skipped_steps"] == [0] * want["step"]
        assert finite(r["snapshots"][-1])
    if "buckets" in name:
        assert report["bucket"] > 0, "the parameter's bucket is not the first"


@pytest.mark.parametrize("name", [n for n in SKIPS if n.startswith("skip")])
def test_skip_keeps_the_optimizer_and_deepspeeds_bookkeeping(results, name):
    res, _ = results
    plain = res[name.replace("skip", "plain-4", 1)]
    for k, r in enumerate(res[name]):
        assert r["error"] is None, r["error"]
        snaps = r["snapshots"]
        assert same(snaps[1], snaps[2]), f"rank {k}: the skipped update changed master weights, weights or Adam state"
        for s in (0, 2, 3):
            assert not same(snaps[s], snaps[s + 1]), f"rank {k}: update {s} did not apply"
        assert all(st["step"] == 3 for st in snaps[-1]["adam"] if "step" in st), "Adam's step count excludes the skip"
        assert r["skipped_steps"] == [0, 1, 1, 1] and r["skipped"] == 1, "DeepSpeed's skipped_steps counts the guard's skip"
        # The LR schedule does not advance over the skip: one update late from then on.
        assert r["lrs"] == [plain[k]["lrs"][0]] + plain[k]["lrs"][:3], (r["lrs"], plain[k]["lrs"])
        assert snaps[:2] and same(snaps[1], plain[k]["snapshots"][1]), "the run before the skip is DeepSpeed's"
        [(action, report, scale)] = r["skips"]
        assert (action, report["ranks"], report["param"], report["element"], scale) == ("skip", [0], "tok.weight", 11, None)
        assert finite(snaps[-1])
    if "z3" not in name:
        assert same_weights(res[name][0]["snapshots"][-1], res[name][1]["snapshots"][-1]), "replicas differ"


def test_bf16_inf_is_stopped_before_adam_sees_it(results):
    """DeepSpeed #8035: with bf16 and without DeepSpeed's overflow check, one +inf gradient element
    makes Adam write NaN into exp_avg and the master weights; the guard skips that update."""
    res, _ = results
    for r in res["bf16-inf-plain"]:
        assert r["error"] is None and r["skipped_steps"] == [0, 0, 0, 0]
        assert finite(r["snapshots"][1]) and not finite(r["snapshots"][2]), "DeepSpeed alone: Adam took the Inf"
    for r in res["bf16-inf-guarded"]:
        assert r["error"] is None and r["skipped_steps"] == [0, 1, 1, 1] and r["skipped"] == 1
        assert all(finite(s) for s in r["snapshots"])
        assert same(r["snapshots"][1], r["snapshots"][2])
        [(_, report, _)] = r["skips"]
        assert (report["ranks"], report["param"], report["element"], report["inf"]) == ([1], "layers.0.linear1.weight", 77, 1)


@pytest.mark.parametrize("zero", [2, 3])
def test_fp16_overflow_is_deepspeeds_loss_scaler_skip_with_the_report(results, zero):
    """fp16 with DeepSpeed's dynamic loss scaler: a non-finite update is the scaler's overflow, which
    DeepSpeed skips and answers by halving the scale; the guarded run is DeepSpeed's run bitwise,
    scale for scale, and the guard names the rank, parameter and element of the overflow."""
    res, _ = results
    plain, guarded = res[f"fp16-inf-plain-z{zero}"], res[f"fp16-inf-guarded-z{zero}"]
    for k in range(2):
        g, p = guarded[k], plain[k]
        assert g["error"] is None and p["error"] is None, (g["error"], p["error"])
        assert p["scales"] == [256.0, 128.0, 128.0, 128.0] and p["skipped_steps"] == [0, 1, 1, 1]
        for key in ("losses", "scales", "skipped_steps", "lrs"):
            assert g[key] == p[key], key
        assert all(same(a, b) for a, b in zip(g["snapshots"], p["snapshots"]))
        assert g["skipped"] == 1
        [(action, report, scale)] = g["skips"]
        assert (action, report["classification"], scale) == ("skip", "loss-scale", 256.0)
        assert (report["ranks"], report["param"], report["element"], report["inf"]) == ([1], "layers.0.linear1.weight", 77, 1)


def test_fp16_overflow_at_the_minimum_scale_aborts(results):
    res, root = results
    errors = {r["error"] for r in res["fp16-inf-min-scale"]}
    assert len(errors) == 1 and None not in errors, errors
    msg = errors.pop()
    assert "NonFiniteGradients" in msg and "loss scale 256" in msg and "rank(s) [1]" in msg, msg
    assert (root / "fp16-inf-min-scale" / "report.json").exists()


def test_skips_are_bounded_where_deepspeed_skips_without_end(results):
    """DeepSpeed #8415 (every step skipped): DeepSpeed alone skips every poisoned update, naming
    nothing; the guard skips, naming the rank and parameter, up to its budget (here 2 in a row) and
    then stops every rank."""
    res, root = results
    for r in res["skip-budget-plain"]:
        assert r["error"] is None and r["skipped_steps"] == [1, 2, 3, 4]
    errors = {r["error"] for r in res["skip-budget"]}
    assert len(errors) == 1 and None not in errors, errors
    msg = errors.pop()
    assert "step 2 " in msg and "param layers.1.linear2.weight element 3" in msg and "verdict abort (skip-budget)" in msg, msg
    for r in res["skip-budget"]:
        assert r["skipped_steps"] == [1, 2] and r["skipped"] == 2 and [a for a, _, _ in r["skips"]] == ["skip", "skip"]
    assert json.loads((root / "skip-budget" / "report.json").read_text())["verdict"] == "abort"


def test_replica_check_names_the_rank_whose_weights_differ(results):
    """replica_every=1 on ZeRO 1 (every rank holds the whole model): updates 0 and 1 pass the check, a
    weight nudged on rank 1 before update 2 stops every rank with ReplicasDiverged naming rank 1;
    with ZeRO 3 (partitions, no replicas) the keyword is refused."""
    res, root = results
    errors = {r["error"] for r in res["replicas"]}
    assert len(errors) == 1 and None not in errors, errors
    msg = errors.pop()
    assert msg.startswith("ReplicasDiverged: gradbus: replicas differ at step 2: rank(s) [1]"), msg
    assert all(r["skipped_steps"] == [0, 0] for r in res["replicas"])
    assert json.loads((root / "replicas" / "replicas.json").read_text())["ranks"] == [1]
    for r in res["replicas-z3-refused"]:
        assert r["error"].startswith("NotImplementedError: gradbus.deepspeed: replica_every with ZeRO 3"), r["error"]
