#!/usr/bin/env bash
# gpu-check-test: the self-test of scripts/gpu-check.sh's verdicts and of every step's shell logic,
# on a machine without a GPU (scripts/test.sh runs it in CI), so that the one short run on a GPU
# meets no untested line of shell or Python. A stand-in `nvidia-smi` on PATH lists 0, 1 or 2 GPUs.
#
#   1. verdicts, with stand-in steps: an empty selection fails; no GPU listed exits 3 with every row
#      NOT CHECKED and no step run, but an NVIDIA GPU on the PCI bus (a stand-in /sys/bus/pci/devices)
#      or a /dev/nvidia* with none listed fails; a step with fewer checks than its floor fails; a
#      missed target is TARGET MISSED (exit 4), a failure beside it exit 1; a step's NOTRUN line makes
#      it PARTLY RUN (exit 6), never passed; a step's exit 3 on a GPU machine, a step over its budget
#      (killed, children too), a malformed header or TARGET line fail; a step needing 2 GPUs is NOT
#      RUN on 1 and runs on 2; a step without its run bit runs; GPU_CHECK_DEVICE=cpu exits 5, never 0.
#   2. a GPU listed that cannot be used: the real test binaries (kernels' tests/cuda.rs,
#      collectives' tests/nccl.rs, built with `--features cuda`) and the real gradbus with the real
#      steps 10, 20 and 40 fail, each saying why.
#   3. no GPU listed, the real steps: exit 3, every row NOT CHECKED.
#   4. the CPU stand-in (--stand-in, or all: the default): every real step with GPU_CHECK_DEVICE=cpu
#      - gradbus runs with device = "cpu", gpu_check.py, megatron_check.py, deepspeed_check.py with
#      --cpu, and for the GPU test binaries stand-ins that print what they print on a GPU (their own
#      test lists) - and a stray GRADBUS_TRANSPORT=shm in the environment (the steps pin the path of
#      each run and check the worker's line naming it). Every step passes (benchmarks: passed or
#      TARGET MISSED: a CPU's speed says nothing); the run exits 5 (a stand-in is never a pass).
#
# Usage: scripts/gpu-check-test.sh [--verdicts | --stand-in]   (default: both)
# Needs: cargo (it builds the `cuda` test binaries and target/release/gradbus if missing); a python
# with torch, gradbus, megatron-core and deepspeed: GPU_CHECK_PYTHON, default target/pyvenv-clean/bin/python
# (python/test.sh makes it), and the gradbus wheel in target/pywheels. Exit 0 all as expected, 1 not.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
part=${1:-all}
case $part in all | --verdicts | --stand-in) ;; *) sed -n '2,/^set -euo/p' "$0" | sed '$d' && exit 2 ;; esac
tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
t_start=$(date +%s)
bad=0
ok() { echo "ok: $*"; }
no() {
  echo "NOT AS EXPECTED: $*"
  bad=$((bad + 1))
}

# ---------------------------------------------------------------- stand-ins
# nvidia-smi listing N GPUs: $tmp/smiN/nvidia-smi.
for n in 0 1 2; do
  mkdir -p "$tmp/smi$n"
  {
    echo '#!/usr/bin/env bash'
    echo "n=$n"
    cat <<'EOF'
case "$*" in
  -L) for ((i = 0; i < n; i++)); do echo "GPU $i: NVIDIA H200 (UUID: GPU-stand-in-$i)"; done
      [ "$n" -gt 0 ] || { echo "No devices were found"; exit 6; } ;;
  *) for ((i = 0; i < n; i++)); do echo "NVIDIA H200, 580.00, 143771 MiB"; done ;;
esac
EOF
  } >"$tmp/smi$n/nvidia-smi"
  chmod +x "$tmp/smi$n/nvidia-smi"
done
mkdir -p "$tmp/nodev" # GPU_CHECK_DEV: no NVIDIA device files
# GPU_CHECK_PCI, the PCI bus as sysfs shows it: pci-none has no NVIDIA display device (an NVSwitch, a
# virtio GPU), pci-gpu an H200 besides.
pci_fn() { mkdir -p "$1" && echo "$2" >"$1/vendor" && echo "$3" >"$1/class"; }
pci_fn "$tmp/pci-none/0000:00:01.0" 0x10de 0x068000
pci_fn "$tmp/pci-none/0000:00:02.0" 0x1af4 0x030000
cp -r "$tmp/pci-none" "$tmp/pci-gpu"
pci_fn "$tmp/pci-gpu/0000:17:00.0" 0x10de 0x030200

# run_check BUNDLE GPUS [VAR=VALUE...]: gpu-check.sh --prebuilt BUNDLE with the stand-in nvidia-smi of
# GPUS on PATH; its output in $out, its exit code in $rc.
run_check() {
  local b=$1 n=$2
  shift 2
  set +e
  # A driver that hangs must not hang CI: an hour is far past every budget here.
  out=$(env PATH="$tmp/smi$n:$PATH" GPU_CHECK_DEV="$tmp/nodev" GPU_CHECK_PCI="$tmp/pci-none" TMPDIR="$tmp" "$@" timeout 3600 bash "$b/gpu-check.sh" --prebuilt "$b" 2>&1)
  rc=$?
  set -e
}
# show: the table of $out (or its last lines), indented.
show() { { grep -q '== gpu-check summary' <<<"$out" && sed -n '/== gpu-check summary/,$p' <<<"$out" || tail -n 25 <<<"$out"; } | sed 's/^/    | /'; }
# expect WHAT RC PATTERN...: $rc is RC and every PATTERN (grep -E) is in $out.
expect() {
  local what=$1 want=$2 p
  shift 2
  if [ "$rc" != "$want" ]; then
    no "$what: exit $rc, want $want"
    show
    return
  fi
  for p in "$@"; do
    if ! grep -qE -- "$p" <<<"$out"; then
      no "$what: no line matching '$p'"
      show
      return
    fi
  done
  ok "$what (exit $rc)"
  [ -z "${SHOW:-}" ] || show
}

# The binaries: the `cuda` test targets (their paths from cargo) and gradbus.
binaries() {
  # Any build of gradbus will do (the stand-in runs it with device = "cpu"): CI's is the default.
  [ -x target/release/gradbus ] || cargo build --release -q
  cargo test --release -q --features cuda -p gradbus-kernels -p gradbus-collectives --test cuda --test nccl \
    --no-run --message-format=json 2>/dev/null >"$tmp/build.json"
  exe() {
    python3 -c 'import json, sys
for l in open(sys.argv[1]):
    m = json.loads(l) if l.startswith("{") else {}
    if m.get("executable") and m.get("target", {}).get("name") == sys.argv[2]: print(m["executable"])' \
      "$tmp/build.json" "$1" | tail -n 1
  }
  kbin=$(exe cuda) nbin=$(exe nccl)
  [ -x "$kbin" ] && [ -x "$nbin" ] || { echo "gpu-check-test: the cuda test binaries were not built" >&2; exit 1; }
}

# bundle DIR STEPS_DIR: a bundle of the real gpu-check.sh and common.sh with the steps of STEPS_DIR,
# the real binaries, examples and bench scripts.
bundle() {
  mkdir -p "$1/bin" "$1/examples" "$1/bench" "$1/gpu-check.d"
  cp scripts/gpu-check.sh "$1/"
  cp "$2"/* "$1/gpu-check.d/"
  cp -n scripts/gpu-check.d/common.sh "$1/gpu-check.d/"
  cp "$kbin" "$1/bin/kernels-cuda"
  cp "$nbin" "$1/bin/collectives-nccl"
  cp target/release/gradbus "$1/bin/gradbus"
  cp examples/tiny.toml "$1/examples/"
  cp bench/pytorch_grpo.py bench/workload_config.py bench/compare.py "$1/bench/"
}

# A test binary as it runs on a GPU: every test of the real binary's list passes, the no-driver test
# prints its SKIPPED line ("a CUDA driver is present"); `--ignored --exact health_scan_throughput`
# prints the benchmark's lines (scan/read $SCAN_PCT%). Written from the real binary's --list.
fake_test_binary() {
  local real=$1 dst=$2
  "$real" --list 2>/dev/null | sed -n 's/: test$//p' >"$dst.list"
  "$real" --list --ignored 2>/dev/null | sed -n 's/: test$//p' >"$dst.ignored"
  cat >"$dst" <<EOF
#!/usr/bin/env bash
list=$dst.list ignored=$dst.ignored
EOF
  cat >>"$dst" <<'EOF'
if [[ " $* " == *" --ignored "* ]]; then
  echo "device: NVIDIA H200 (stand-in)"
  echo "THROUGHPUT 256 MiB: health_scan 2400 GB/s (111.8 us) | read_only 2600 GB/s (103.2 us) | scan/read ${SCAN_PCT:-95}%"
  echo "THROUGHPUT 1024 MiB: health_scan 3100 GB/s (346.3 us) | read_only 3300 GB/s (325.3 us) | scan/read ${SCAN_PCT:-95}%"
  echo "test health_scan_throughput ... ok"
  echo "test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 2.00s"
  exit 0
fi
# --skip NAME and --exact NAME, as libtest takes them.
skip=() exact=""
while [ $# -gt 0 ]; do
  case $1 in --skip) skip+=("$2"); shift ;; --exact) exact=next ;; -*) ;; *) [ "$exact" = next ] && exact=$1 ;; esac
  shift
done
n=0 f=0
while read -r t; do
  grep -qxF "$t" "$ignored" && continue
  [ -n "$exact" ] && [ "$exact" != next ] && [ "$t" != "$exact" ] && { f=$((f + 1)); continue; }
  for s in "${skip[@]}"; do [[ $t == *"$s"* ]] && continue 2; done
  case $t in
    *without_a_driver*) echo "SKIPPED: a CUDA driver is present (stand-in)" >&2 ;;
    *attention*) echo "TOLERANCE NVIDIA H200 (stand-in): attention forward: rtol 2e-6, worst |kernel - CPU| / tolerance 0.125" >&2 ;;
  esac
  echo "test $t ... ok"
  n=$((n + 1))
done <"$list"
echo "test result: ok. $n passed; 0 failed; 0 ignored; 0 measured; $f filtered out; finished in 1.00s"
EOF
  chmod +x "$dst"
}

# ---------------------------------------------------------------- 1. verdicts, stand-in steps
verdicts() {
  echo "== 1. verdicts, with stand-in steps"
  local v="$tmp/v" s="$tmp/v-steps"
  # step FILE BUDGET FLOOR BODY [GPUS]: a stand-in step.
  step() {
    printf '#!/usr/bin/env bash\n# check: stand-in %s\n# budget: %s\n# floor: %s\n%s%s\n' \
      "$(basename "$1")" "$2" "$3" "${5:+# gpus: $5
}" "$4" >"$1"
    chmod +x "$1"
  }
  reset_steps() { rm -rf "$s" && mkdir -p "$s"; }
  rebundle() { rm -rf "$v" && bundle "$v" "$s"; }
  reset_steps
  step "$s/10-good" 10 2 "touch \"\$GPU_CHECK_LOGS/ran-10\"; echo 'ROW good | fine'; echo 'CHECKS 2'"
  step "$s/20-bench" 10 1 "echo 'CHECKS 1'; echo 'TARGET speed | 2.5 | >= 2'; echo 'TARGET cost | 1.01 | <= 1.02'"
  rebundle
  run_check "$v" 1 GPU_CHECK_ONLY=99
  expect "an empty selection (GPU_CHECK_ONLY=99) fails" 1 "FAILED: no step selected"
  run_check "$v" 1 GPU_CHECK_ONLY=' '
  expect "GPU_CHECK_ONLY of blanks (naming nothing) fails" 1 "FAILED: no step selected"
  run_check "$v" 1 GPU_CHECK_ONLY=
  expect "GPU_CHECK_ONLY set but empty fails" 1 "FAILED: no step selected"
  run_check "$v" 0
  expect "no GPU listed: exit 3, every row NOT CHECKED" 3 "^10-good +NOT CHECKED: no GPU here" \
    "^20-bench +NOT CHECKED" "NO GPU: nvidia-smi lists none"
  if ls "$tmp"/gpu-check.*/ran-10 >/dev/null 2>&1 || grep -q '^== step' <<<"$out"; then no "no GPU: a step ran"; else ok "no GPU: no step ran"; fi
  run_check "$v" 1 PATH="$tmp/nodev:/usr/bin:/bin"
  expect "no nvidia-smi at all, no NVIDIA GPU on the PCI bus: exit 3" 3 "NO GPU: nvidia-smi lists none"
  mkdir -p "$tmp/devs" && : >"$tmp/devs/nvidia0"
  run_check "$v" 0 GPU_CHECK_DEV="$tmp/devs"
  expect "no GPU listed but /dev/nvidia0 there: fails" 1 "nvidia-smi lists no GPU, but 1 NVIDIA device file"
  # A GPU on the PCI bus whose driver is not loaded: no device files, nvidia-smi lists none (it says
  # why, and the verdict quotes it), or there is no nvidia-smi at all.
  run_check "$v" 0 GPU_CHECK_PCI="$tmp/pci-gpu"
  expect "an NVIDIA GPU on the PCI bus, nvidia-smi listing none: fails with nvidia-smi's words" 1 \
    "FAILED: 1 NVIDIA GPU\(s\) on the PCI bus \($tmp/pci-gpu\), but nvidia-smi lists none: the driver is not loaded or cannot open them; nvidia-smi -L said: No devices were found"
  if ls "$tmp"/gpu-check.*/ran-10 >/dev/null 2>&1; then no "a GPU on the PCI bus, none listed: a step ran"; fi
  run_check "$v" 0 GPU_CHECK_PCI="$tmp/pci-gpu" PATH="$tmp/nodev:/usr/bin:/bin"
  expect "an NVIDIA GPU on the PCI bus, no nvidia-smi: fails" 1 "nvidia-smi lists none: .*nvidia-smi -L said: nvidia-smi: not found"
  run_check "$v" 1
  expect "a GPU listed, every step good, targets met: exit 0" 0 "^10-good +passed: 2 checks \(floor 2\)" \
    "^  target: speed: 2.5 \(target >= 2\) +met" "^  target: cost: 1.01 \(target <= 1.02\) +met" "gpu-check: passed"
  run_check "$v" 1 GPU_CHECK_DEVICE=cpu
  expect "the same with GPU_CHECK_DEVICE=cpu left in the environment: exit 5, not a pass" 5 \
    "^10-good +passed: 2 checks" "gpu-check: CPU STAND-IN \(GPU_CHECK_DEVICE=cpu\): nothing failed, but nothing ran on a GPU"

  step "$s/20-bench" 10 1 "echo 'CHECKS 1'; echo 'TARGET speed | 1.5 | >= 2'; echo 'TARGET cost | 1.01 | <= 1.02'"
  rebundle
  run_check "$v" 1
  expect "a missed target: its own verdict, exit 4" 4 "^  target: speed: 1.5 \(target >= 2\) +MISSED" \
    "^20-bench +TARGET MISSED: 1 of 2 targets" "gpu-check: TARGET MISSED"
  step "$s/30-few" 10 3 "echo 'ROW few | made one check'; echo 'CHECKS 1'"
  rebundle
  run_check "$v" 1
  expect "too few checks beside a missed target: exit 1" 1 "^30-few +FAILED: 1 checks made, below its floor of 3" "gpu-check: FAILED"
  run_check "$v" 1 GPU_CHECK_ONLY=30
  expect "a step with too few checks fails" 1 "^30-few +FAILED: 1 checks made, below its floor of 3"
  # NOTRUN: a check the step could not run (its documented reason): shown, counted, never a pass.
  step "$s/40-part" 10 3 "echo 'ROW fine | ok'; echo 'NOTRUN fsdp | torch refuses it here'; echo 'NOTRUN fsdp skip | the same'; echo 'CHECKS 1'"
  rebundle
  run_check "$v" 1 GPU_CHECK_ONLY='10 40'
  expect "a step's NOTRUN lines: rows NOT RUN, the step PARTLY RUN, exit 6" 6 "^fsdp +NOT RUN: torch refuses it here$" \
    "^fsdp skip +NOT RUN: the same$" "^40-part +PARTLY RUN: 2 check\(s\) NOT RUN \(their rows say why\), 1 passed: not a pass" \
    "gpu-check: PARTLY RUN: every check that ran passed, but 2 did not run .*1 partly run \(2 checks NOT RUN\)"
  run_check "$v" 1 GPU_CHECK_ONLY='20 40'
  expect "PARTLY RUN beside a missed target: exit 6" 6 "^20-bench +TARGET MISSED" "^40-part +PARTLY RUN"
  step "$s/40-part" 10 4 "echo 'NOTRUN fsdp | torch refuses it here'; echo 'CHECKS 2'"
  rebundle
  run_check "$v" 1 GPU_CHECK_ONLY=40
  expect "checks made and not run below the floor fail" 1 "^40-part +FAILED: 2 checks made and 1 not run, below its floor of 4"

  reset_steps
  step "$s/10-nogpu" 10 1 "echo 'ROW kernels | SKIPPED: no CUDA driver (libcuda.so.1: cannot open)'; exit 3"
  step "$s/20-slow" 2 1 "tail -f /dev/null & echo \$! >\"\$GPU_CHECK_LOGS/child\"; mkfifo \"\$GPU_CHECK_LOGS/fifo\"; read -r x <\"\$GPU_CHECK_LOGS/fifo\"; echo 'CHECKS 1'"
  step "$s/30-noheader" 10 1 "echo 'CHECKS 5'"
  sed -i '/^# floor/d' "$s/30-noheader"
  step "$s/40-badtarget" 10 1 "echo 'CHECKS 1'; echo 'TARGET speed | fast | >= 2'"
  step "$s/50-norunbit" 10 1 "tail -f /dev/null & echo \$! >\"\$GPU_CHECK_LOGS/left\"; echo 'CHECKS 1'"
  chmod -x "$s/50-norunbit"
  step "$s/60-two" 10 1 "echo 'CHECKS 1'" 2
  rebundle
  chmod -x "$v/gpu-check.d/50-norunbit"
  run_check "$v" 1
  expect "failures each with its reason, exit 1" 1 \
    "^10-nogpu +FAILED \(exit 3\): SKIPPED: no CUDA driver \(libcuda.so.1: cannot open\)" \
    "^20-slow +FAILED: over its budget of 2 s" \
    "^30-noheader +FAILED: no '# floor: <checks>' line" \
    "^40-badtarget +FAILED: 1 malformed TARGET line" \
    "^50-norunbit +passed: 1 checks" \
    "^60-two +NOT RUN: needs 2 GPUs, nvidia-smi lists 1"
  local child
  child=$(cat "$tmp"/gpu-check.*/child 2>/dev/null || true)
  # Alive: a process that is not a zombie (a killed child waits as one until its new parent reaps it).
  if [ -n "$child" ] && ps -o stat= -p "$child" | grep -qv '^Z'; then
    no "a step over its budget left its child $child running"
    kill "$child"
  else
    ok "a step over its budget is killed with its children"
  fi
  child=$(cat "$tmp"/gpu-check.*/left 2>/dev/null || true)
  if [ -z "$child" ] || ps -o stat= -p "$child" | grep -qv '^Z'; then
    no "a child that a passed step left running is still there (${child:-no pid})"
    [ -z "$child" ] || kill "$child"
  else
    ok "a child that a passed step left running is killed after it"
  fi
  run_check "$v" 1 GPU_CHECK_ONLY=60
  expect "only steps that need more GPUs than listed: nothing ran, exit 1" 1 "FAILED: no step ran"
  run_check "$v" 2 GPU_CHECK_ONLY=60
  expect "with 2 GPUs listed the 2-GPU step runs" 0 "^60-two +passed: 1 checks"
  rm -rf "$tmp"/gpu-check.*

  # compare_runs (common.sh) on made-up runs: the CPU run's loss NaN at update 3 of step 0, the two
  # GPU runs bitwise alike. max() over (deviation, step, update) tuples passes over a NaN that is not
  # first; the worst deviation must be the NaN, and fail.
  local m="$tmp/metrics" r
  for r in cpu gpu1 gpu2; do
    mkdir -p "$m/$r"
    for u in 0 1 2 3; do
      printf '{"step": 0, "minibatch": %d, "loss": %s, "checksum": "ab"}\n' $u "$([ $r = cpu ] && [ $u = 3 ] && echo NaN || echo 0.5)"
    done >"$m/$r/metrics.jsonl"
  done
  set +e
  out=$(GPU_CHECK_BUNDLE="$tmp" GPU_CHECK_LOGS="$m" GPU_CHECK_PYTHON="$py" bash -c \
    'source scripts/gpu-check.d/common.sh && compare_runs nan "$1/cpu" "$1/gpu1" "$1/gpu2"' _ "$m" 2>&1)
  rc=$?
  set -e
  expect "a NaN loss deviation in step 0 fails compare_runs" 1 "^ROW nan: GPU vs CPU, step 0 .* = nan at update 3: FAILED" \
    "^ROW nan: two GPU runs bitwise \| identical"
}

# ---------------------------------------------------------------- 2, 3: the real steps, no GPU to use
unusable() {
  echo "== 2. a GPU listed that cannot be used: the real steps and binaries fail, saying why"
  local u="$tmp/u"
  rm -rf "$u" && bundle "$u" scripts/gpu-check.d
  run_check "$u" 1 GPU_CHECK_ONLY='10 20 40' GPU_CHECK_PYTHON="$py"
  expect "the real steps 10, 20, 40 with a stand-in nvidia-smi listing a GPU" 1 \
    "^10-kernels +FAILED \(exit 1\): .*no CUDA driver" \
    "^20-buses +FAILED \(exit 1\): .*no CUDA driver" \
    "^40-train-gpu-vs-cpu +FAILED \(exit 1\): .*(no CUDA driver|built without the cuda feature)"
  echo "== 3. no GPU listed: the real steps"
  run_check "$u" 0 GPU_CHECK_PYTHON="$py"
  local steps
  steps=$(ls scripts/gpu-check.d | grep -c '^[0-9][0-9]-')
  expect "no GPU: exit 3" 3 "NO GPU: nvidia-smi lists none"
  [ "$(grep -cE '^[0-9][0-9]-[^ ]+ +NOT CHECKED: no GPU here' <<<"$out")" = "$steps" ] &&
    ok "no GPU: all $steps rows NOT CHECKED" || no "no GPU: not every one of the $steps rows is NOT CHECKED"
  rm -rf "$tmp"/gpu-check.*
}

# ---------------------------------------------------------------- 4. the CPU stand-in
stand_in() {
  echo "== 4. the CPU stand-in: every real step with GPU_CHECK_DEVICE=cpu"
  local c="$tmp/c" wheel
  wheel=$(ls target/pywheels/gradbus-*manylinux2014_x86_64*.whl 2>/dev/null | head -n 1)
  [ -n "$wheel" ] || { no "no gradbus wheel in target/pywheels (python/test.sh builds it)"; return; }
  rm -rf "$c" && bundle "$c" scripts/gpu-check.d
  fake_test_binary "$kbin" "$c/bin/kernels-cuda"
  fake_test_binary "$nbin" "$c/bin/collectives-nccl"
  PYTHON="$py" python/gpu-bundle.sh "$c" --wheel "$wheel" --offline >/dev/null
  # Every step, 1 GPU listed (step 25 NOT RUN), then step 25 with 2.
  run_check "$c" 1 GPU_CHECK_DEVICE=cpu GPU_CHECK_BUDGET_SCALE=20 GPU_CHECK_PYTHON="$py" GRADBUS_TRANSPORT=shm
  echo "$out" | sed -n '/== gpu-check summary/,$p'
  local s v
  for s in $(ls scripts/gpu-check.d | grep '^[0-9][0-9]-'); do
    v=$(grep -E "^$s " <<<"$out" | tail -n 1 | sed -E "s/^$s +//")
    case $s:$v in
      25-*:"NOT RUN: needs 2 GPUs"*) ok "stand-in: $s not run on 1 GPU" ;;
      *:passed*) ok "stand-in: $s $v" ;;
      [3789]0-*:"TARGET MISSED"*) ok "stand-in: $s (a benchmark; the CPU's speed is no verdict) $v" ;;
      *) no "stand-in: $s: ${v:-no verdict row}" ;;
    esac
  done
  [ "$rc" = 5 ] && grep -q "gpu-check: CPU STAND-IN" <<<"$out" && ok "stand-in: exit 5, not a pass" ||
    no "stand-in: exit $rc, want 5 (a stand-in run)"
  grep -qE '^  measured on this GPU: attention forward +rtol 2e-6, worst \|kernel - CPU\| / tolerance 0.125$' <<<"$out" &&
    ok "stand-in: step 10 shows the GPU's measured tolerance room" || no "stand-in: step 10: no measured-tolerance row"
  run_check "$c" 2 GPU_CHECK_ONLY=25 GPU_CHECK_DEVICE=cpu GPU_CHECK_BUDGET_SCALE=20 GPU_CHECK_PYTHON="$py"
  expect "stand-in: step 25 with 2 GPUs listed" 5 "^25-nccl-gpus +passed: [0-9]+ checks" \
    "^2 ranks over NCCL: the path +every rank of both GPU runs: gradients over shm"
  # The GPU machine's planted-failure cases of the stand-in: a scan below its target, and a kernel
  # binary that passes nothing.
  run_check "$c" 1 GPU_CHECK_ONLY=30 SCAN_PCT=80 GPU_CHECK_DEVICE=cpu GPU_CHECK_PYTHON="$py"
  expect "stand-in: step 30 below its bandwidth target" 5 "target: health scan / read-only bandwidth, 256 MiB \(%\): 80 \(target >= 90\) +MISSED" \
    "^30-scan-bandwidth +TARGET MISSED"
  printf '#!/bin/sh\necho "test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 20 filtered out"\n' >"$c/bin/kernels-cuda"
  run_check "$c" 1 GPU_CHECK_ONLY=10 GPU_CHECK_DEVICE=cpu GPU_CHECK_PYTHON="$py"
  expect "stand-in: step 10 with a kernel binary that passes nothing" 1 "^10-kernels +FAILED: 0 checks made, below its floor of 19"
  rm -rf "$tmp"/gpu-check.*
}

# Absolute, but not through its symlink: a venv's python is one, and the venv is what counts.
py=${GPU_CHECK_PYTHON:-target/pyvenv-clean/bin/python}
[ -x "$py" ] || { echo "gpu-check-test: no python at $py (python/test.sh makes target/pyvenv-clean; or set GPU_CHECK_PYTHON)" >&2; exit 1; }
py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")"
binaries
[ "$part" = --stand-in ] || { verdicts; unusable; }
[ "$part" = --verdicts ] || stand_in
echo
echo "gpu-check-test: $([ $bad = 0 ] && echo "ok" || echo "FAILED: $bad not as expected") in $(($(date +%s) - t_start)) s"
[ $bad = 0 ]
