#!/usr/bin/env bash
# gpu-check-step: the PyTorch guard's part of scripts/gpu-check.sh (python/gpu_check.py, issue 22).
#
#   python/gpu-check-step.sh prepare DIR   build the x86_64 manylinux2014 wheel here
#                                          (python/build-wheels.sh, with $PYTHON or target/pyvenv's
#                                          python: maturin + ziglang) and copy it, gpu_check.py and
#                                          tests/ddp_case.py into DIR/python-guard
#   python/gpu-check-step.sh run DIR       on the GPU machine: unpack that wheel into
#                                          DIR/python-guard/site and run gpu_check.py with python3
#                                          (which must have torch); its exit code: 0 passed,
#                                          1 failed, 3 skipped (no GPU)
set -euo pipefail
cmd=${1:-}
dir=${2:?"usage: python/gpu-check-step.sh prepare|run DIR"}
src=$(cd "$(dirname "$0")" && pwd)
out="$dir/python-guard"
case $cmd in
  prepare)
    rm -rf "$out"
    mkdir -p "$out/tests"
    PYTHON=${PYTHON:-$src/../target/pyvenv/bin/python} "$src/build-wheels.sh" "$out" x86_64
    cp "$src/gpu_check.py" "$out/"
    cp "$src/tests/ddp_case.py" "$out/tests/"
    ls -l "$out"
    ;;
  run)
    wheel=$(ls "$out"/gradbus-*manylinux2014_x86_64*.whl)
    rm -rf "$out/site"
    python3 -m zipfile -e "$wheel" "$out/site"
    PYTHONPATH="$out/site${PYTHONPATH:+:$PYTHONPATH}" python3 "$out/gpu_check.py"
    ;;
  *)
    echo "gpu-check-step: expected prepare DIR or run DIR" >&2
    exit 2
    ;;
esac
