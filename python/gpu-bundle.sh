#!/usr/bin/env bash
# python/gpu-bundle.sh DIR [--wheel WHEEL] [--offline]: the Python parts of the GPU check bundle
# (scripts/gpu-check.sh --prepare calls it; the steps of scripts/gpu-check.d/ run them there). The GPU
# machine has no package registry and Python 3.12 with torch: each folder holds the wheels its step
# unpacks onto PYTHONPATH, and the scripts it runs.
#
#   DIR/python-guard/  the gradbus wheel, gpu_check.py and what it imports (tests/ddp_case.py,
#                      tests/fsdp_case.py, examples/fsdp_guard.py, examples/example_cli.py)
#                                                                                 (80-python-guard)
#   DIR/megatron/      the gradbus wheel, megatron-core 0.19.2's cp312 wheel, megatron_check.py and
#                      what it imports (examples/megatron_guard.py and example_cli.py,
#                      tests/ddp_case.py)                                         (90-megatron)
#   DIR/deepspeed/     the gradbus wheel, deepspeed 0.19.8 built here from its sdist with
#                      DS_BUILD_OPS=0 (pure Python), the cp312 wheels of what it imports beyond torch
#                      (pinned in requirements-frameworks.txt), deepspeed_check.py and what it imports
#                      (tests/deepspeed_case.py, tests/ddp_case.py, examples/deepspeed_guard.py,
#                      examples/example_cli.py); ~7 MB                            (95-deepspeed)
#
# The gradbus wheel: built here (python/build-wheels.sh x86_64, with $PYTHON or target/pyvenv's
# python: maturin + ziglang), or WHEEL. --offline: no download (the megatron-core and deepspeed wheels
# are left out: the steps then import the machine's own; scripts/gpu-check-test.sh's CPU stand-in).
set -euo pipefail
dir=${1:?"usage: python/gpu-bundle.sh DIR [--wheel WHEEL] [--offline]"}
shift
wheel="" offline=0
while [ $# -gt 0 ]; do
  case $1 in
    --wheel) wheel=$(realpath "${2:?--wheel needs a file}") && shift ;;
    --offline) offline=1 ;;
    *) echo "gpu-bundle: unknown argument $1" >&2 && exit 2 ;;
  esac
  shift
done
src=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
guard="$dir/python-guard" mega="$dir/megatron" ds="$dir/deepspeed"
rm -rf "$guard" "$mega" "$ds"
mkdir -p "$guard/tests" "$guard/examples" "$mega" "$ds"
if [ -z "$wheel" ]; then
  PYTHON=${PYTHON:-$src/../target/pyvenv/bin/python} "$src/build-wheels.sh" "$guard" x86_64 >&2
  wheel=$(ls "$guard"/gradbus-*manylinux2014_x86_64*.whl)
else
  cp "$wheel" "$guard/"
fi
cp "$wheel" "$mega/"
cp "$wheel" "$ds/"
cp "$src/gpu_check.py" "$guard/"
cp "$src/tests/ddp_case.py" "$src/tests/fsdp_case.py" "$guard/tests/"
cp "$src/examples/fsdp_guard.py" "$src/examples/example_cli.py" "$guard/examples/"
cp "$src/gpu/megatron_check.py" "$src/examples/megatron_guard.py" "$src/examples/example_cli.py" \
  "$src/tests/ddp_case.py" "$mega/"
cp "$src/gpu/deepspeed_check.py" "$src/tests/deepspeed_case.py" "$src/tests/ddp_case.py" \
  "$src/examples/deepspeed_guard.py" "$src/examples/example_cli.py" "$ds/"
if [ $offline = 0 ]; then
  py=${PYTHON:-$src/../target/pyvenv/bin/python}
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 megatron-core==0.19.2 -d "$mega"
  # pin NAME: NAME's line of requirements-frameworks.txt; a name without one stops the bundle here
  # (its wheel would be missing on the GPU machine, found out only by an import error there).
  pin() { grep "^$1==" "$src/requirements-frameworks.txt" || { echo "gpu-bundle: no pin for $1 in python/requirements-frameworks.txt" >&2; return 2; }; }
  ds_pin=$(pin deepspeed) || exit 2
  pins=()
  for p in hjson einops msgpack py-cpuinfo pydantic pydantic_core annotated-types typing-inspection psutil tqdm; do
    line=$(pin $p) || exit 2
    pins+=("$line")
  done
  DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation "$ds_pin" -w "$ds"
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$ds" "${pins[@]}" \
    "packaging==$("$py" -c 'import packaging; print(packaging.__version__)')"
fi
ls -l "$guard" "$mega" "$ds"
