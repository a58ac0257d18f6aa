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
# The GPU check bundle carries the same folder (python/gpu-bundle.sh writes both; scripts/gpu-check.d/
# 90-megatron runs it): this script is that one part, alone.
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
    [ -x target/pyvenv/bin/maturin ] || { echo "megatron-check: no target/pyvenv (run python/test.sh first)" >&2; exit 2; }
    # The GPU bundle's megatron folder (python/gpu-bundle.sh), alone.
    tmp=$(mktemp -d)
    python/gpu-bundle.sh "$tmp" >/dev/null
    mkdir -p "$dir"
    rm -f "$dir"/*.whl
    cp "$tmp"/megatron/* "$dir"/
    rm -rf "$tmp"
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
