"""python/gpu_check.py (the PyTorch guard's GPU check, scripts/gpu-check.d/80-python-guard): its skip
path without a GPU (exit 3), the overhead's arithmetic, and its checks failing where the guard would
be wrong. Its whole run on the CPU (`gpu_check.py --cpu`) is scripts/gpu-check-test.sh's, in CI."""

import importlib.util
import os
import subprocess
import sys
import threading

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu_check.py")


def load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_without_a_gpu_the_check_says_skipped_and_exits_3():
    r = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert r.returncode == 3, r.stdout + r.stderr
    assert r.stdout.startswith("SKIPPED: no CUDA device for the python guard GPU check"), r.stdout


def test_the_overhead_is_the_median_of_the_rounds_paired_ratios():
    gc = load()
    # Round ratios 1.1, 0.9, 1.5: median 1.1 (not the ratio of the medians, 12/10 = 1.2).
    hook, guard, ratio, lo, hi = gc.summarize([10.0, 20.0, 8.0], [11.0, 18.0, 12.0])
    assert (hook, guard) == (10.0, 12.0)
    assert (ratio, lo, hi) == pytest.approx((1.1, 0.9, 1.5))
    with pytest.raises(ValueError, match="unpaired"):
        gc.summarize([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="unpaired"):
        gc.summarize([], [])


def test_each_check_prints_its_row_as_it_ends_and_one_past_the_deadline_fails(capsys):
    gc = load()
    stop = threading.Event()
    try:
        res = gc.run_all([("quick", lambda t: "done"), ("stuck", lambda t: stop.wait(60) and "late")], jobs=2, deadline=1)
    finally:
        stop.set()
    assert res == [("quick", True, res[0][2]), ("stuck", False, "FAILED: not ended")], res
    assert res[0][2].startswith("ok: done (")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ROW python guard: quick | ok: done"), out
    assert out[1] == "ROW python guard: stuck | FAILED: not ended within 1 s", out


def test_a_check_that_fails_is_a_failed_row(tmp_path):
    gc = load()
    # A guard that saw no NaN (the plant at update 2 of a 2-update run never fires) has no report.
    name, ok, detail = gc.attempt("planted", lambda t: gc.planted(1, {"steps": 2, "device": "cpu", "backend": "gloo"}, t))
    assert (name, ok) == ("planted", False) and detail.startswith("FAILED: AssertionError: no report"), detail
    # A guarded run that differs from plain DDP (here: the plain run trains on the NaN, the guard aborts).
    base = {"steps": 3, "device": "cpu", "backend": "gloo", "plants": [gc.NAN]}
    name, ok, detail = gc.attempt("clean", lambda t: gc.clean(1, base, t))
    assert not ok and detail.startswith("FAILED:"), detail
