#!/usr/bin/env bash
# gpu-check: every check of the `cuda` feature that needs a GPU, in one run, ending in ONE table.
#
# The checks are the steps in scripts/gpu-check.d/, run in name order: every executable file there
# (a new check is a new file; `common.sh` is the helpers they source). A step prints its table rows
# as lines `ROW <check> | <result>` and exits 0 (passed), 1 (failed) or 3 (not checked here: no
# GPU, or a part not built yet - the rows say which). Today's steps: the CUDA kernels against their
# CPU twins with each op's tolerance, NCCL at world size 1, the health scan's bandwidth against a
# read-only kernel, GPU training against CPU training (20 steps), two GPU runs bitwise, the seed
# case's mechanism on the GPU, the fault matrix's nan/inf/kill rows with device=cuda, tokens/s
# against the PyTorch twin on the same GPU.
#
# Usage:
#   scripts/gpu-check.sh --prepare DIR    build here (cargo) and write a self-contained bundle to DIR
#                                         (<= 64 MiB: stripped binaries, configs, the PyTorch twin,
#                                         this script and its steps; DIR/MANIFEST lists what it runs);
#                                         runs nothing
#   bash DIR/gpu-check.sh --prebuilt DIR  on the GPU machine (no Rust needed): run every step from
#                                         the bundle; budget: 6 minutes on one H200
#   scripts/gpu-check.sh                  build here and run every step (a GPU machine with cargo)
#   GPU_CHECK_ONLY='10 30' ...            run only the steps whose names start with these prefixes
#
# Libraries: cudarc looks for libnvrtc.so, libcublas.so and libnccl.so (or .so.12, .so.11, ...),
# never the .so.13 / .so.2 that CUDA 13 and NCCL ship: links of those names to what this machine
# has (the torch venv's nvidia/cu13/lib, ldconfig) go into a folder at the front of LD_LIBRARY_PATH.
#
# Exit codes: 0 every step ran on a GPU and passed; 1 a step failed; 2 bad usage or build failure;
# 3 nothing failed but some step could not check (see its rows).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

mode=build
dir=""
case "${1:-}" in
  "") ;;
  --prepare | --prebuilt)
    mode=${1#--}
    dir=${2:?"$1 needs a folder"}
    ;;
  -h | --help)
    sed -n '2,30p' "$0"
    exit 0
    ;;
  *)
    echo "gpu-check: unknown argument $1 (see --help)" >&2
    exit 2
    ;;
esac

say() { printf '\n== %s\n' "$*"; }
logs=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
t_start=$(date +%s)

# ---------------------------------------------------------------- build (here, with cargo)
if [ "$mode" != prebuilt ]; then
  cd "$here/.."
  command -v cargo >/dev/null || { echo "gpu-check: cargo not found (build elsewhere with --prepare)" >&2; exit 2; }
  say "build: cargo build --release --features cuda, and the GPU test binaries"
  cargo build --release --features cuda
  cargo test --release --features cuda -p gradbus-kernels -p gradbus-collectives --no-run \
    --message-format=json >"$logs/build.json"
  # The executables of the GPU test targets: kernels' tests/cuda.rs and collectives' tests/nccl.rs.
  exe() {
    python3 -c '
import json, sys
for line in open(sys.argv[2]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    t = m.get("target", {})
    if m.get("executable") and t.get("name") == sys.argv[1] and "test" in t.get("kind", []):
        print(m["executable"])
' "$1" "$logs/build.json" | tail -n 1
  }
  kbin=$(exe cuda)
  nbin=$(exe nccl)
  [ -n "$kbin" ] && [ -n "$nbin" ] || { echo "gpu-check: test binaries not found in cargo's output" >&2; exit 2; }
  bundle=${dir:-$logs/bundle}
  rm -rf "$bundle"
  mkdir -p "$bundle/bin" "$bundle/examples" "$bundle/bench" "$bundle/gpu-check.d"
  # Debug info off (strip): the bundle must fit a 64 MiB carry.
  for b in "$kbin:kernels-cuda" "$nbin:collectives-nccl" "target/release/gradbus:gradbus"; do
    strip -o "$bundle/bin/${b#*:}" "${b%%:*}" 2>/dev/null || cp "${b%%:*}" "$bundle/bin/${b#*:}"
  done
  cp examples/tiny.toml "$bundle/examples/"
  cp bench/pytorch_grpo.py bench/workload_config.py bench/compare.py "$bundle/bench/"
  cp "$here/gpu-check.sh" "$bundle/"
  cp "$here"/gpu-check.d/* "$bundle/gpu-check.d/"
  # The PyTorch guard's wheel and check (python/gpu_check.py; run by gpu-check.d/80-python-guard).
  python/gpu-bundle.sh "$bundle" >/dev/null
  # gradbus.megatron's check with megatron-core 0.19.2's wheel (run by gpu-check.d/90-megatron).
  python/gpu/megatron-check.sh --prepare "$bundle/megatron" >/dev/null
  {
    echo "gradbus GPU check bundle, built $(date -u +%Y-%m-%dT%H:%MZ) from $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo "run on the GPU machine: bash $bundle/gpu-check.sh --prebuilt $bundle"
    echo
    echo "steps (gpu-check.d/, in order), and what each runs:"
    for s in "$bundle"/gpu-check.d/*; do
      [ -x "$s" ] || continue
      printf '  %s: %s\n' "$(basename "$s")" "$(sed -n 's/^# check: //p' "$s" | head -n 1)"
    done
    echo
    echo "files:"
    (cd "$bundle" && find . -type f | sort | while read -r f; do printf '  %-32s %9d bytes\n' "$f" "$(stat -c %s "$f")"; done)
    echo "total: $(du -sb "$bundle" | cut -f1) bytes"
  } >"$bundle/MANIFEST"
  if [ "$mode" = prepare ]; then
    cat "$bundle/MANIFEST"
    size=$(du -sb "$bundle" | cut -f1)
    if [ "$size" -gt $((64 << 20)) ]; then
      echo "gpu-check: the bundle is $size bytes, over the 64 MiB a device run carries" >&2
      exit 2
    fi
    echo "prepared: run 'bash $bundle/gpu-check.sh --prebuilt $bundle' on the GPU machine"
    exit 0
  fi
else
  bundle=$(cd "$dir" && pwd)
  [ -x "$bundle/bin/kernels-cuda" ] && [ -x "$bundle/bin/gradbus" ] && [ -d "$bundle/gpu-check.d" ] ||
    { echo "gpu-check: $dir is not a bundle (make one with --prepare DIR)" >&2; exit 2; }
fi

# ---------------------------------------------------------------- environment
say "environment"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
else
  echo "nvidia-smi: not found"
fi
libs="$logs/lib"
mkdir -p "$libs"
# A library of the torch venv's nvidia/cu13/lib (CUDA 13: NVRTC and its builtins, cuBLAS), by soname.
py=${GPU_CHECK_PYTHON:-$(command -v python3 || true)} # the python with torch (GPU machine: the torch venv)
cu13=""
if [ -n "$py" ]; then
  cu13=$("$py" -c 'import nvidia, os
for p in nvidia.__path__:
    d = os.path.join(p, "cu13", "lib")
    if os.path.isdir(d): print(d); break' 2>/dev/null || true)
fi
link() { # link NAME SONAME...: the first SONAME found (cu13 dir, then ldconfig) as NAME in $libs
  local name=$1 so path
  shift
  for so in "$@"; do
    path=""
    [ -n "$cu13" ] && [ -e "$cu13/$so" ] && path="$cu13/$so"
    [ -z "$path" ] && path=$( (ldconfig -p 2>/dev/null | awk -v s="$so" '$1 == s {print $NF; exit}') || true)
    if [ -n "$path" ]; then
      ln -sf "$path" "$libs/$name"
      echo "$name -> $path"
      return 0
    fi
  done
  echo "$name: none of $* found"
}
link libnvrtc.so libnvrtc.so.13 libnvrtc.so.12
link libcublas.so libcublas.so.13 libcublas.so.12
link libnccl.so libnccl.so.2
[ -z "$(ls "$libs" 2>/dev/null | grep nccl)" ] && [ -n "$py" ] && {
  nccl2=$("$py" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null || true)
  [ -n "$nccl2" ] && [ -e "$nccl2" ] && ln -sf "$nccl2" "$libs/libnccl.so" && echo "libnccl.so -> $nccl2"
}
export LD_LIBRARY_PATH="$libs${cu13:+:$cu13}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export GPU_CHECK_BUNDLE="$bundle" GPU_CHECK_LOGS="$logs" GPU_CHECK_PYTHON="${py:-python3}"

# ---------------------------------------------------------------- steps
: >"$logs/rows"
status=0
for step in "$bundle"/gpu-check.d/*; do
  [ -f "$step" ] && [ -x "$step" ] || continue
  name=$(basename "$step")
  if [ -n "${GPU_CHECK_ONLY:-}" ]; then
    keep=0
    for p in $GPU_CHECK_ONLY; do case "$name" in "$p"*) keep=1 ;; esac; done
    [ $keep = 1 ] || continue
  fi
  say "step $name: $(sed -n 's/^# check: //p' "$step" | head -n 1)"
  t0=$(date +%s)
  set +e
  (cd "$bundle" && timeout "${GPU_CHECK_STEP_TIMEOUT:-150}" "$step") 2>&1 | tee "$logs/$name.log"
  rc=${PIPESTATUS[0]}
  set -e
  secs=$(($(date +%s) - t0))
  grep -a '^ROW ' "$logs/$name.log" | sed 's/^ROW //' >>"$logs/rows" || true
  case $rc in
    0) verdict="passed" ;;
    3) verdict="NOT CHECKED"; [ $status = 0 ] && status=3 ;;
    124) verdict="TIMED OUT"; status=1 ;;
    *) verdict="FAILED (exit $rc)"; status=1 ;;
  esac
  echo "$name | $verdict in $secs s" >>"$logs/rows"
done

# ---------------------------------------------------------------- the table
say "gpu-check summary ($(($(date +%s) - t_start)) s; logs in $logs)"
awk -F' [|] ' '{ printf "%-44s %s\n", $1, $2 }' "$logs/rows"
case $status in
  0) echo "gpu-check: every step ran on a GPU and passed" ;;
  3) echo "gpu-check: nothing failed, but some step could not check (NOT CHECKED rows)" ;;
  *) echo "gpu-check: FAILED (see the rows above and the logs)" ;;
esac
exit $status
