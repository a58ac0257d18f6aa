"""The guard in Megatron-core's DistributedDataParallel: a 2-rank megatron-core GPTModel over gloo on the
CPU (see megatron_case.py for exactly what runs and the three CPU stand-ins)."""

import json

import pytest
import torch

from skip import framework

framework("megatron.core", "megatron-core")

import gradbus.megatron as gm  # noqa: E402
from megatron_case import run  # noqa: E402
from test_ddp import same_state  # noqa: E402

SEED_MESSAGE = "found NaN in local grad norm"


def test_version_outside_the_supported_range_is_refused_with_a_hint():
    for ok in ("0.16.1", "0.19.2"):
        gm.check_version(ok)
    for bad in ("0.15.3", "0.20.0", "1.0.0", "dev"):
        with pytest.raises(RuntimeError, match=rf"megatron-core {bad} is not supported.*hint: pip install"):
            gm.check_version(bad)


def test_clean_run_is_megatron_ddp_bitwise(tmp_path):
    plain = run(2, {"steps": 3, "guard": None, "nan_check": False}, str(tmp_path / "plain"))
    guarded = run(2, {"steps": 3, "guard": {"policy": "abort", "run_dir": str(tmp_path / "run")}}, str(tmp_path / "guarded"))
    for r in range(2):
        assert guarded[r]["error"] is None, guarded[r]["error"]
        assert guarded[r]["results"] == [True] * 3
        assert guarded[r]["losses"] == plain[r]["losses"], f"rank {r}: losses differ from Megatron's DDP alone"
        for s, (a, b) in enumerate(zip(plain[r]["snapshots"], guarded[r]["snapshots"])):
            assert same_state(a, b), f"rank {r}: weights or Adam state differ from Megatron's DDP alone before update {s}"
    assert same_state(guarded[0]["snapshots"][-1], guarded[1]["snapshots"][-1]), "replicas differ"
    assert guarded[0]["buckets"] >= 2, "overlap_grad_reduce with bucket_size 8000 makes several buckets"
    assert not (tmp_path / "run" / "report.json").exists()


@pytest.mark.parametrize(
    "config,plant",
    [
        # Megatron's buckets reduced from the backward hooks (overlap_grad_reduce, several buckets).
        ({"overlap": True}, {"rank": 1, "step": 2, "param": "decoder.layers.0.mlp.linear_fc1.weight", "element": 77, "value": "nan"}),
        # ROLL's defaults: no overlap, one bucket of the whole model, reduced in finish_grad_sync.
        ({"overlap": False}, {"rank": 0, "step": 1, "param": "decoder.final_layernorm.weight", "element": 5, "value": "inf"}),
        # The distributed optimizer: reduce-scatter, parameters at padded offsets in the bucket.
        ({"overlap": True, "dist_opt": True}, {"rank": 1, "step": 0, "param": "embedding.word_embeddings.weight", "element": 1000, "value": "nan"}),
        # bf16 (Megatron's Float16Module): bf16 grad buffers (scanned in bf16), and fp32 ones.
        ({"bf16": "bf16-grads"}, {"rank": 1, "step": 0, "param": "module.decoder.layers.1.self_attention.linear_proj.weight", "element": 500, "value": "nan"}),
        ({"bf16": "fp32-grads"}, {"rank": 0, "step": 0, "param": "module.embedding.position_embeddings.weight", "element": 33, "value": "inf"}),
    ],
    ids=["overlap-buckets-nan-rank1", "one-bucket-inf-rank0", "distributed-optimizer-padded-nan-rank1", "bf16-grads-nan-rank1", "bf16-fp32-grads-inf-rank0"],
)
def test_planted_non_finite_aborts_every_rank_with_one_report_naming_megatrons_parameter(tmp_path, capfd, config, plant):
    run_dir = tmp_path / "run"
    case = dict(config, steps=4, guard={"policy": "abort", "run_dir": str(run_dir)}, plants=[plant])
    res = run(2, case, str(tmp_path))
    errors = {r["error"] for r in res}
    assert len(errors) == 1 and None not in errors, f"every rank raises the same error: {errors}"
    msg = errors.pop()
    assert msg.startswith("NonFiniteGradients: gradbus: non-finite gradients"), msg
    assert all(r["results"] == [True] * plant["step"] for r in res), "every rank stopped at the same update"
    report = json.loads((run_dir / "report.json").read_text())
    assert all(r["report"] == report for r in res), "the exception carries report.json's content"
    nan = plant["value"] == "nan"
    assert (report["step"], report["ranks"], report["param"], report["element"]) == (
        plant["step"], [plant["rank"]], plant["param"], plant["element"])
    assert (report["nan"], report["inf"], report["verdict"], report["cause"]) == (int(nan), int(not nan), "abort", "local_gradients")
    assert f"param {plant['param']} element {plant['element']}" in msg and f"rank(s) [{plant['rank']}]" in msg, msg
    out = capfd.readouterr()
    assert SEED_MESSAGE not in out.out + out.err, "Megatron's own fatal check ran"
    for r in res:
        assert all(torch.isfinite(w).all() for w in r["snapshots"][-1]["weights"].values())


def test_skip_leaves_weights_and_optimizer_state_untouched_and_replicas_identical(tmp_path):
    plant = {"rank": 0, "step": 1, "param": "decoder.layers.1.self_attention.linear_qkv.weight", "element": 11, "value": "nan"}
    res = run(2, {"steps": 4, "guard": {"policy": "skip"}, "plants": [plant]}, str(tmp_path))
    for k, r in enumerate(res):
        assert r["error"] is None, r["error"]
        assert r["results"] == [True, False, True, True], f"rank {k}: Megatron's update_successful"
        assert r["skipped"] == 1
        snaps = r["snapshots"]
        assert same_state(snaps[1], snaps[2]), f"rank {k}: the skipped update changed weights or Adam state"
        for s in (0, 2, 3):
            assert not same_state(snaps[s], snaps[s + 1]), f"rank {k}: update {s} did not apply"
        assert all(st["step"] == 3 for st in snaps[-1]["adam"].values()), "Adam's step count excludes the skip"
        for s in range(5):
            assert same_state(snaps[s], res[0]["snapshots"][s]), f"rank {k} differs from rank 0 before update {s}"


def test_megatron_alone_dies_on_one_rank_with_the_seed_message(tmp_path):
    """The baseline the guard replaces: Megatron's own check raises on the rank that sees the NaN,
    and only there; the other rank learns nothing but a broken collective (gloo: the peer closed the
    connection when the failing process exited; NCCL would block until its timeout)."""
    plant = {"rank": 1, "step": 1, "param": "decoder.layers.0.mlp.linear_fc1.weight", "element": 77, "value": "nan"}
    res = run(2, {"steps": 2, "guard": None, "plants": [plant]}, str(tmp_path))
    assert SEED_MESSAGE in (res[1]["error"] or ""), res[1]["error"]
    assert res[0]["error"] is not None and SEED_MESSAGE not in res[0]["error"], res[0]["error"]
