#!/usr/bin/env bash
# gpu-check: the checks of the `cuda` feature that need a GPU, in one run, with a table at the end.
#
#   1. build: `cargo build --release --features cuda` and the GPU test binaries
#   2. kernels/tests/cuda.rs: every CUDA kernel against its CPU twin on fresh random inputs
#   3. collectives/tests/nccl.rs: the NCCL transport with world size 1 (one GPU)
#   4. the health scan's read bandwidth against a device-to-device copy of the same buffer
#      (the #[ignore] test `health_scan_throughput`; target: >= 90% of the copy's read bandwidth)
#
# Usage:
#   scripts/gpu-check.sh                  build here (needs cargo) and run everything
#   scripts/gpu-check.sh --prepare DIR    build here and copy the (stripped) test binaries into DIR,
#                                         for a GPU machine without a Rust toolchain; runs nothing
#   scripts/gpu-check.sh --prebuilt DIR   run the binaries that --prepare left in DIR
#
# Exit codes: 0 every check ran on a GPU and passed; 1 a test failed; 2 bad usage or build failure;
# 3 the tests ran but skipped their GPU parts (no CUDA driver or device): nothing was checked.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=build
dir=""
case "${1:-}" in
  "") ;;
  --prepare | --prebuilt)
    mode=${1#--}
    dir=${2:?"$1 needs a folder"}
    ;;
  -h | --help)
    sed -n '2,20p' "$0"
    exit 0
    ;;
  *)
    echo "gpu-check: unknown argument $1 (see --help)" >&2
    exit 2
    ;;
esac

say() { printf '\n== %s\n' "$*"; }
logs=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
build_result="prebuilt ($dir)"

# ---------------------------------------------------------------- build
if [ "$mode" != prebuilt ]; then
  command -v cargo >/dev/null || { echo "gpu-check: cargo not found (use --prebuilt DIR)" >&2; exit 2; }
  say "build: cargo build --release --features cuda"
  t0=$(date +%s)
  cargo build --release --features cuda
  say "build: GPU test binaries"
  cargo test --release --features cuda -p gradbus-kernels -p gradbus-collectives --no-run \
    --message-format=json >"$logs/build.json"
  build_result="ok ($(($(date +%s) - t0)) s)"
  # The executables of the two GPU test targets: kernels' tests/cuda.rs and collectives' tests/nccl.rs.
  exe() {
    python3 -c '
import json, sys
want = sys.argv[1]
for line in open(sys.argv[2]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    t = m.get("target", {})
    if m.get("executable") and t.get("name") == want and "test" in t.get("kind", []):
        print(m["executable"])
' "$1" "$logs/build.json" | tail -n 1
  }
  kbin=$(exe cuda)
  nbin=$(exe nccl)
  [ -n "$kbin" ] && [ -n "$nbin" ] || { echo "gpu-check: test binaries not found in cargo's output" >&2; exit 2; }
  if [ "$mode" = prepare ]; then
    mkdir -p "$dir"
    for b in "$kbin:kernels-cuda" "$nbin:collectives-nccl"; do
      # Debug info off: the binaries must fit a 64 MiB carry.
      strip -o "$dir/${b#*:}" "${b%%:*}" 2>/dev/null || cp "${b%%:*}" "$dir/${b#*:}"
    done
    python/gpu-check-step.sh prepare "$dir" # the PyTorch guard's wheel and check (python/gpu_check.py)
    ls -l "$dir"
    echo "prepared: run 'scripts/gpu-check.sh --prebuilt $dir' on the GPU machine"
    exit 0
  fi
else
  kbin="$dir/kernels-cuda"
  nbin="$dir/collectives-nccl"
  [ -x "$kbin" ] && [ -x "$nbin" ] || { echo "gpu-check: $dir lacks kernels-cuda / collectives-nccl (run --prepare)" >&2; exit 2; }
fi

# ---------------------------------------------------------------- environment
say "environment"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
else
  echo "nvidia-smi: not found"
fi
# cudarc looks for libnccl.so / libnccl.so.{12,11,10,9,1}, never libnccl.so.2 (NCCL's soname, and the
# only name the nvidia-nccl-cu12 wheel and the runtime package ship): give it a libnccl.so.
shim="$logs/lib"
mkdir -p "$shim"
nccl2=$( (ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 /{print $NF; exit}') || true)
if [ -z "$nccl2" ] && command -v python3 >/dev/null; then
  nccl2=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null || true)
fi
if [ -n "$nccl2" ] && [ -e "$nccl2" ]; then
  ln -sf "$nccl2" "$shim/libnccl.so"
  echo "NCCL: $nccl2 (linked as libnccl.so in $shim)"
else
  echo "NCCL: libnccl.so.2 not found (the NCCL test will fail unless libnccl.so is on the library path)"
fi
export LD_LIBRARY_PATH="$shim${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# ---------------------------------------------------------------- tests
failed=0
# run NAME BINARY ARGS...: the test binary's output goes to the terminal and to $logs/NAME.log.
run() {
  local name=$1
  shift
  say "$name: $*"
  if ! "$@" --test-threads=1 2>&1 | tee "$logs/$name.log"; then
    failed=1
  fi
}
run kernels "$kbin"
run nccl "$nbin"
run throughput "$kbin" --ignored --exact health_scan_throughput --nocapture
# The PyTorch guard with CUDA tensors (python/gpu_check.py: its own table; exit 3 without a GPU).
[ "$mode" = prebuilt ] || python/gpu-check-step.sh prepare "$logs" >/dev/null
python/gpu-check-step.sh run "${dir:-$logs}" 2>&1 | tee "$logs/python.log" || [ "${PIPESTATUS[0]}" = 3 ] || failed=1

# ---------------------------------------------------------------- table
result() { # the test harness's closing line, shortened; "no result line" when it crashed
  local r
  r=$(grep -h '^test result:' "$logs/$1.log" | tail -n 1 | sed 's/^test result: //; s/; finished in.*//') || true
  echo "${r:-no result line (crashed?)}"
}
# Not anchored: with one test thread the harness prints "test NAME ... " before the test's own line.
skipped=$(cat "$logs/kernels.log" "$logs/nccl.log" "$logs/throughput.log" "$logs/python.log" | grep -o 'SKIPPED: no CUDA' | wc -l)

say "gpu-check summary"
printf '%-34s %s\n' "check" "result"
printf '%-34s %s\n' "----------------------------------" "----------------------------------------------"
printf '%-34s %s\n' "build --features cuda" "$build_result"
printf '%-34s %s\n' "kernels vs CPU (tests/cuda.rs)" "$(result kernels)"
printf '%-34s %s\n' "NCCL world 1 (tests/nccl.rs)" "$(result nccl)"
printf '%-34s %s\n' "python guard (python/gpu_check.py)" "$(tail -n 1 "$logs/python.log")"
printf '%-34s %s\n' "tests that skipped (no GPU)" "$skipped"
verdict=""
while read -r line; do
  # THROUGHPUT 256 MiB: health_scan X GB/s read (T us) | dtod copy Y GB/s read, Z GB/s read+write (U us) | scan/copy-read P% | ...
  size=$(sed 's/^THROUGHPUT \([0-9]* MiB\).*/\1/' <<<"$line")
  scan=$(sed 's/.*health_scan \([0-9]*\) GB\/s.*/\1/' <<<"$line")
  copy=$(sed 's/.*dtod copy \([0-9]*\) GB\/s read,.*/\1/' <<<"$line")
  pct=$(sed 's/.*scan\/copy-read \([0-9]*\)%.*/\1/' <<<"$line")
  pct2=$(sed 's/.*scan\/copy-read+write \([0-9]*\)%.*/\1/' <<<"$line")
  printf '%-34s %s\n' "health scan, $size" \
    "scan $scan GB/s, copy read $copy GB/s: $pct% of the copy's read bandwidth ($pct2% of its read+write)"
  if [ "$pct" -lt 90 ]; then verdict="BELOW TARGET"; fi
done < <(grep -o 'THROUGHPUT.*' "$logs/throughput.log" || true)
if grep -q 'THROUGHPUT' "$logs/throughput.log"; then
  printf '%-34s %s\n' "target: scan >= 90% of copy read" "${verdict:-met}"
else
  printf '%-34s %s\n' "health scan throughput" "not measured"
fi
echo "logs: $logs"

if [ "$failed" != 0 ]; then
  echo "gpu-check: FAILED (a test failed; see the logs above)"
  exit 1
fi
if [ "$skipped" != 0 ]; then
  echo "gpu-check: NOTHING CHECKED - the GPU tests skipped (no CUDA driver or device on this machine)"
  exit 3
fi
echo "gpu-check: all GPU checks passed"
