"""The guard in real multi-process DDP jobs (gloo, CPU, 2-3 processes spawned per test)."""

import json
import re

import pytest
import torch

from ddp_case import run, same_state
from gradbus import _core

# The runtime's report.json fields (collectives/src/verdict.rs, `Report`): the guard serialises the
# same Rust type, so a drift in either shows here.
REPORT_KEYS = {
    "step", "minibatch", "attempt", "verdict", "ranks", "bucket", "param", "element",
    "nan", "inf", "per_rank", "loss_finite", "classification", "cause",
    "format", "gradbus", "crc32c",  # sealed by the worker's artifact code, as the runtime's report.json is
}


def test_clean_run_is_plain_ddp_bitwise(tmp_path):
    # 3 ranks: the division by the world size is inexact, so the built-in path and the hook's must
    # divide the same way for the bits to match.
    plain = run(3, {"steps": 4, "guard": None}, str(tmp_path / "plain"))
    # The replica check on every update changes no bit either.
    guard = {"policy": "abort", "run_dir": str(tmp_path / "run"), "replica_every": 1, "agreement": "summary"}
    guarded = run(3, {"steps": 4, "guard": guard}, str(tmp_path / "guarded"))
    # The default, agreement="auto": the cost model's path for 3 ranks and these buckets, the same bits.
    auto = run(3, {"steps": 4, "guard": dict(guard, agreement="auto")}, str(tmp_path / "auto"))
    # The default without a replica check: the scan path, no collective of the guard's on any update
    # (nothing is appended to DDP's all-reduces: its bits at any world size), no loss exchanged.
    scan = run(3, {"steps": 4, "guard": {"policy": "abort"}}, str(tmp_path / "scan"))
    for r in range(3):
        s = scan[r]
        assert s["error"] is None and s["verdicts"] == ["proceed"] * 4 and s["paths"] == ["scan"] * 4
        # The hook's fast path (`Guard._fast`) from the third update on: the first learns DDP's
        # buckets, the second the buckets DDP has rebuilt; the same bits.
        assert s["fast"] == s["fast_verdicts"] == [False, False, True, True], (s["fast"], s["fast_verdicts"])
        assert s["tabled"] == 0 and s["row_losses"] == [None] * 4 and s["verdict_losses"] == [None] * 4
        assert s["losses"] == plain[r]["losses"]
        for a, b in zip(plain[r]["snapshots"], s["snapshots"]):
            assert same_state(a, b), f"rank {r}: the scan path's weights or Adam state differ from plain DDP"
        assert guarded[r]["error"] is None
        assert guarded[r]["tabled"] == 0, "healthy updates are decided from the summary alone"
        assert guarded[r]["paths"] == ["summary"] * 4
        model = [_core.cheaper_path(3, n) for n in auto[r]["buckets"]]
        assert auto[r]["paths"] == model and auto[r]["tabled"] == model.count("table"), (auto[r], model)
        assert auto[r]["losses"] == plain[r]["losses"] and same_state(auto[r]["snapshots"][-1], plain[r]["snapshots"][-1])
        assert guarded[r]["verdicts"] == ["proceed"] * 4
        assert guarded[r]["losses"] == plain[r]["losses"], f"rank {r}: losses differ from plain DDP"
        for s, (a, b) in enumerate(zip(plain[r]["snapshots"], guarded[r]["snapshots"])):
            assert same_state(a, b), f"rank {r}: weights or Adam state differ from plain DDP before update {s}"
    assert all(same_state(g["snapshots"][-1], guarded[0]["snapshots"][-1]) for g in guarded), "replicas differ"
    # The layout really has several buckets to map back (after DDP's rebuild at the second step).
    assert max(guarded[0]["buckets"]) >= 2, guarded[0]["buckets"]
    assert not (tmp_path / "run" / "report.json").exists()


@pytest.mark.parametrize("hook", [None, "fp16_compress", "bf16_compress"])
def test_at_two_ranks_the_rows_ride_the_last_buckets_all_reduce_and_the_run_is_ddps_bitwise(tmp_path, hook):
    # agreement="auto" at 2 ranks: every rank's row rides the last bucket's all-reduce (no collective
    # of the guard's), in 16-bit chunks of float32 or 8-bit chunks of the compressed bucket; the
    # gradients are DDP's (or its compression hook's) to the bit, and every update's rows (here each
    # rank's loss) reach every rank.
    case = {"steps": 4, "hook": hook}
    plain = run(2, dict(case, guard=None), str(tmp_path / "plain"))
    guarded = run(2, dict(case, guard={"policy": "abort", "replica_every": 1}), str(tmp_path / "guarded"))
    for r in range(2):
        g, p = guarded[r], plain[r]
        assert g["error"] is None and g["verdicts"] == ["proceed"] * 4
        assert g["paths"] == ["ride"] * 4 and g["tabled"] == 4, (g["paths"], g["tabled"])
        assert g["losses"] == p["losses"]
        for s, (a, b) in enumerate(zip(p["snapshots"], g["snapshots"])):
            assert same_state(a, b), f"rank {r}: weights or Adam state differ from plain DDP before update {s}"
        assert g["row_losses"] == [[guarded[k]["losses"][s] for k in range(2)] for s in range(4)]
    assert max(guarded[0]["buckets"]) >= 2, guarded[0]["buckets"]


# A finite float32 gradient that the cast makes Inf: past fp16's 65504, or rounded up past bf16's
# largest finite value (3.3895e38).
@pytest.mark.parametrize("hook,big", [("fp16_compress", "1e5"), ("bf16_compress", "3.4e38")])
def test_the_scan_path_under_the_compression_hooks_is_ddps_bitwise_and_names_a_cast_overflow(tmp_path, hook, big):
    # The scan path scans the cast bucket before the division and the cast sum widened back: a
    # clean run is DDP's compression hook to the bit, and a value past the cast's range (an Inf
    # after the cast) is named on every rank, found from the sum's scan alone.
    case = {"steps": 3, "hook": hook}
    plain = run(2, dict(case, guard=None), str(tmp_path / "plain"))
    clean = run(2, dict(case, guard={"policy": "abort"}), str(tmp_path / "clean"))
    for r in range(2):
        c = clean[r]
        assert c["error"] is None and c["paths"] == ["scan"] * 3 and c["tabled"] == 0, (c["paths"], c["error"])
        assert c["losses"] == plain[r]["losses"]
        for a, b in zip(plain[r]["snapshots"], clean[r]["snapshots"]):
            assert same_state(a, b), f"rank {r}: state differs from DDP's {hook} hook"
    plant = {"rank": 1, "step": 1, "param": "mid.weight", "element": 99, "value": big}
    res = run(2, dict(case, guard={"policy": "abort"}, plants=[plant]), str(tmp_path / "planted"))
    for r in res:
        assert r["paths"] == ["scan"] and r["report"] is not None, (r["paths"], r["error"])
        assert (r["report"]["ranks"], r["report"]["param"], r["report"]["element"], r["report"]["inf"]) == ([1], "mid.weight", 99, 1)


@pytest.mark.parametrize(
    "plant,scan,agreement",
    [
        ({"rank": 1, "step": 2, "param": "mid.weight", "element": 4321, "value": "nan"}, "auto", "summary"),
        ({"rank": 2, "step": 1, "param": "inp.bias", "element": 7, "value": "inf"}, "auto", "summary"),
        # scan="torch": the tallies of CUDA buckets (torch ops on the bucket's device), here on the CPU.
        ({"rank": 0, "step": 3, "param": "head.weight", "element": 4095, "value": "-inf"}, "torch", "summary"),
        # The table on every update (the guard before the summary): the same report.
        ({"rank": 1, "step": 2, "param": "mid.weight", "element": 4321, "value": "nan"}, "auto", "table"),
        # The rows riding the last bucket's all-reduce (forced at 3 ranks): the same report.
        ({"rank": 2, "step": 1, "param": "inp.bias", "element": 7, "value": "inf"}, "auto", "ride"),
        # The scan path (the default without spike detection, sdc, watches or a replica check): the
        # reduced sums' scan finds the anomaly on every rank alike, and the rows gathered then name it.
        ({"rank": 1, "step": 2, "param": "mid.weight", "element": 4321, "value": "nan"}, "auto", "auto"),
        ({"rank": 0, "step": 3, "param": "head.weight", "element": 4095, "value": "-inf"}, "torch", "auto"),
    ],
    ids=["nan-mid-rank1", "inf-first-layer-rank2", "neg-inf-head-rank0-torch-scan", "nan-mid-rank1-table", "inf-rank2-ride",
         "nan-mid-rank1-scan", "neg-inf-head-rank0-torch-scan-path"],
)
def test_planted_non_finite_aborts_every_rank_with_one_report_naming_it(tmp_path, plant, scan, agreement):
    run_dir = tmp_path / "run"
    guard = {"policy": "abort", "run_dir": str(run_dir), "scan": scan, "agreement": agreement}
    res = run(3, {"steps": 4, "guard": guard, "plants": [plant]}, str(tmp_path))
    errors = {r["error"] for r in res}
    assert len(errors) == 1 and None not in errors, f"every rank raises the same error: {errors}"
    assert all(len(r["verdicts"]) == plant["step"] for r in res), "every rank stopped at the same update"
    if agreement == "auto":
        assert all(r["paths"] == ["scan"] * plant["step"] for r in res), [r["paths"] for r in res]
        # The poisoned update took the hook's fast path where it scans in place (scan "auto", from
        # the third update on): its tallies are handed to the general path, which names the same.
        fast = [scan == "auto" and s >= 2 for s in range(plant["step"] + 1)]
        assert all(r["fast"] == fast and r["fast_verdicts"] == fast[:-1] for r in res), [(r["fast"], r["fast_verdicts"]) for r in res]
    report = json.loads((run_dir / "report.json").read_text())
    assert all(r["report"] == report for r in res), "the exception carries report.json's content"
    assert set(report) == REPORT_KEYS
    nan = plant["value"] == "nan"
    assert (report["step"], report["ranks"], report["param"], report["element"]) == (
        plant["step"], [plant["rank"]], plant["param"], plant["element"])
    assert (report["nan"], report["inf"], report["verdict"], report["loss_finite"]) == (int(nan), int(not nan), "abort", True)
    assert report["cause"] == "local_gradients", report
    assert report["format"] == 3 and re.fullmatch(r"[0-9a-f]{8}", report["crc32c"]), report
    assert set(report["gradbus"]) == {"version", "commit"}, report
    assert report["per_rank"] == [{"rank": plant["rank"], "nan": int(nan), "inf": int(not nan), "first_bucket": report["bucket"], "samples": []}]
    msg = errors.pop()
    assert f"param {plant['param']} element {plant['element']}" in msg and f"rank(s) [{plant['rank']}]" in msg, msg
    # Weights and Adam state after the raise are those before the poisoned update (it was never
    # applied), finite, and the same on every replica.
    for r in res:
        assert same_state(r["after_error"], r["snapshots"][-1]), "the poisoned update changed the state"
        assert all(torch.isfinite(w).all() for w in r["after_error"]["weights"].values())
        assert same_state(r["after_error"], res[0]["after_error"])


def test_the_scan_path_with_gradients_as_bucket_views_is_ddps_bitwise_and_names_a_planted_nan(tmp_path):
    # The scan path's verdict reads the reduced sums from the buckets (`Guard.reduced_sums`); with
    # gradient_as_bucket_view=True the buckets are the gradients the optimizer reads. The clean
    # updates are plain DDP's bits; the poisoned one is named on every rank.
    plant = {"rank": 1, "step": 2, "param": "mid.weight", "element": 4321, "value": "nan"}
    case = {"steps": 4, "bucket_view": True}
    plain = run(3, dict(case, guard=None), str(tmp_path / "plain"))
    res = run(3, dict(case, guard={"policy": "abort", "run_dir": str(tmp_path / "run")}, plants=[plant]), str(tmp_path / "guarded"))
    for r in range(3):
        g = res[r]
        assert g["paths"] == ["scan"] * 2 and g["verdicts"] == ["proceed"] * 2, (g["paths"], g["verdicts"])
        assert g["losses"][:3] == plain[r]["losses"][:3]
        for a, b in zip(plain[r]["snapshots"][:3], g["snapshots"]):
            assert same_state(a, b), f"rank {r}: the scan path's weights or Adam state differ from plain DDP"
        assert g["report"] is not None and (g["report"]["step"], g["report"]["ranks"], g["report"]["param"], g["report"]["element"]) == (
            2, [1], "mid.weight", 4321), g["report"]
        assert same_state(g["after_error"], g["snapshots"][-1]), "the poisoned update changed the state"


def test_skip_leaves_weights_and_adam_state_untouched_and_replicas_identical(tmp_path):
    plant = {"rank": 2, "step": 2, "param": "mid.bias", "element": 3, "value": "nan"}
    res = run(3, {"steps": 5, "guard": {"policy": "skip"}, "plants": [plant]}, str(tmp_path))
    for k, r in enumerate(res):
        assert r["error"] is None
        assert r["verdicts"] == ["proceed", "proceed", "skip", "proceed", "proceed"], f"rank {k}"
        assert r["skipped"] == 1
        snaps = r["snapshots"]  # snaps[s]: before update s
        assert same_state(snaps[2], snaps[3]), f"rank {k}: the skipped update changed weights or Adam state"
        for s in (0, 1, 3, 4):
            assert not same_state(snaps[s], snaps[s + 1]), f"rank {k}: update {s} did not apply"
        assert all(st["step"] == 4 for st in snaps[-1]["adam"].values()), "Adam's step count excludes the skip"
        for s in range(6):
            assert same_state(snaps[s], res[0]["snapshots"][s]), f"rank {k} differs from rank 0 before update {s}"


def test_skip_is_bounded_then_aborts_with_skip_budget(tmp_path):
    plants = [{"rank": 1, "step": s, "param": "inp.weight", "element": 0, "value": "nan"} for s in (1, 2, 3)]
    guard = {"policy": "skip", "max_consecutive": 2, "run_dir": str(tmp_path / "run")}
    res = run(2, {"steps": 5, "guard": guard, "plants": plants}, str(tmp_path))
    for r in res:
        assert r["verdicts"] == ["proceed", "skip", "skip"]
        assert r["report"]["classification"] == "skip-budget" and r["report"]["step"] == 3
    assert json.loads((tmp_path / "run" / "report.json").read_text())["verdict"] == "abort"


def test_rerun_transient_proceeds_as_a_clean_run_and_deterministic_aborts(tmp_path):
    clean = run(2, {"steps": 3, "guard": {"policy": "rerun"}}, str(tmp_path / "clean"))
    # Transient: the NaN appears on the first attempt of update 1 only.
    plant = {"rank": 0, "step": 1, "param": "head.bias", "element": 5, "value": "nan", "attempts": [0]}
    res = run(2, {"steps": 3, "guard": {"policy": "rerun"}, "plants": [plant]}, str(tmp_path / "transient"))
    for k, r in enumerate(res):
        assert r["verdicts"] == ["proceed", "rerun", "proceed", "proceed"], f"rank {k}"
        # The rerun's attempt takes the rows' path; the next update the scan path again, on the
        # hook's fast path.
        assert r["paths"] == ["scan", "scan", "ride", "scan"], r["paths"]
        assert r["fast"] == r["fast_verdicts"] == [False, False, False, True], (r["fast"], r["fast_verdicts"])
        assert r["suspects"] == [0]
        assert same_state(r["snapshots"][-1], clean[k]["snapshots"][-1]), "the recomputed update is the clean one"
    # Deterministic: the same NaN on the rerun too.
    plant = dict(plant, attempts=[0, 1])
    res = run(2, {"steps": 3, "guard": {"policy": "rerun", "run_dir": str(tmp_path / "run")}, "plants": [plant]}, str(tmp_path / "det"))
    for r in res:
        assert r["verdicts"] == ["proceed", "rerun"]
        assert (r["report"]["classification"], r["report"]["attempt"], r["report"]["param"]) == ("deterministic", 1, "head.bias")


@pytest.mark.parametrize("call", ["backward", "step"])
def test_a_call_out_of_turn_on_the_fast_path_is_refused_as_on_the_general_path(tmp_path, call):
    # A second backward before the verdict, or a second verdict without a backward, on an update
    # that took the hook's fast path (step 2) and on one that did not (step 0): the same refusal.
    want = {
        "backward": "a second backward before the verdict on the first",
        "step": "no gradients were exchanged since the last verdict",
    }[call]
    for step, fast in ((0, [False]), (2, [False, False, True])):
        res = run(2, {"steps": 4, "guard": {"policy": "abort"}, "twice": {"step": step, "call": call}}, str(tmp_path / f"{call}{step}"))
        for r in res:
            assert r["fast"] == fast and r["misuse"] is not None and want in r["misuse"], (r["fast"], r.get("misuse"))


def test_a_replica_that_differs_is_named_and_repaired_from_a_healthy_rank(tmp_path):
    # A weight nudged on rank 1 before update 2; replica_every=2 reads the weights back at update 2.
    # The runtime's replica rule (collectives/src/sdc.rs): rank 1's weights no longer hash to what
    # its optimizer step wrote (its own check) and differ from the majority's; rank 0's weights and
    # Adam state are copied into it and update 2 recomputed: the run ends on plain DDP's bits.
    diverge = {"rank": 1, "step": 2, "param": "mid.weight", "element": 5, "delta": 1e-3}
    guard = {"policy": "abort", "run_dir": str(tmp_path / "run"), "replica_every": 2}
    res = run(3, {"steps": 5, "guard": guard, "diverge": diverge}, str(tmp_path / "guarded"))
    plain = run(3, {"steps": 5, "guard": None}, str(tmp_path / "plain"))
    for k, r in enumerate(res):
        assert r["error"] is None, r["error"]
        assert r["verdicts"] == ["proceed", "proceed", "repair", "proceed", "proceed", "proceed"], r["verdicts"]
        assert same_state(r["snapshots"][-1], plain[k]["snapshots"][-1]), f"rank {k}: not plain DDP's final state"
    assert not (tmp_path / "run" / "replicas.json").exists()
