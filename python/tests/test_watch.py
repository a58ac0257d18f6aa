"""The guard's early warning and quarantine in the native core, without processes: the exp ceilings,
the ranked maximum, the forecast's warnings and stop (the runtime's rule, collectives/src/forecast.rs),
the watched words through both agreement paths, and a report's sample ids and quarantine lines."""

import json
import math

import pytest

from gradbus import _core
from gradbus.guard import Row

LN_FLT_MAX = math.log(3.4028234663852886e38)
# TRL's k3 exponent on stale rollouts, seed 0 (docs/hf-trainer.md): the agreed maxima of updates 0-6;
# update 7 overflowed.
SEED0 = [0.0, 12.3, 19.8, 28.7, 45.3, 64.4, 82.2]


def test_exp_ceilings_per_dtype():
    assert _core.exp_ceiling("float32") == pytest.approx(88.7228, abs=1e-4)
    assert _core.exp_ceiling("bfloat16") == pytest.approx(88.7189, abs=1e-4)
    assert _core.exp_ceiling("float16") == pytest.approx(11.0899, abs=1e-4)
    assert _core.exp_ceiling("float64") == pytest.approx(709.7827, abs=1e-4)
    with pytest.raises(ValueError, match="no exp ceiling for dtype \"int8\".*limit="):
        _core.exp_ceiling("int8")


def test_the_largest_ranked_word_names_the_value_and_its_lowest_rank():
    words = [_core.ranked(v, r) for r, v in enumerate([12.5, 98.875, 98.875, float("nan"), float("-inf")])]
    assert _core.unranked(max(words[:3])) == (98.875, 1)
    assert _core.unranked(max(words)) == (math.inf, 3)  # NaN is past any ceiling
    assert _core.unranked(words[4]) == (-math.inf, 4)
    with pytest.raises(ValueError, match="at most"):
        _core.ranked(1.0, 1 << 29)


def observe(stop, values, rank=1):
    w = _core.Watches(stop=stop)
    assert w.add("k3_exp", LN_FLT_MAX) == 0
    return [w.observe(u, [_core.ranked(x, rank)]) for u, x in enumerate(values)]


def test_warn_then_stop_on_the_measured_trajectory_with_its_lines():
    out = observe(True, SEED0)
    actions = [a for a, _ in out]
    assert actions == [None, None, None, "warn", "warn", "stop", "stop"]
    line, message = out[4][1][0]
    w = json.loads(line)
    assert list(w) == ["format", "update", "quantity", "value", "limit", "rank", "forecast_updates", "action", "crc32c"]
    assert (w["update"], w["quantity"], w["rank"], w["action"], w["limit"]) == (4, "k3_exp", 1, "warn", LN_FLT_MAX)
    assert w["value"] == pytest.approx(45.3) and w["forecast_updates"] == pytest.approx((LN_FLT_MAX - 45.3) / 10.79, rel=1e-6)
    assert "update 4: k3_exp reached 45.30 on rank 1" in message and "4.0 updates away" in message
    assert "stopping before update 5" in out[5][1][0][1]
    # Without the stop policy every alert is a warning.
    assert [a for a, _ in observe(False, SEED0)] == [None, None, None, "warn", "warn", "warn", "warn"]


def test_the_controls_trajectories_never_warn():
    # The largest k3 exponents measured on the on-policy and plain-k3 controls (seed 0, 24 updates).
    on_policy = [0.0, 2.2, 3.0, -2.5] + [-2.5] * 20
    plain_k3 = [0.0, 12.3, 11.9, 9.8, 4.3, 4.7, 2.8, 3.3, 4.5, 4.3, 4.3, 3.2, 1.8, 2.2, 2.9, 3.0, 2.5, 2.2, 3.6,
                1.4, 1.8, 3.7, 3.3, 3.2]
    for values in (on_policy, plain_k3):
        assert all(a is None for a, _ in observe(True, values)), values


def test_an_update_without_the_quantity_is_no_observation():
    w = _core.Watches()
    w.add("k3_exp", LN_FLT_MAX)
    assert w.observe(0, [_core.ranked(float("-inf"), 0)]) == (None, [])
    with pytest.raises(ValueError, match="1 watched quantities"):
        w.observe(1, [])
    with pytest.raises(ValueError, match="already watched"):
        w.add("k3_exp", 1.0)
    with pytest.raises(ValueError, match="positive"):
        w.add("x", float("nan"))


LAYOUT = [[("head.weight", 4)]]


def rows(cells_and_words):
    return [Row([c], loss=0.5, watched=w).encode() for c, w in cells_and_words]


def test_watched_words_agree_on_both_paths():
    ok = (0.0, 0.0, 1.0, -1.0)
    rs = rows([(ok, [_core.ranked(30.5, 0)]), (ok, [_core.ranked(44.25, 1)])])
    sums, maxs = zip(*(_core.contribute(r, 1, 1) for r in rs))
    import struct

    n_sum, n_max = _core.summary_words(1, 1)
    s = [sum(c) for c in zip(*(struct.unpack(f"<{n_sum}q", b) for b in sums))]
    s = [((x + (1 << 63)) % (1 << 64)) - (1 << 63) for x in s]
    m = [max(c) for c in zip(*(struct.unpack(f"<{n_max}q", b) for b in maxs))]
    d = _core.Agreement("abort").decide_summary(struct.pack(f"<{n_sum}q", *s), struct.pack(f"<{n_max}q", *m), 2, LAYOUT, 0, 0, 1)
    t = _core.Agreement("abort").decide_table(b"".join(rs), 2, LAYOUT, 0, 0, 1)
    assert d is not None and d.action == t.action == "proceed"
    assert [_core.unranked(x) for x in d.watched] == [_core.unranked(x) for x in t.watched] == [(44.25, 1)]
    # Decoded rows carry the words back.
    assert Row.decode(rs[1], 1, 1).watched == [_core.ranked(44.25, 1)]
    with pytest.raises(ValueError, match="has 32 words, expected 2 ranks x 15 words \\(1 buckets, 0 watched\\) = 30"):
        _core.Agreement("abort").decide_table(b"".join(rs), 2, LAYOUT, 0, 0, 0)


def test_a_report_names_each_bad_ranks_samples_and_their_quarantine_lines(tmp_path):
    bad, ok = (1.0, 0.0, 0.0, 2.0), (0.0, 0.0, 1.0, -1.0)
    d = _core.Agreement("skip").decide_table(b"".join(rows([(ok, []), (bad, [])])), 2, LAYOUT, 7, 0)
    assert d.action == "skip"
    text = _core.report_with_samples(d.report, {0: [3, 4], 1: [17, "prompt-9"]})
    r = json.loads(text)
    assert r["format"] == 3 and r["per_rank"] == [{"rank": 1, "nan": 1, "inf": 0, "first_bucket": 0, "samples": [17, "prompt-9"]}]
    lines = _core.quarantine_lines(text)
    assert [json.loads(x)["samples"] for x in lines] == [[17, "prompt-9"]]
    assert json.loads(lines[0])["update"] == 7 and json.loads(lines[0])["verdict"] == "skip"
    path = tmp_path / "quarantine.jsonl"
    path.write_text("".join(x + "\n" for x in lines + lines))
    assert _core.read_quarantine(str(path)) == [17, "prompt-9"], "each id once"
    path.write_text(lines[0].replace("17", "18") + "\n")
    with pytest.raises(ValueError, match="checksum mismatch"):
        _core.read_quarantine(str(path))
    with pytest.raises(ValueError, match="sample id"):
        _core.report_with_samples(d.report, {1: [-1]})
