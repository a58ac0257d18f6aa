"""The native core without a process group: the zero-copy scan, the torch-ops scan (the CUDA path,
run here on CPU tensors), the agreement on hand-made tables, and the errors for bad input."""

import json

import pytest
import torch

import gradbus
from gradbus.torch import Guard, _torch_health


def planted(n, bad, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 10.0
    for i, v in bad:
        x[i] = v
    return x


@pytest.mark.parametrize(
    "n,bad",
    [
        (1, []),
        (1000, []),
        (5000, [(4097, float("nan"))]),
        (3000, [(2999, float("inf")), (17, float("-inf")), (1500, float("nan"))]),
        (2048, [(0, float("nan")), (1, float("nan"))]),
    ],
)
def test_rust_scan_reads_the_tensor_in_place_and_agrees_with_the_torch_scan(n, bad):
    x = planted(n, bad)
    nan, inf, sumsq, first = gradbus.scan_f32(x.data_ptr(), x.numel())
    want_nan = sum(v != v for _, v in bad)
    assert (nan, inf) == (want_nan, len(bad) - want_nan)
    assert first == (min(i for i, _ in bad) if bad else None)
    finite = x[torch.isfinite(x)].double()
    assert sumsq == pytest.approx(float((finite * finite).sum()), rel=1e-12)
    t = _torch_health(x).tolist()
    assert t[:2] == [nan, inf] and t[3] == (-1 if first is None else first)
    assert t[2] == pytest.approx(sumsq, rel=1e-12)


def test_rust_scan_of_a_view_reads_only_the_view():
    x = planted(100, [(10, float("nan")), (60, float("inf"))])
    v = x[50:]  # a view at a storage offset: data_ptr() points at element 50
    nan, inf, _, first = gradbus.scan_f32(v.data_ptr(), v.numel())
    assert (nan, inf, first) == (0, 1, 10)


def test_rust_scan_rejects_a_misaligned_address():
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="not aligned"):
        gradbus.scan_f32(x.data_ptr() + 1, 2)
    assert gradbus.scan_f32(0, 0) == (0, 0, 0.0, None)


def cells(rows):
    """A gathered table from per-rank lists of (nan, inf, sumsq, first_bad) cells plus a loss."""
    flat = []
    for cs, loss in rows:
        for c in cs:
            flat.extend(c)
        flat.append(loss)
    return flat


LAYOUT = [[("head.weight", 40), ("head.bias", 8)], [("mid.weight", 100)]]


def test_agreement_names_rank_bucket_param_and_element():
    a = gradbus.Agreement("abort")
    ok = (0.0, 0.0, 1.0, -1.0)
    table = cells([([ok, ok], 0.5), ([ok, (0.0, 2.0, 1.0, 42.0)], 0.5), ([ok, ok], float("nan"))])
    action, report, spike = a.decide(table, 3, LAYOUT, 7, 0)
    r = json.loads(report)
    assert (action, spike) == ("abort", None)
    assert (r["step"], r["ranks"], r["bucket"], r["param"], r["element"], r["inf"]) == (7, [1], 1, "mid.weight", 42, 2)
    assert r["loss_finite"] is False
    # Bucket 0: element 45 of the bucket is head.bias[5].
    b = gradbus.Agreement("abort")
    _, report, _ = b.decide(cells([([(1.0, 0.0, 0.0, 45.0), ok], 0.1)]), 1, LAYOUT, 0, 0)
    assert (json.loads(report)["param"], json.loads(report)["element"]) == ("head.bias", 5)


def test_agreement_rejects_a_table_of_the_wrong_shape_and_bad_counts():
    a = gradbus.Agreement("skip")
    with pytest.raises(ValueError, match="expected 2 ranks x \\(2 buckets x 4 \\+ 1\\)"):
        a.decide([0.0] * 9, 2, LAYOUT, 0, 0)
    with pytest.raises(ValueError, match="rank 0 bucket #1: nan is -1"):
        a.decide(cells([([(0.0, 0.0, 0.0, -1.0), (-1.0, 0.0, 0.0, -1.0)], 0.0)]), 1, LAYOUT, 0, 0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"policy": "ignore"}, "policy 'ignore'"),
        ({"scan": "gpu"}, "scan 'gpu'"),
        ({"policy": "skip", "max_fraction": 2.0}, "max_fraction 2"),
        ({"spike": "maybe"}, 'spike "maybe"'),
    ],
)
def test_bad_guard_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Guard(**kwargs)


def test_verdict_without_a_backward_says_how_to_register_the_hook():
    with pytest.raises(RuntimeError, match="register_comm_hook"):
        Guard().verdict()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_torch_scan_counts_other_dtypes_exactly(dtype):
    # The path of CUDA and non-float32 buckets, here on CPU tensors.
    x = planted(3000, [(2500, float("nan")), (1200, float("inf")), (1201, float("-inf"))]).to(dtype)
    nan, inf, sumsq, first = _torch_health(x).tolist()
    assert (nan, inf, first) == (1, 2, 1200)
    finite = x[torch.isfinite(x)].double()
    assert sumsq == pytest.approx(float((finite * finite).sum()), rel=1e-9)


def test_spike_skip_skips_an_agreed_loss_spike_with_the_runtime_detector():
    a = gradbus.Agreement("abort", spike="skip", spike_window=4, z_limit=3.0)
    ok = (0.0, 0.0, 1.0, -1.0)
    actions = []
    for loss in [1.0, 1.1, 0.9, 1.0, 1.05, 50.0, 1.0]:
        action, report, spike = a.decide(cells([([ok, ok], loss), ([ok, ok], loss)]), 2, LAYOUT, len(actions), 0)
        actions.append((action, spike is not None and spike.startswith("loss spike 50.0000")))
        assert report is None
    assert actions == [("proceed", False)] * 5 + [("skip", True), ("proceed", False)]
    assert a.skipped == 1
