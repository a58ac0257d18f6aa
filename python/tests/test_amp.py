"""Mixed precision with the guard in real DDP jobs (gloo, CPU, 2-3 spawned processes): fp16 autocast
with torch.amp.GradScaler (overflows are the scaler's: skipped, the scale lowered, recorded; the
floor aborts), bf16 autocast, bf16 parameters (bf16 buckets) and DDP's fp16 compression hook, each
against the same run without the guard."""

import json

from ddp_case import run, same_state


def assert_same_run(plain, guarded):
    for r, (p, g) in enumerate(zip(plain, guarded)):
        assert g["error"] is None, g["error"]
        assert g["losses"] == p["losses"], f"rank {r}: losses differ from the run without the guard"
        assert g["scales"] == p["scales"], f"rank {r}: loss scales differ"
        for s, (a, b) in enumerate(zip(p["snapshots"], g["snapshots"])):
            assert same_state(a, b), f"rank {r}: weights or Adam state differ before update {s}"


def test_fp16_overflows_are_skipped_as_the_gradscaler_skips_them_bitwise(tmp_path):
    # A loss scale far too large for fp16 (2^19 here, where 2^16 never overflows): the first updates
    # overflow, the scaler halves the scale until they do not.
    case = {"steps": 6, "amp": "fp16", "scaler": {"init_scale": 2.0 ** 19}}
    plain = run(2, dict(case, guard=None), str(tmp_path / "plain"))
    guard = {"policy": "abort", "run_dir": str(tmp_path / "run"), "agreement": "summary"}
    guarded = run(2, dict(case, guard=guard), str(tmp_path / "guarded"))
    assert_same_run(plain, guarded)
    for g in guarded:
        v, o = g["verdicts"], g["overflows"]
        assert "skip" in v and "proceed" in v, v
        assert o == [a == "skip" for a in v], "every skip is an overflow"
        assert g["skipped"] == v.count("skip") and g["tabled"] == v.count("skip"), "the table only on an overflow"
        # The scale drops exactly at the skips (and each skip is recorded with its report).
        scales = [2.0 ** 19] + g["scales"]
        assert [b < a for a, b in zip(scales, scales[1:])] == o
        assert [s[0] for s in g["skips"]] == [k for k, a in enumerate(v) if a == "skip"]
        for step, action, scale, report in g["skips"]:
            assert (action, report["verdict"], report["classification"], report["step"]) == ("skip", "skip", "loss-scale", step)
            assert scale == scales[step] and report["ranks"], report
    assert guarded[0]["skips"] == guarded[1]["skips"], "every rank made the same decision with the same report"
    assert not (tmp_path / "run" / "report.json").exists()


def test_fp16_overflow_at_the_scale_floor_aborts_every_rank_with_a_report(tmp_path):
    run_dir = tmp_path / "run"
    guard = {"policy": "skip", "run_dir": str(run_dir), "min_scale": 2.0 ** 37}
    res = run(2, {"steps": 8, "amp": "fp16", "scaler": {"init_scale": 2.0 ** 40}, "guard": guard}, str(tmp_path))
    report = json.loads((run_dir / "report.json").read_text())
    assert (report["verdict"], report["classification"], report["step"]) == ("abort", "loss-scale", 3)
    for r in res:
        assert r["verdicts"] == ["skip"] * 3, "2^40, 2^39, 2^38 skipped; the overflow at 2^37 aborts"
        assert r["report"] == report and r["error_type"] == "NonFiniteGradients"
        assert "loss scale 1.37439e+11; verdict abort (loss-scale)" in r["error"], r["error"]
        assert all(same_state(r["snapshots"][0], s) for s in r["snapshots"]), "no update was applied"


def test_bf16_autocast_runs_unchanged_and_a_nan_is_named(tmp_path):
    case = {"steps": 3, "amp": "bf16"}
    plain = run(3, dict(case, guard=None), str(tmp_path / "plain"))
    guarded = run(3, dict(case, guard={"policy": "abort"}), str(tmp_path / "guarded"))
    assert_same_run(plain, guarded)
    assert all(g["verdicts"] == ["proceed"] * 3 for g in guarded)
    plant = {"rank": 2, "step": 1, "param": "mid.weight", "element": 777, "value": "nan"}
    res = run(3, dict(case, guard={"policy": "skip"}, plants=[plant]), str(tmp_path / "nan"))
    for r in res:
        assert r["verdicts"] == ["proceed", "skip", "proceed"]
        (_, _, _, rep), = r["skips"]
        assert (rep["ranks"], rep["param"], rep["element"], rep["nan"], rep["classification"]) == ([2], "mid.weight", 777, 1, None)


def test_bf16_buckets_are_scanned_in_bf16_and_a_clean_run_is_plain_ddp_bitwise(tmp_path):
    case = {"steps": 3, "dtype": "bfloat16"}
    plain = run(3, dict(case, guard=None), str(tmp_path / "plain"))
    plant = {"rank": 0, "step": 2, "param": "head.weight", "element": 100, "value": "-inf"}
    guarded = run(3, dict(case, guard={"policy": "skip"}, plants=[plant]), str(tmp_path / "guarded"))
    for p, g in zip(plain, guarded):
        assert g["verdicts"] == ["proceed", "proceed", "skip"]
        assert g["losses"] == p["losses"]
        assert all(same_state(a, b) for a, b in zip(p["snapshots"][:3], g["snapshots"][:3]))
        (_, _, _, rep), = g["skips"]
        assert (rep["ranks"], rep["param"], rep["element"], rep["inf"]) == ([0], "head.weight", 100, 1)


def test_fp16_compression_is_ddps_hook_bitwise_and_its_overflow_is_caught(tmp_path):
    case = {"steps": 3, "hook": "fp16_compress"}
    plain = run(3, dict(case, guard=None), str(tmp_path / "plain"))
    guarded = run(3, dict(case, guard={"policy": "abort"}), str(tmp_path / "guarded"))
    assert_same_run(plain, guarded)
    # 1e6 is finite in the float32 gradient, Inf once compressed to fp16: the guard scans what is reduced.
    plant = {"rank": 1, "step": 1, "param": "inp.bias", "element": 9, "value": 1e6}
    res = run(2, dict(case, guard={"policy": "abort"}, plants=[plant]), str(tmp_path / "big"))
    for r in res:
        assert (r["report"]["ranks"], r["report"]["param"], r["report"]["element"]) == ([1], "inp.bias", 9)
        assert (r["report"]["inf"], r["report"]["nan"]) == (1, 0)
