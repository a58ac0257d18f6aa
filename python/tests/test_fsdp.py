"""The guard in FSDP2 (`fully_shard`) jobs: 2-3 processes on a 1-D CPU mesh over gloo."""

import json

import pytest
import torch

from fsdp_case import run
from test_ddp import same_state


def test_clean_run_is_fsdp2_bitwise(tmp_path):
    plain = run(3, {"steps": 3, "guard": None}, str(tmp_path / "plain"))
    guarded = run(3, {"steps": 3, "guard": {"policy": "abort", "run_dir": str(tmp_path / "run")}}, str(tmp_path / "guarded"))
    for r in range(3):
        assert guarded[r]["error"] is None, guarded[r]["error"]
        assert guarded[r]["verdicts"] == ["proceed"] * 3
        assert guarded[r]["losses"] == plain[r]["losses"], f"rank {r}: losses differ from FSDP2 alone"
        for s, (a, b) in enumerate(zip(plain[r]["snapshots"], guarded[r]["snapshots"])):
            assert same_state(a, b), f"rank {r}: weights or Adam state differ from FSDP2 alone before update {s}"
    assert not (tmp_path / "run" / "report.json").exists()


@pytest.mark.parametrize(
    "plant,scan",
    [
        # Element 4000 of mid.lin.weight (67x67, rows 23 per shard at 3 ranks): in the second shard.
        ({"rank": 1, "step": 2, "param": "mid.lin.weight", "element": 4000, "value": "nan"}, "auto"),
        # The last element of a padded parameter (67 rows -> 3 shards of 23, one padding row).
        ({"rank": 2, "step": 1, "param": "inp.lin.bias", "element": 66, "value": "inf"}, "auto"),
        # The root module's own parameters; torch-ops scan (the path of CUDA and non-float32 buffers).
        ({"rank": 0, "step": 0, "param": "head.weight", "element": 300, "value": "-inf"}, "torch"),
    ],
    ids=["nan-mid-rank1", "inf-padded-last-rank2", "neg-inf-root-rank0-torch-scan"],
)
def test_planted_non_finite_aborts_every_rank_naming_parameter_and_element(tmp_path, plant, scan):
    run_dir = tmp_path / "run"
    res = run(3, {"steps": 4, "guard": {"policy": "abort", "run_dir": str(run_dir), "scan": scan}, "plants": [plant]}, str(tmp_path))
    errors = {r["error"] for r in res}
    assert len(errors) == 1 and None not in errors, f"every rank raises the same error: {errors}"
    assert all(len(r["verdicts"]) == plant["step"] for r in res), "every rank stopped at the same update"
    report = json.loads((run_dir / "report.json").read_text())
    assert all(r["report"] == report for r in res)
    nan = plant["value"] == "nan"
    assert (report["step"], report["ranks"], report["param"], report["element"]) == (
        plant["step"], [plant["rank"]], plant["param"], plant["element"])
    assert (report["nan"], report["inf"], report["verdict"], report["loss_finite"]) == (int(nan), int(not nan), "abort", True)
    msg = errors.pop()
    assert f"param {plant['param']} element {plant['element']}" in msg and f"rank(s) [{plant['rank']}]" in msg, msg
    for r in res:
        assert all(torch.isfinite(w).all() for w in r["snapshots"][-1]["weights"].values())


def test_skip_keeps_weights_and_optimizer_state(tmp_path):
    plant = {"rank": 0, "step": 1, "param": "mid.lin.bias", "element": 3, "value": "nan"}
    res = run(2, {"steps": 4, "guard": {"policy": "skip"}, "plants": [plant]}, str(tmp_path))
    for k, r in enumerate(res):
        assert r["error"] is None, r["error"]
        assert r["verdicts"] == ["proceed", "skip", "proceed", "proceed"], f"rank {k}"
        assert r["skipped"] == 1
        snaps = r["snapshots"]
        assert same_state(snaps[1], snaps[2]), f"rank {k}: the skipped update changed weights or Adam state"
        for s in (0, 2, 3):
            assert not same_state(snaps[s], snaps[s + 1]), f"rank {k}: update {s} did not apply"
        assert all(int(st["step"]) == 3 for st in snaps[-1]["adam"].values()), "Adam's step count excludes the skip"
    for s in range(5):
        assert res[0]["snapshots"][s]["weights"].keys() == res[1]["snapshots"][s]["weights"].keys()
        for n, w in res[0]["snapshots"][s]["weights"].items():
            assert torch.equal(w, res[1]["snapshots"][s]["weights"][n]), f"full weights differ across ranks before update {s}"
