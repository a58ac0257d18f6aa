"""python/gpu_check.py (the PyTorch guard's GPU check, run on a GPU machine by scripts/gpu-check.sh)
takes its skip path where there is no GPU: exit 3 and a SKIPPED line, nothing checked. (Its checks
run on the CPU with `gpu_check.py --cpu`; the same cases as test_ddp.py and test_amp.py.)"""

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu_check.py")


def test_without_a_gpu_the_check_says_skipped_and_exits_3():
    r = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert r.returncode == 3, r.stdout + r.stderr
    assert r.stdout.startswith("SKIPPED: no CUDA device for the python guard GPU check"), r.stdout
