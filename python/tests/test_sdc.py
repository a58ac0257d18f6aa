"""The guard's silent-data-corruption checks in real 2-rank DDP jobs (gloo, CPU, spawned processes),
with faults planted through hooks (sdc_case.py): the reduced buckets identical across ranks, the
weights identical across ranks (every update or every N), and per-rank outliers - each judged by the
runtime's own rules (collectives/src/sdc.rs) through the native core."""

import json

import pytest

from ddp_case import same_state
from sdc_case import run

STEPS = 8
SDC = {"policy": "abort", "sdc": True, "replica_every": 1}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """Plain DDP (no hook, no guard): the bits every repaired or rerun run must end on."""
    return run(2, {"steps": STEPS, "guard": None}, str(tmp_path_factory.mktemp("plain")))


def same_as_clean(res, clean):
    for k, r in enumerate(res):
        assert r["error"] is None, r["error"]
        assert same_state(r["snapshots"][-1], clean[k]["snapshots"][-1]), f"rank {k}: final state differs from plain DDP"


@pytest.mark.parametrize("agreement", ["auto", "summary"])
def test_clean_runs_make_no_detection_and_are_plain_ddp_bitwise(tmp_path, clean, agreement):
    # "auto" at 2 ranks: the rows ride the last bucket's all-reduce; "summary": two all-reduces of
    # the guard's own, the table only on an anomaly (none here).
    res = run(2, {"steps": STEPS, "guard": dict(SDC, agreement=agreement)}, str(tmp_path))
    for k, r in enumerate(res):
        assert r["detections"] == 0 and r["findings"] == [], r["findings"]
        assert [a for _, _, a in r["verdicts"]] == ["proceed"] * STEPS
        assert r["losses"] == clean[k]["losses"]
        for s, (a, b) in enumerate(zip(clean[k]["snapshots"], r["snapshots"])):
            assert same_state(a, b), f"rank {k}: state differs from plain DDP before update {s}"
        assert set(r["paths"]) == {"ride" if agreement == "auto" else "summary"}


@pytest.mark.parametrize("plain_backward", [False, True])
def test_a_script_that_clips_its_gradients_makes_no_detection(tmp_path, plain_backward):
    # Clipping changes the reduced gradients between the backward and the step, alike on every rank:
    # the guard hashes them as DDP wrote them (guard.backward), or, when the script calls
    # loss.backward() itself, at the step (after the clipping, without the rank's own check).
    case = {"steps": STEPS, "clip": 1e-3, "plain_backward": plain_backward}
    plain = run(2, dict(case, guard=None), str(tmp_path / "plain"))
    res = run(2, dict(case, guard=SDC), str(tmp_path / "guarded"))
    for k, r in enumerate(res):
        assert r["error"] is None and r["detections"] == 0 and r["findings"] == [], (r["error"], r["findings"])
        assert [a for _, _, a in r["verdicts"]] == ["proceed"] * STEPS
        assert same_state(r["snapshots"][-1], plain[k]["snapshots"][-1])


def test_a_reduced_bucket_that_differs_on_one_rank_is_named_and_repaired_to_the_clean_bits(tmp_path, clean):
    # Rank 1's copy of bucket #0's all-reduce result gets bit 22 of element 5 flipped at update 3,
    # after the all-reduce, before DDP copies it into the gradients: its optimizer consumes it. At
    # update 4 every rank's row carries the checksums of the buckets it consumed at update 3: rank
    # 1's differ, and rank 1 knows its own (the consumed bucket is not what its all-reduce returned),
    # so the runtime's rule names it even at 2 ranks; rank 0's state is copied into it and update 4
    # recomputed.
    fault = {"kind": "reduced", "rank": 1, "step": 3, "bucket": 0, "element": 5, "bit": 22}
    res = run(2, {"steps": STEPS, "guard": SDC, "fault": fault}, str(tmp_path))
    same_as_clean(res, clean)
    for r in res:
        assert (4, 0, "repair") in r["verdicts"] and (4, 1, "proceed") in r["verdicts"], r["verdicts"]
        assert r["detections"] == 1
        (step, attempt, finding, _), = r["findings"]
        assert (step, attempt) == (4, 0)
        assert "rank 1: its optimizer consumed a reduced gradient other than the reducers' sum (bucket #0)" in finding, finding
        assert "repaired from rank 0" in finding, finding


@pytest.mark.parametrize("bit", [31, 22, 30])
def test_a_weight_changed_on_one_rank_is_found_by_its_own_check_and_repaired(tmp_path, clean, bit):
    # A flip in a weight between two updates (the sign, a mantissa bit, an exponent bit 0->1 or 1->0)
    # on rank 1: with replica_every=1 every update reads the weights back; rank 1's no longer hash to
    # what its optimizer step wrote, so it is named, repaired from rank 0 and the update recomputed.
    fault = {"kind": "weight", "rank": 1, "step": 5, "param": "mid.weight", "element": 777, "bit": bit}
    res = run(2, {"steps": STEPS, "guard": SDC, "fault": fault}, str(tmp_path))
    same_as_clean(res, clean)
    for r in res:
        assert (5, 0, "repair") in r["verdicts"], r["verdicts"]
        (_, _, finding, _), = r["findings"]
        assert "rank 1: its weights no longer hash to what its optimizer step wrote" in finding, finding


def test_every_n_updates_a_change_seen_late_cannot_be_told_at_2_ranks_and_stops(tmp_path):
    # replica_every=3: the weights are read back at updates 0, 3, 6. A flip before update 1 is used by
    # updates 1 and 2, and rank 1's own check (after update 2's step) sees the flipped weights as its
    # optimizer wrote them: no rank found its own state changed, 2 ranks have no majority, so every
    # rank stops with ReplicasDiverged naming both (the cost of checking every N: see docs/pytorch.md).
    fault = {"kind": "weight", "rank": 1, "step": 1, "param": "mid.weight", "element": 777, "bit": 22}
    guard = {"policy": "abort", "replica_every": 3, "run_dir": str(tmp_path / "run")}
    res = run(2, {"steps": STEPS, "guard": guard, "fault": fault}, str(tmp_path))
    report = json.loads((tmp_path / "run" / "replicas.json").read_text())
    assert (report["step"], report["ranks"], report["donor"]) == (3, [0, 1], None), report
    for r in res:
        assert [v for v in r["verdicts"]] == [(0, 0, "proceed"), (1, 0, "proceed"), (2, 0, "proceed")]
        assert r["error_type"] == "ReplicasDiverged" and r["report"] == report
        assert "no rank can be told healthy" in r["error"], r["error"]


def test_a_transient_outlier_gradient_is_named_and_rerun_to_the_clean_bits(tmp_path, clean):
    # Rank 1's local gradient of mid.weight element 1234 times 2^40 at update 6 (an exponent bit
    # 0->1), on the first execution only: the outlier rule flags rank 1's bucket, the update is
    # rerun, the rerun is clean (transient): its gradients are used, rank 1 is suspect.
    fault = {"kind": "grad", "rank": 1, "step": 6, "param": "mid.weight", "element": 1234, "scale": 2.0 ** 40}
    res = run(2, {"steps": STEPS, "guard": SDC, "fault": fault}, str(tmp_path))
    same_as_clean(res, clean)
    for r in res:
        assert (6, 0, "rerun") in r["verdicts"] and (6, 1, "proceed") in r["verdicts"], r["verdicts"]
        assert r["suspects"] == [1] and r["detections"] == 1
        first, second = r["findings"]
        assert first[:2] == (6, 0) and "rank 1 bucket #" in first[2], first
        report = second[3]
        assert (report["cause"], report["classification"], report["ranks"]) == ("outlier", "transient", [1])


def test_a_deterministic_outlier_gradient_is_judged_by_the_policy_with_its_report(tmp_path):
    # The same on both executions: deterministic; policy "abort": OutlierGradients on every rank,
    # report.json naming rank 1, the bucket, mid.weight element 1234.
    fault = {"kind": "grad", "rank": 1, "step": 6, "param": "mid.weight", "element": 1234, "scale": 2.0 ** 40,
             "attempts": [0, 1]}
    guard = dict(SDC, run_dir=str(tmp_path / "run"))
    res = run(2, {"steps": STEPS, "guard": guard, "fault": fault}, str(tmp_path))
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert (report["cause"], report["classification"], report["ranks"]) == ("outlier", "deterministic", [1])
    assert (report["param"], report["element"], report["step"], report["attempt"]) == ("mid.weight", 1234, 6, 1)
    for r in res:
        assert r["error_type"] == "OutlierGradients" and r["report"] == report, r["error"]
        assert r["verdicts"][-1] == (6, 0, "rerun")
        assert "rank(s) [1]" in r["error"] and "mid.weight element 1234" in r["error"], r["error"]
