#!/usr/bin/env bash
# python/gpu-bundle.sh DIR: the PyTorch guard's part of the GPU check bundle (scripts/gpu-check.sh
# --prepare calls it; scripts/gpu-check.d/80-python-guard runs it there). Builds the x86_64
# manylinux2014 wheel here (python/build-wheels.sh, with $PYTHON or target/pyvenv's python: maturin +
# ziglang) and copies it, gpu_check.py and tests/ddp_case.py into DIR/python-guard. The GPU machine has
# no package registry: the step unpacks the wheel onto PYTHONPATH and runs gpu_check.py with its torch.
set -euo pipefail
dir=${1:?"usage: python/gpu-bundle.sh DIR"}
src=$(cd "$(dirname "$0")" && pwd)
out="$dir/python-guard"
rm -rf "$out"
mkdir -p "$out/tests"
PYTHON=${PYTHON:-$src/../target/pyvenv/bin/python} "$src/build-wheels.sh" "$out" x86_64
cp "$src/gpu_check.py" "$out/"
cp "$src/tests/ddp_case.py" "$out/tests/"
ls -l "$out"
