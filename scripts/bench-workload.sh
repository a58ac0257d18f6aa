#!/usr/bin/env bash
# The reference workload, gradbus vs PyTorch (DistributedDataParallel over gloo, CPU, one thread per
# process), side by side: builds gradbus (release), installs torch into a venv when missing, runs
# bench/compare.py, which alternates the two sides for a few repetitions and prints tokens/s and the
# ratio. PyTorch is a benchmark-only dependency: this script is the only thing that installs it.
#
# Usage: scripts/bench-workload.sh [--size tiny,3.2M] [--simd LEVEL] [--steps S] [--reps N] [--ranks 2,1] [--set key=value ...]
#   --size  the model sizes, one comparison each (default tiny): tiny = examples/tiny.toml as it is
#           (103,168 parameters); 3.2M = --set model.channels=256 --set model.layers=4 (3,171,840
#           parameters), with --steps 8 unless --steps is given (an update is ~50x the tiny one's).
#   --simd  the instruction set BOTH sides may use, as if the CPU had no more: avx2, avx or
#           baseline (default: all this CPU has). gradbus: GRADBUS_SIMD=LEVEL; PyTorch: ATen's
#           ATEN_CPU_CAPABILITY, MKL's MKL_ENABLE_INSTRUCTIONS and oneDNN's ONEDNN_MAX_CPU_ISA. So an
#           AVX-512 machine measures what an AVX2-only CPU of its clock would give. The paths that
#           ran are printed first.
# Env:   BENCH_PYTHON  a python that already has torch (default: /tmp/torchvenv if present, else
#                      .venv-bench/, created here and git-ignored)
#        BENCH_CONFIG  the config (default examples/tiny.toml)
# The loss style defaults to "safe" on both sides (pass --set loss.style=roll to compare ROLL's).
set -euo pipefail
cd "$(dirname "$0")/.."

py="${BENCH_PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x /tmp/torchvenv/bin/python ] && /tmp/torchvenv/bin/python -c 'import torch' 2>/dev/null; then
    py=/tmp/torchvenv/bin/python
  else
    py=.venv-bench/bin/python
  fi
fi
if ! "$py" -c 'import torch, tomllib' 2>/dev/null; then
  if [ "$py" != .venv-bench/bin/python ]; then
    echo "BENCH_PYTHON=$py has no torch (or is older than Python 3.11)" >&2
    exit 2
  fi
  if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "need python3 >= 3.11 (tomllib) to create .venv-bench" >&2
    exit 2
  fi
  echo "installing torch into .venv-bench from PyPI (benchmark only; the wheel pulls ~3 GB)" >&2
  python3 -m venv .venv-bench
  .venv-bench/bin/pip install -q --upgrade pip
  .venv-bench/bin/pip install -q -r bench/requirements.txt
fi

sizes=tiny
simd=
steps_given=0
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --size) sizes="$2"; shift 2 ;;
    --size=*) sizes="${1#--size=}"; shift ;;
    --steps|--steps=*) steps_given=1; args+=("$1"); shift ;;
    --simd) simd="$2"; shift 2 ;;
    --simd=*) simd="${1#--simd=}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done

case "$simd" in
  "") ;;
  avx2) export GRADBUS_SIMD=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ;;
  avx) export GRADBUS_SIMD=avx ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=AVX ONEDNN_MAX_CPU_ISA=AVX ;;
  baseline) export GRADBUS_SIMD=baseline ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41 ;;
  *) echo "--simd: unknown level '$simd' (hint: avx2, avx or baseline; leave it out for all this CPU has)" >&2; exit 2 ;;
esac

cargo build --release --quiet
cargo build --release --quiet -p gradbus-kernels --example workbench
echo "== CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
echo "== gradbus path: $("${CARGO_TARGET_DIR:-target}/release/examples/workbench" simd | head -1)"
echo "== PyTorch path: ATen $("$py" -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')," \
  "MKL_ENABLE_INSTRUCTIONS=${MKL_ENABLE_INSTRUCTIONS:-unset} ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-unset}"

for size in ${sizes//,/ }; do
  case "$size" in
    tiny) extra=() ;;
    3.2M) extra=(--set model.channels=256 --set model.layers=4)
          [ "$steps_given" = 1 ] || extra+=(--steps 8) ;;
    *) echo "--size: unknown size '$size' (hint: tiny, 3.2M or both, comma-separated)" >&2; exit 2 ;;
  esac
  echo "== size $size (load average $(cut -d' ' -f1-3 /proc/loadavg))"
  "$py" bench/compare.py --config "${BENCH_CONFIG:-examples/tiny.toml}" --python "$py" \
    --gradbus "${CARGO_TARGET_DIR:-target}/release/gradbus" --set loss.style=safe "${extra[@]}" "${args[@]}"
done
