"""The Python checks of the GPU bundle, on the CPU: python/gpu_check.py (scripts/gpu-check.d/
80-python-guard) - its skip path without a GPU (exit 3), the overhead's arithmetic and its failure
row, its checks failing where the guard would be wrong, the deadline that ends a stuck check and its
processes, and which FSDP2 failures are NOT RUN (only torch's two documented refusals) and which
FAILED; python/gpu/deepspeed_check.py and megatron_check.py - their exit 3 without a GPU, and a
DeepSpeed run that raises. Their whole runs on the CPU (`--cpu`) are scripts/gpu-check-test.sh's,
in CI."""

import importlib.util
import os
import subprocess
import sys
import threading
import time
import types

import pytest
import torch.multiprocessing as mp

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(PYTHON_DIR, "gpu_check.py")
DEEPSPEED = os.path.join(PYTHON_DIR, "gpu", "deepspeed_check.py")
MEGATRON = os.path.join(PYTHON_DIR, "gpu", "megatron_check.py")
NO_GPU = dict(os.environ, CUDA_VISIBLE_DEVICES="")


def load(path=SCRIPT, name="gpu_check"):
    spec = importlib.util.spec_from_file_location(name, path)
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


def test_an_overhead_that_raises_is_a_failed_row_and_exit_1(monkeypatch, capsys):
    gc = load()
    monkeypatch.setattr(gc, "checks", lambda cpu: [("quick", lambda t: "done")])

    def broken(*args):
        raise RuntimeError("NCCL error: unhandled system error")

    monkeypatch.setattr(gc, "overhead", broken)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--cpu"])
    assert gc.main() == 1
    out = capsys.readouterr().out.splitlines()
    assert "ROW python guard: overhead | FAILED: RuntimeError: NCCL error: unhandled system error" in out, out
    assert "CHECKS 1" in out and out[-1] == "python guard GPU check: FAILED", out


# gpu_check.py's deadline path, in a process of its own (it ends with os._exit): a check that never
# ends holds a process of its own, as a real check's ranks do (spawned).
DEADLINE_RUN = """
import multiprocessing, sys, time
import importlib.util
script, pidfile = sys.argv[1], sys.argv[2]
sys.argv = [script, "--cpu", "--deadline", "3"]
spec = importlib.util.spec_from_file_location("gpu_check", script)
gc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gc)

def stuck(tmp):
    p = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,))
    p.start()
    with open(pidfile, "w") as f:
        f.write(str(p.pid))
    p.join()

gc.checks = lambda cpu: [("quick", lambda t: "done"), ("stuck", stuck)]
gc.overhead = lambda *a: sys.exit("the overhead ran after a check past its deadline")
sys.exit(gc.main())
"""


def alive(pid):
    """True while `pid` runs (a zombie waiting for its reaper is not running)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_check_past_the_deadline_fails_its_row_and_its_processes_are_killed(tmp_path):
    pidfile, log = tmp_path / "pid", tmp_path / "out"
    # Output to a file, not a pipe: a process left behind would hold a pipe open past gpu_check.py's end.
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-c", DEADLINE_RUN, SCRIPT, str(pidfile)], stdout=f, stderr=subprocess.STDOUT,
                           timeout=300, cwd=tmp_path)
    out = log.read_text().splitlines()
    pid = int(pidfile.read_text())
    try:
        assert r.returncode == 1, out
        assert "ROW python guard: stuck | FAILED: not ended within 3 s" in out, out
        assert any(o.startswith("ROW python guard: quick | ok: done") for o in out), out
        assert out[-2:] == ["CHECKS 1", "python guard GPU check: FAILED"], out
        # SIGKILL is delivered at once: the process is gone (or a zombie) when the kernel is done with it.
        end = time.time() + 10
        while alive(pid) and time.time() < end:
            time.sleep(0.1)
        assert not alive(pid), f"the stuck check's process {pid} outlived gpu_check.py"
    finally:
        if alive(pid):
            os.kill(pid, 9)


def gloo_timeout_worker(rank, world, port, case, outdir):
    """Rank 0 waits in an all_reduce that rank 1 never joins: gloo's own timeout error."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=1))
    if rank == 0:
        dist.all_reduce(torch.ones(4))
    else:
        time.sleep(8)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_timeout():
    """The exception a 2-rank job whose gloo collective timed out raises in the parent (real: torch's
    own message, as FSDP2 alone would raise it where gloo never completes a collective)."""
    from ddp_case import spawn

    with pytest.raises(mp.ProcessRaisedException) as e:
        spawn(gloo_timeout_worker, 2, {}, None)
    return e.value


def test_fsdp2_alone_failing_is_not_run_only_for_gloos_timeout_or_refusal_of_cuda_and_else_failed(monkeypatch, capsys, gloo_timeout):
    gc = load()
    refused = mp.ProcessRaisedException(
        "\n\n-- Process 1 terminated with the following error:\nTraceback (most recent call last):\n"
        "RuntimeError: ProcessGroupGloo::allgather: unsupported device type cuda\n", 1, 4242)
    crashed = mp.ProcessExitedException("process 1 terminated with signal SIGSEGV", 1, 4242, -11, "SIGSEGV")
    cases = [
        (gloo_timeout, None, "gloo's collective timed out (Timed out waiting 1000ms for recv operation to complete)"),
        (refused, None, "gloo refuses CUDA tensors (ProcessGroupGloo::allgather: unsupported device type cuda)"),
        (crashed, False, "FAILED: ProcessExitedException: process 1 terminated with signal SIGSEGV"),
        (RuntimeError("CUDA error: invalid device ordinal"), False, "FAILED: RuntimeError: CUDA error: invalid device ordinal"),
        (AttributeError("'NoneType' object has no attribute 'to'"), False, "FAILED: AttributeError: 'NoneType' object"),
    ]
    cuda = {"steps": 4, "device": "cuda", "backend": "gloo", "timeout_s": 20}
    for check in (gc.fsdp_clean, gc.fsdp_planted, gc.fsdp_skip):
        for exc, want, says in cases:
            def run(world, case, outdir=None, exc=exc):
                assert case["guard"] is None, "the guarded run came before FSDP2 alone"
                raise exc

            monkeypatch.setattr(gc.fsdp_case, "run", run)
            name, ok, detail = gc.attempt("fsdp", lambda t: check(cuda, t))
            assert ok is want and says in detail, (check.__name__, exc, ok, detail)
            if want is None:
                assert detail.startswith("FSDP2 alone, 2 ranks on one device over gloo: "), detail
            # The same error on the CPU, where FSDP2 alone runs, is the check's failure.
            _, ok, detail = gc.attempt("fsdp", lambda t: check(dict(cuda, device="cpu"), t))
            assert ok is False and detail.startswith("FAILED: "), detail
    capsys.readouterr()
    # A NOT RUN check is a NOTRUN line (gpu-check.sh counts it, never as passed); main's exit stays 0
    # and its last line says so.
    def refuse(*args, **kw):
        raise refused

    monkeypatch.setattr(gc.fsdp_case, "run", refuse)
    monkeypatch.setattr(gc, "checks", lambda cpu: [("quick", lambda t: "done"), ("FSDP2 clean", lambda t: gc.fsdp_clean(cuda, t))])
    monkeypatch.setattr(gc, "overhead", lambda *a: (1000, [1.0, 1.0], [1.0, 1.0]))
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--cpu"])
    assert gc.main() == 0
    out = capsys.readouterr().out.splitlines()
    assert ("NOTRUN python guard: FSDP2 clean | FSDP2 alone, 2 ranks on one device over gloo: gloo refuses CUDA tensors "
            "(ProcessGroupGloo::allgather: unsupported device type cuda)") in out, out
    assert not any(o.startswith("ROW python guard: FSDP2 clean") for o in out), out
    assert "CHECKS 2" in out and out[-1] == "python guard GPU check: every check that ran passed; 1 NOT RUN (NOTRUN lines: not a pass)", out


@pytest.mark.parametrize("script,says", [
    (DEEPSPEED, "ROW gradbus.deepspeed on the GPU | SKIPPED: no CUDA device"),
    (MEGATRON, "SKIPPED: gradbus.megatron GPU check: no CUDA device"),
])
def test_the_framework_checks_without_a_gpu_say_skipped_and_exit_3(script, says):
    r = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300, env=NO_GPU)
    assert r.returncode == 3, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1].startswith(says), r.stdout


def test_a_deepspeed_run_that_raises_is_a_failed_row_and_exit_1(monkeypatch, capsys, tmp_path):
    ds = load(DEEPSPEED, "deepspeed_check")
    fake = types.ModuleType("deepspeed_case")

    def run(world, cases, outdir, device):
        assert (world, device, len(cases)) == (1, "cpu", len(ds.cases("run")))
        raise RuntimeError("deepspeed.init_distributed: no accelerator")

    fake.run = run
    monkeypatch.setitem(sys.modules, "deepspeed_case", fake)
    monkeypatch.setattr(ds.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["deepspeed_check.py", "--cpu"])
    assert ds.main() == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["ROW gradbus.deepspeed: the run | FAILED: it raised (above)"], captured.out
    assert "RuntimeError: deepspeed.init_distributed: no accelerator" in captured.err
