#!/usr/bin/env bash
# The GPU check of gradbus.megatron (python/gpu/megatron_check.py) for a GPU machine without a package
# registry: --prepare builds everything it needs here, into one folder, and --prebuilt runs it there.
#
#   python/gpu/megatron-check.sh --prepare DIR    here: the gradbus wheel (abi3), megatron-core 0.19.2's
#                                                 cp312 wheel (pip download, no deps), the check script
#                                                 and the test helpers it imports; ~5 MB
#   python/gpu/megatron-check.sh --prebuilt DIR [ARGS]  there: unpacks the wheels into DIR/site (no
#                                                 pip, no network; the machine's python3 has torch,
#                                                 numpy and triton) and runs the check on GPU 0, with
#                                                 ARGS (megatron_check.py --help; --cpu: a dry run)
#
# scripts/gpu-check.sh --prepare calls --prepare into its bundle, and its step gpu-check.d/90-megatron runs it.
# Exit codes: the check's (0 passed, 1 a check failed, 3 no CUDA device: SKIPPED), 2 bad usage.
set -euo pipefail
mode=${1:-}
dir=${2:-}
[ -n "$dir" ] || { sed -n '2,14p' "$0"; exit 2; }
dir=$(realpath -m "$dir")
shift 2
cd "$(dirname "$0")/../.."
case "$mode" in
  --prepare)
    venv=target/pyvenv
    [ -x "$venv/bin/maturin" ] || { echo "megatron-check: no $venv (run python/test.sh first)" >&2; exit 2; }
    mkdir -p "$dir"
    rm -f "$dir"/*.whl
    "$venv/bin/maturin" build --release --quiet -m python/Cargo.toml -o "$dir"
    "$venv/bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_28_x86_64 megatron-core==0.19.2 -d "$dir"
    cp python/gpu/megatron_check.py python/examples/megatron_guard.py python/tests/ddp_case.py "$dir"/
    ls -l "$dir"
    echo "prepared: run 'python/gpu/megatron-check.sh --prebuilt $dir' on the GPU machine"
    ;;
  --prebuilt)
    rm -rf "$dir/site"
    for w in "$dir"/*.whl; do python3 -m zipfile -e "$w" "$dir/site"; done
    PYTHONPATH="$dir/site:$dir${PYTHONPATH:+:$PYTHONPATH}" python3 "$dir/megatron_check.py" "$@"
    ;;
  *)
    sed -n '2,14p' "$0"
    exit 2
    ;;
esac
