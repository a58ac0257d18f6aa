"""The native core without a process group: the zero-copy scan, the torch-ops scan (the CUDA path,
run here on CPU tensors), the agreement on hand-made tables, and the errors for bad input."""

import json
import struct

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


SCANNED = [
    (1, []),
    (1000, []),
    (5000, [(4097, float("nan"))]),
    (3000, [(2999, float("inf")), (17, float("-inf")), (1500, float("nan"))]),
    (2048, [(0, float("nan")), (1, float("nan"))]),
    # Past DETACH_AT (1M elements): the scan runs with the GIL released.
    ((1 << 20) + 3, [((1 << 20) + 1, float("-inf"))]),
]


@pytest.mark.parametrize("n,bad", SCANNED)
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
    if not bad:  # the torch scan's sum of squares covers finite buckets only (float32 accumulation)
        assert t[2] == pytest.approx(sumsq, rel=1e-5)


@pytest.mark.parametrize("n,bad", SCANNED)
def test_the_fused_scale_scan_is_the_scan_then_torchs_mul_and_the_finite_check_the_scans_verdict(n, bad):
    # The DDP hook's pre-division fused with its scan (scale_scan_f32, which returns the guard's
    # cell: floats, first_bad -1.0 for none), and the check of a reduced sum (finite_f32): the same
    # cell as scan_f32 of the unscaled tensor and the same bits as
    # torch's mul_ (1/3: a world size that is not a power of two), past DETACH_AT too.
    x = planted(n, bad)
    want = gradbus._core.scan_f32(x.data_ptr(), x.numel())
    assert gradbus._core.finite_f32(x.data_ptr(), x.numel()) == (not bad)
    product = x.clone().mul_(1.0 / 3)
    cell = gradbus._core.scale_scan_f32(x.data_ptr(), x.numel(), 1.0 / 3)
    assert cell == (float(want[0]), float(want[1]), want[2], -1.0 if want[3] is None else float(want[3]))
    assert all(type(f) is float for f in cell)
    assert torch.equal(x.view(torch.int32), product.view(torch.int32))
    assert gradbus._core.finite_f32(0, 0) and gradbus._core.scale_scan_f32(0, 0, 0.5) == (0.0, 0.0, 0.0, -1.0)
    with pytest.raises(ValueError, match="not aligned"):
        gradbus._core.finite_f32(x.data_ptr() + 1, 1)


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


def test_the_hooks_fast_path_tallies_the_learnt_buckets_in_turn_and_hands_over_the_rest():
    # `_core.ScanPath` (the DDP hook's fast path on the scan path's healthy updates): each bucket in
    # turn, as learnt, is pre-divided and scanned in one pass (scale_scan_f32's cell and bits); the
    # sums' check drops the tallies when every bucket came and every sum is finite; otherwise the
    # tallies go to the general path (`take`), and nothing is done to a bucket not as learnt.
    a, b = planted(1000, [(17, 1e30)], seed=1), planted((1 << 20) + 3, [], seed=2)
    fast = gradbus._core.ScanPath([a, b], [a.data_ptr(), b.data_ptr()], [a.numel(), b.numel()], 1.0 / 3)
    assert fast.buckets == 2

    def cell(x):  # scan_f32's health as the guard records it
        nan, inf, sumsq, first = gradbus._core.scan_f32(x.data_ptr(), x.numel())
        return (float(nan), float(inf), sumsq, -1.0 if first is None else float(first))

    def tallied():  # both buckets in turn: their cells before the pre-division, and its bits
        want = [(cell(x), x.clone().mul_(1.0 / 3)) for x in (a, b)]
        assert fast.tally(0, a.data_ptr(), a.numel()) and fast.tally(1, b.data_ptr(), b.numel())
        assert all(torch.equal(x.view(torch.int32), w.view(torch.int32)) for x, (_, w) in zip((a, b), want))
        return [c for c, _ in want]

    before = a.clone()
    assert not fast.tally(1, b.data_ptr(), b.numel()), "bucket 1 before bucket 0"
    assert not fast.tally(0, a.data_ptr(), a.numel() - 1) and not fast.tally(0, b.data_ptr(), a.numel()), "not as learnt"
    assert not fast.healthy(), "a sums' check before every bucket came"
    assert torch.equal(a.view(torch.int32), before.view(torch.int32)) and fast.take() == [], "refused: nothing done"
    tallied()
    assert fast.healthy() and fast.take() == [], "a healthy update's tallies are dropped"
    # The next update: a sum that is not finite keeps the tallies for the general path.
    cells = tallied()
    b[(1 << 20) + 1] = float("-inf")
    assert not fast.healthy()
    assert fast.take() == cells and fast.take() == []
    assert not fast.tally(1, b.data_ptr(), b.numel()) and fast.tally(0, a.data_ptr(), a.numel()), "handed over: from bucket 0"
    with pytest.raises(ValueError, match="2 buffers, 2 addresses and 1 lengths"):
        gradbus._core.ScanPath([a, b], [a.data_ptr(), b.data_ptr()], [a.numel()], 0.5)
    with pytest.raises(ValueError, match="ScanPath: address .* not aligned"):
        gradbus._core.ScanPath([a], [a.data_ptr() + 1], [a.numel()], 0.5)


OK = (0.0, 0.0, 1.0, -1.0)
LAYOUT = [[("head.weight", 40), ("head.bias", 8)], [("mid.weight", 100)]]


def row(cells, loss=0.5, scale=0.0, replica=0, peaks=None, state=0, reduced=None):
    """One rank's row as the guard builds it: the runtime's row codec (`_core.encode_row`)."""
    return gradbus.encode_row(cells, loss, scale, replica, peaks=peaks, state=state, reduced=reduced)


def allreduce(rows, buckets):
    """What the two all-reduces make of every rank's contribution: int64 SUM and MAX, as bytes."""
    sums, maxs = zip(*(gradbus.contribute(r, buckets, rank=k) for k, r in enumerate(rows)))
    n_sum, n_max = gradbus.summary_words(buckets)

    def words(b, n):
        return struct.unpack(f"<{n}q", b)

    s = [sum(col) for col in zip(*(words(b, n_sum) for b in sums))]
    s = [((x + (1 << 63)) % (1 << 64)) - (1 << 63) for x in s]  # int64 wrapping, as the collective
    m = [max(col) for col in zip(*(words(b, n_max) for b in maxs))]
    return struct.pack(f"<{n_sum}q", *s), struct.pack(f"<{n_max}q", *m)


def both(a, b, rows, step=0, attempt=0, layout=LAYOUT):
    """The summary path's decision (agreement `a`; the table when it shows an anomaly) and the
    table path's (agreement `b`), for the same rows."""
    s, m = allreduce(rows, len(layout))
    d = a.decide_summary(s, m, len(rows), layout, step, attempt)
    if d is None:
        d = a.decide_table(b"".join(rows), len(rows), layout, step, attempt)
    return d, b.decide_table(b"".join(rows), len(rows), layout, step, attempt)


def same(d, e):
    """Two decisions alike, bit for bit (NaN included)."""
    def key(x):
        return (x.action, x.report, x.spike, x.loss.hex(), x.grad_norm.hex(), x.loss_scale.hex(), x.diverged)
    return key(d) == key(e)


def test_a_row_decodes_to_what_the_guard_encoded():
    # The runtime's row codec, both ways: cells as floats (counts, sum of squares, first bad or -1),
    # loss, loss scale, replica, peaks, state, reduced checksums; per bucket 4 words and a peak word
    # (0: none tallied), then the reduced part (4 neutral words and a checksum per bucket), then the
    # report (loss, 2 values, replica, state).
    cells = [(0.0, 0.0, 1.5, -1.0), (3.0, 2.0, 0.25, 17.0)]
    r = row(cells, loss=-0.75, scale=1024.0, replica=0xFEDCBA9876543210)
    assert len(r) == 8 * gradbus.row_words(2) == 8 * (2 * 2 * (gradbus.CELL + 1) + 5)
    assert gradbus.decode_row(r, 2) == (cells, -0.75, 1024.0, 0xFEDCBA9876543210, [], [None, None], 0, [0, 0])
    r = row(cells, peaks=[(2.5, 3), None], state=2 | 1 << 8, reduced=[0xFFFFFFFFFFFFFFFF, 5])
    assert gradbus.decode_row(r, 2)[5:] == ([(2.5, 3), None], 2 | 1 << 8, [0xFFFFFFFFFFFFFFFF, 5])
    with pytest.raises(ValueError, match="health row has 25 words, expected 15 for 1 buckets and 0 watched"):
        gradbus.decode_row(r, 1)
    with pytest.raises(ValueError, match="1 peaks and 2 reduced checksums for 2 buckets"):
        row(cells, peaks=[None])


def test_agreement_names_rank_bucket_param_and_element():
    rows = [row([OK, OK]), row([OK, (0.0, 2.0, 1.0, 42.0)]), row([OK, OK], loss=float("nan"))]
    d, t = both(gradbus.Agreement("abort"), gradbus.Agreement("abort"), rows, step=7)
    assert same(d, t) and not d.summary, "an anomaly: the table decides"
    r = json.loads(d.report)
    assert (d.action, d.spike) == ("abort", None)
    assert (r["step"], r["ranks"], r["bucket"], r["param"], r["element"], r["inf"]) == (7, [1], 1, "mid.weight", 42, 2)
    assert r["loss_finite"] is False and r["cause"] == "local_gradients"
    # Bucket 0: element 45 of the bucket is head.bias[5].
    d = gradbus.Agreement("abort").decide_table(row([(1.0, 0.0, 0.0, 45.0), OK]), 1, LAYOUT, 0, 0)
    assert (json.loads(d.report)["param"], json.loads(d.report)["element"]) == ("head.bias", 5)


def test_the_scan_paths_reduced_sums_judge_a_sum_that_overflowed_from_finite_rows():
    # The scan path passes the reduced sums' health: every rank's gradients finite, a reduced bucket
    # not - the sum overflowed, named by its bucket and first element (bucket 1 starts at 48).
    rows = [row([OK, OK]), row([OK, OK], loss=0.25)]
    reduced = [OK, (0.0, 2.0, 0.0, 17.0)]
    d = gradbus.Agreement("abort").decide_table(b"".join(rows), 2, LAYOUT, 5, 0, reduced=reduced)
    r = json.loads(d.report)
    assert (d.action, r["cause"], r["ranks"], r["bucket"], r["param"], r["element"], r["inf"]) == (
        "abort", "sum_overflow", [], 1, "mid.weight", 17, 2)
    # Finite sums: the rows alone decide, as without `reduced`.
    clean = gradbus.Agreement("abort").decide_table(b"".join(rows), 2, LAYOUT, 5, 0, reduced=[OK, OK])
    assert (clean.action, clean.report, clean.loss) == ("proceed", None, 0.375)
    with pytest.raises(ValueError, match="1 reduced buckets' health for 2 buckets"):
        gradbus.Agreement("abort").decide_table(b"".join(rows), 2, LAYOUT, 5, 0, reduced=[OK])


def test_a_clean_proceed_counts_in_the_skip_policys_bounds():
    # `proceed_clean` (the scan path's healthy update) ends a run of skips as a table's proceed does:
    # skip, skip, clean, skip, skip stays within max_consecutive=2; without the clean proceed the
    # third skip in a row aborts.
    bad = row([(1.0, 0.0, 0.0, 3.0), OK])
    a = gradbus.Agreement("skip", max_consecutive=2, max_fraction=1.0, window=100)
    actions = []
    for step in range(5):
        if step == 2:
            a.proceed_clean()
            actions.append("proceed")
        else:
            actions.append(a.decide_table(bad, 1, LAYOUT, step, 0).action)
    assert actions == ["skip", "skip", "proceed", "skip", "skip"] and a.consecutive_skips == 2 and a.skipped == 4
    b = gradbus.Agreement("skip", max_consecutive=2, max_fraction=1.0, window=100)
    assert [b.decide_table(bad, 1, LAYOUT, s, 0).action for s in range(3)] == ["skip", "skip", "abort"]


def test_the_summary_path_decides_healthy_updates_as_the_table_path_bit_for_bit():
    # Two agreements fed the same updates, one on each path, spike detection on: the same verdicts,
    # means, norms and spikes; the summary decides alone exactly when every rank is healthy.
    g = torch.Generator().manual_seed(5)
    a = gradbus.Agreement("skip", spike="skip", spike_window=8, z_limit=3.0, max_consecutive=100, max_fraction=1.0)
    b = gradbus.Agreement("skip", spike="skip", spike_window=8, z_limit=3.0, max_consecutive=100, max_fraction=1.0)
    actions = set()
    for step in range(60):
        world = 1 + step % 5
        rows = []
        for k in range(world):
            cells = [(0.0, 0.0, float(torch.rand(1, generator=g)) * 10 ** (step == 40), -1.0) for _ in LAYOUT]
            if step % 7 == 3 and k == world - 1:
                cells[1] = (1.0, 0.0, 2.0, 17.0)
            rows.append(row(cells, loss=float(torch.rand(1, generator=g)) * 3 ** (step == 30)))
        d, t = both(a, b, rows, step=step)
        assert same(d, t), step
        assert d.summary == (step % 7 != 3), step
        actions.add((d.action, d.spike is not None))
    assert {("proceed", False), ("skip", False), ("skip", True)} <= actions, actions
    assert a.skipped == b.skipped and a.recent_skips == b.recent_skips


def test_replicas_that_differ_are_judged_by_the_runtimes_replica_rule():
    # The runtime's rule (collectives/src/sdc.rs, check_state): the majority names the damaged rank
    # and the donor; with 2 ranks only a rank's own finding can; else nobody can be told healthy.
    a = gradbus.Agreement("abort")
    rows = [row([OK, OK], replica=0xABCDEF0123456789), row([OK, OK], replica=0xABCDEF0123456789),
            row([OK, OK], replica=0xABCDEF0123456788)]
    s, m = allreduce(rows, 2)
    assert a.decide_summary(s, m, 3, LAYOUT, 9, 0) is None, "a replica mismatch is an anomaly"
    d = a.decide_table(b"".join(rows), 3, LAYOUT, 9, 0)
    assert (d.action, d.diverged, d.donor) == ("repair", [2], 0)
    assert d.replicas == [0xABCDEF0123456789, 0xABCDEF0123456789, 0xABCDEF0123456788]
    assert "its weights hash to abcdef0123456788 (rank 0: abcdef0123456789)" in d.why[0], d.why
    assert a.recent_skips == [] and a.detections == 1, "a repair is no verdict of the history"
    same_rows = [row([OK, OK], replica=7)] * 3
    assert a.decide_summary(*allreduce(same_rows, 2), 3, LAYOUT, 10, 0).action == "proceed"
    # 2 ranks: undecided, unless a rank found its own weights changed (StateFault.weights, bit 0).
    two = [row([OK, OK], replica=5), row([OK, OK], replica=6)]
    d = a.decide_table(b"".join(two), 2, LAYOUT, 11, 0)
    assert (d.action, d.diverged, d.donor) == ("diverged", [0, 1], None)
    two[1] = row([OK, OK], replica=6, state=1)
    d = a.decide_table(b"".join(two), 2, LAYOUT, 12, 0)
    assert (d.action, d.diverged, d.donor) == ("repair", [1], 0)
    assert "its weights changed after its optimizer step (its own check)" in d.why[0], d.why


def test_reduced_checksums_are_compared_across_ranks_and_name_the_bucket():
    # Each rank's checksums of the reduced buckets its optimizer consumed (previous update) ride its
    # row; they fold into the replica word the runtime's rule judges, on both paths.
    a, b = gradbus.Agreement("abort"), gradbus.Agreement("abort")
    rows = [row([OK, OK], reduced=[11, 22]) for _ in range(3)]
    d, t = both(a, b, rows)
    assert d.action == t.action == "proceed" and d.summary
    rows[1] = row([OK, OK], reduced=[11, 23])
    d, t = both(a, b, rows, step=1)
    assert same(d, t) and (d.action, d.diverged, d.donor) == ("repair", [1], 0)
    assert "differs in bucket(s) #1 0000000000000017 (rank 0: 0000000000000016)" in d.why[0], d.why
    # 2 ranks: its own finding (StateFault.consumed: bit 1, bucket from bit 8) names it.
    two = [row([OK, OK], reduced=[11, 22]), row([OK, OK], reduced=[11, 23], state=2 | 1 << 8)]
    d = a.decide_table(b"".join(two), 2, LAYOUT, 2, 0)
    assert (d.action, d.diverged, d.donor) == ("repair", [1], 0)
    assert "consumed a reduced bucket #1 other than its all-reduce's result" in d.why[0], d.why


def test_the_outlier_rule_is_the_runtimes_and_reruns_then_judges():
    # outliers=True: the runtime's outlier rule (sdc::OutlierDetector) on the rows' sums of squares
    # and peaks. 4 healthy updates of history, then one element of 2^20 on rank 1 in bucket #1.
    def rows(big=False):
        c = (0.0, 0.0, 2.0 ** 40 + 1.0, -1.0) if big else (0.0, 0.0, 1.0, -1.0)
        p = (2.0 ** 20, 70) if big else (0.1, 3)
        return [row([OK, OK], peaks=[(0.1, 1), (0.1, 3)]), row([OK, c], peaks=[(0.1, 1), p])]
    for paths in ("table", "summary"):
        a = gradbus.Agreement("skip", outliers=True)

        def decide(r, step, attempt):
            if paths == "table":
                return a.decide_table(b"".join(r), 2, LAYOUT, step, attempt)
            return a.decide_summary(*allreduce(r, 2), 2, LAYOUT, step, attempt) or a.decide_table(b"".join(r), 2, LAYOUT, step, attempt)
        assert [decide(rows(), s, 0).action for s in range(4)] == ["proceed"] * 4
        d = decide(rows(True), 4, 0)
        assert d.action == "rerun" and "rank 1 bucket #1" in d.finding, d.finding
        # Transient: the rerun is clean: proceed, rank 1 suspect.
        d = decide(rows(), 4, 1)
        r = json.loads(d.report)
        assert (d.action, r["cause"], r["classification"], a.suspects) == ("proceed", "outlier", "transient", [1])
        # Deterministic: again on the rerun: the policy (skip), the report names rank, bucket, element.
        assert decide(rows(True), 5, 0).action == "rerun"
        d = decide(rows(True), 5, 1)
        r = json.loads(d.report)
        assert (d.action, r["cause"], r["ranks"], r["bucket"], r["param"], r["element"]) == ("skip", "outlier", [1], 1, "mid.weight", 70)
        assert a.detections == 2, "one per update found (its rerun is no second finding)"
    # Off by default: the same rows proceed.
    a = gradbus.Agreement("skip")
    assert [a.decide_table(b"".join(rows(s == 4)), 2, LAYOUT, s, 0).action for s in range(5)] == ["proceed"] * 5


def test_with_a_loss_scale_overflows_skip_until_the_floor_or_the_budget():
    bad = (0.0, 3.0, 1.0, 0.0)
    # Skipped as the scaler's overflow (no bound in a row: max_consecutive=1 does not apply) while
    # the scale is above the floor; the overflow at the floor aborts.
    a = gradbus.Agreement("abort", max_consecutive=1, max_fraction=1.0, min_scale=4.0)
    out = []
    for step, scale in enumerate([64.0, 32.0, 16.0, 8.0, 4.0]):
        d = a.decide_table(b"".join([row([OK, bad], scale=scale), row([OK, OK], scale=scale)]), 2, LAYOUT, step, 0)
        r = json.loads(d.report)
        out.append((d.action, r["verdict"], r["classification"], d.loss_scale))
    assert out[:4] == [("skip", "skip", "loss-scale", s) for s in (64.0, 32.0, 16.0, 8.0)]
    assert out[4] == ("abort", "abort", "loss-scale", 4.0)
    # The skip fraction of the window bounds them too.
    a = gradbus.Agreement("skip", max_fraction=0.2, window=10)
    acts = [a.decide_table(row([OK, bad], scale=2.0 ** 20), 1, LAYOUT, k, 0) for k in range(3)]
    assert [d.action for d in acts] == ["skip", "skip", "abort"]
    assert json.loads(acts[2].report)["classification"] == "skip-budget"
    # Finite gradients: the grad norm the spike detector sees is unscaled.
    d = gradbus.Agreement("abort").decide_table(row([(0.0, 0.0, 64.0, -1.0), OK], scale=4.0), 1, LAYOUT, 0, 0)
    assert (d.action, d.grad_norm) == ("proceed", (65.0 ** 0.5) / 4.0)


def test_ranks_with_different_loss_scales_stop_with_a_hint():
    rows = [row([OK, OK], scale=1024.0), row([OK, OK], scale=512.0)]
    with pytest.raises(RuntimeError, match="loss scales differ .*from 512 to 1024.*GradScaler"):
        gradbus.Agreement("abort").decide_summary(*allreduce(rows, 2), 2, LAYOUT, 3, 0)


def test_agreement_rejects_a_table_of_the_wrong_shape_and_bad_counts():
    a = gradbus.Agreement("skip")
    with pytest.raises(ValueError, match="expected 2 ranks x 25 words \\(2 buckets, 0 watched\\)"):
        a.decide_table(bytes(8 * 9), 2, LAYOUT, 0, 0)
    with pytest.raises(ValueError, match="bucket #1: nan is -1"):
        row([OK, (-1.0, 0.0, 0.0, -1.0)])
    with pytest.raises(ValueError, match="expected .* for 2 buckets"):
        a.decide_summary(b"", b"", 1, LAYOUT, 0, 0)
    with pytest.raises(ValueError, match="min_scale 0"):
        gradbus.Agreement("abort", min_scale=0.0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"policy": "ignore"}, "policy 'ignore'"),
        ({"scan": "gpu"}, "scan 'gpu'"),
        ({"policy": "skip", "max_fraction": 2.0}, "max_fraction 2"),
        ({"spike": "maybe"}, 'spike "maybe"'),
        ({"agreement": "gossip"}, "agreement 'gossip'"),
        ({"replica_every": 10}, "replica_every needs the parameters"),
        ({"replica_every": -1}, "replica_every -1"),
        ({"scaler": object()}, "not a torch.amp.GradScaler"),
        ({"policy": "rerun", "scaler": torch.amp.GradScaler("cpu")}, "policy 'rerun' with a GradScaler"),
    ],
)
def test_bad_guard_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Guard(**kwargs)


def test_only_the_ddp_hook_lets_the_rows_ride_a_gradient_all_reduce():
    from gradbus.guard import BucketGuard

    assert Guard(agreement="ride").agreement == "ride"
    with pytest.raises(ValueError, match="agreement 'ride': expected one of \\('auto', 'summary', 'table'\\)"):
        BucketGuard("gradbus.megatron", [[("w", 4)]], "abort", None, None, agreement="ride")


def test_verdict_without_a_backward_says_how_to_register_the_hook():
    with pytest.raises(RuntimeError, match="register_comm_hook"):
        Guard().verdict()


def test_a_verdict_whose_scan_of_the_sums_fails_forgets_the_updates_records():
    # The scan path keeps an update's records until its verdict; when reading the reduced sums
    # raises (a device error, say) and the caller carries on, the next update starts from nothing,
    # as after any verdict - here with fewer buckets (DDP's rebuild), which stale records would refuse.
    class Failing(Guard):
        def reduced_sums(self, n):
            raise RuntimeError("device lost")

    g = Failing(policy="abort")
    clean = (0.0, 0.0, 1.0, -1.0)
    g.record(0, [("w", 4)], clean)
    g.record(1, [("b", 2)], clean)
    g.scan_sums(2)
    with pytest.raises(RuntimeError, match="device lost"):
        g.verdict()
    g.record(0, [("w", 6)], clean)
    g.scan_sums(1)
    assert g.buckets == 1 and g.path == "scan"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.float32])
def test_torch_scan_counts_in_the_buckets_own_dtype(dtype):
    # The path of CUDA and non-float32 buckets, here on CPU tensors. An fp16 value past 65504 is an
    # Inf of the fp16 bucket: the scan sees the bucket as it is, in its dtype.
    x = planted(3000, [(2500, float("nan")), (1200, float("inf")), (1201, float("-inf"))]).to(dtype)
    nan, inf, sumsq, first = _torch_health(x).tolist()
    assert (nan, inf, first) == (1, 2, 1200)
    assert sumsq != sumsq or sumsq == float("inf"), "not finite: the sum of squares says so, nothing more"
    y = planted(3000, []).to(dtype)
    nan, inf, sumsq, first = _torch_health(y).tolist()
    assert (nan, inf, first) == (0, 0, -1)
    assert sumsq == pytest.approx(float((y.double() ** 2).sum()), rel=1e-5)
    if dtype == torch.float16:
        big = torch.tensor([1.0, 70000.0, 2.0]).to(dtype)
        assert _torch_health(big).tolist()[1::2] == [1.0, 1.0], "70000 overflows fp16: Inf at element 1"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_cpu_buckets_are_widened_chunk_by_chunk_for_the_rust_scan(dtype, monkeypatch):
    # bf16/fp16 CPU buckets (DeepSpeed's, Megatron's bf16 grads): widened to float32 a chunk at a time
    # and Rust-scanned; the counts and the first element across chunk boundaries are the torch scan's.
    from gradbus import guard as core

    monkeypatch.setattr(core, "_WIDEN", 1000)
    x = planted(3500, [(2500, float("nan")), (1200, float("inf")), (1201, float("-inf")), (3499, float("nan"))]).to(dtype)
    nan, inf, sumsq, first = core.health(x)
    assert (nan, inf, first) == (2, 2, 1200) == tuple(_torch_health(x).tolist()[i] for i in (0, 1, 3))
    finite = x[torch.isfinite(x)].double()
    assert sumsq == pytest.approx(float((finite * finite).sum()), rel=1e-12), "the finite elements' squares"
    assert core.health(x[:1000])[3] == -1.0 and core.health(x, scan="torch")[3].item() == 1200


def test_spike_skip_skips_an_agreed_loss_spike_with_the_runtime_detector():
    a = gradbus.Agreement("abort", spike="skip", spike_window=4, z_limit=3.0)
    actions = []
    for loss in [1.0, 1.1, 0.9, 1.0, 1.05, 50.0, 1.0]:
        rows = [row([OK, OK], loss=loss)] * 2
        d = a.decide_summary(*allreduce(rows, 2), 2, LAYOUT, len(actions), 0)
        actions.append((d.action, d.spike is not None and d.spike.startswith("loss spike 50.0000")))
        assert d.report is None and d.summary
    assert actions == [("proceed", False)] * 5 + [("skip", True), ("proceed", False)]
    assert a.skipped == 1


def test_replica_checksums_change_with_any_one_element_and_only_with_the_bits():
    from gradbus.torch import _torch_checksum, replica_checksum

    g = torch.Generator().manual_seed(3)
    w = [torch.randn(1000, generator=g), torch.randn(37, 5, generator=g).to(torch.bfloat16), torch.randn(64, generator=g).double()]
    base = replica_checksum(w)
    assert base == replica_checksum([t.clone() for t in w]), "a pure function of the bits"
    assert gradbus.checksum_f32(w[0].data_ptr(), 1000) == gradbus.checksum_f32(w[0].clone().data_ptr(), 1000)
    seen = {base}
    for k, t in enumerate(w):
        for i in (0, 1, t.numel() // 2, t.numel() - 1):
            u = [x.clone() for x in w]
            bits = u[k].view(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[u[k].element_size()])
            bits[i] ^= 1  # one ulp: the lowest bit of one element
            seen.add(replica_checksum(u))
            assert _torch_checksum(u[k]) != _torch_checksum(w[k]) or k == 0
    assert len(seen) == 1 + 3 * 4, "every one-bit change gives its own checksum"
    swapped = [w[0].flip(0)] + w[1:]
    assert replica_checksum(swapped) != base, "positions count, not just the values"
    assert replica_checksum([w[0].view(10, 100).t()] + w[1:]) == replica_checksum([w[0].view(10, 100).t().contiguous()] + w[1:])
    # float32 CPU tensors only: one native call (checksum_f32_fold), the same bits as the loop's fold
    # (taken by a non-contiguous tensor), and as folding checksum_f32 by hand.
    f = [w[0], torch.randn(37, 5, generator=g), torch.zeros(0), torch.randn(3, generator=g)]
    h = 0
    for t in f:
        h = (h ^ gradbus.checksum_f32(t.data_ptr(), t.numel())) * 0xBF58476D1CE4E5B9 & ((1 << 64) - 1)
        h ^= h >> 31
    assert replica_checksum(f) == h == replica_checksum([f[0], f[1].t().contiguous().t()] + f[2:])
    assert not f[1].t().contiguous().t().is_contiguous()
    with pytest.raises(ValueError, match="not aligned"):
        gradbus._core.checksum_f32_fold([f[0].data_ptr() + 1], [4])


def test_guarded_optimizer_runs_the_gradscaler_as_a_plain_script_would():
    # GuardedOptimizer's scaler branch alone, with a stand-in for the guard's verdicts.
    from gradbus.torch import GuardedOptimizer, Verdict

    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)

    class Stand:
        def stepped(self):
            self.steps = getattr(self, "steps", 0) + 1

    guard = Stand()
    guard.scaler = scaler
    guarded = GuardedOptimizer(opt, guard)

    def backward(g):
        opt.zero_grad()
        scaler.scale((w * g).sum()).backward()

    def step(*verdict):
        guard.verdict = lambda: Verdict(*verdict)
        return guarded.step()

    # proceed: scaler.step unscales (gradient 1: w -> 0.9) and steps; update grows the scale (interval 1)
    backward(1.0)
    step("proceed", None, None, 0, 0, 8.0, 0.0)
    assert torch.equal(w.detach(), torch.full((4,), 0.9)) and scaler.get_scale() == 16.0
    assert guard.steps == 1, "the guard hears of the step (the replica check's own check)"
    # a spike skip after the script's own unscale_ (for clipping): no step, the scale kept, and the
    # scaler ready for the next iteration (else the next step would reuse this unscale_'s finding)
    backward(1.0)
    scaler.unscale_(opt)
    step("skip", None, "loss spike", 1, 0, 16.0, 0.0)
    assert torch.equal(w.detach(), torch.full((4,), 0.9)) and scaler.get_scale() == 16.0
    # an overflow: the scaler finds the Inf, skips the step, halves the scale
    backward(float("inf"))
    v = step("skip", {"classification": "loss-scale"}, None, 2, 0, 16.0, 0.0)
    assert v.overflow and torch.equal(w.detach(), torch.full((4,), 0.9)) and scaler.get_scale() == 8.0
    assert guard.steps == 2, "not after the spike skip; after the overflow's scaler.step (which changed nothing)"
    # a verdict the scaler contradicts is an error, not a silent difference
    backward(float("inf"))
    with pytest.raises(RuntimeError, match="disagree"):
        step("proceed", None, None, 3, 0, 8.0, 0.0)


def test_a_bad_simd_level_fails_the_import_with_the_variables_name():
    import subprocess
    import sys

    env = {**__import__("os").environ, "GRADBUS_SIMD": "sse9"}
    r = subprocess.run([sys.executable, "-c", "import gradbus._core"], env=env, capture_output=True, text=True)
    assert r.returncode != 0
    assert "ValueError" in r.stderr and "GRADBUS_SIMD" in r.stderr and "avx2" in r.stderr, r.stderr
    assert "panicked" not in r.stderr, r.stderr


def test_the_auto_agreement_takes_the_runtimes_cost_model():
    # Small jobs gather the table (one collective), large ones all-reduce the summary (its size does
    # not grow with the world): the crossover of collectives/src/choice/cost.rs's model.
    from gradbus import _core

    assert _core.cheaper_path(2, 7) == "table"
    assert _core.cheaper_path(1 << 16, 7) == "summary"
    crossing = [w for w in range(2, 4096) if _core.cheaper_path(w, 100) == "summary"]
    assert crossing and all(_core.cheaper_path(w, 100) == "summary" for w in range(crossing[0], 4096))
    with pytest.raises(ValueError, match="agreement"):
        Guard(agreement="fastest")
