# Helpers of the gpu-check steps (sourced, not run). The step contract - headers (check, budget,
# floor, gpus), output lines (ROW, CHECKS, TARGET) and exit codes - is at the top of gpu-check.sh,
# which runs a step only where nvidia-smi lists a GPU: so a step that cannot use the GPU has failed,
# and says why in a row.
#
# GPU_CHECK_DEVICE is "cuda", or "cpu" in the CPU stand-in run (scripts/gpu-check-test.sh runs every
# step's logic in CI with the CPU as the device and stand-ins for the GPU test binaries).
set -uo pipefail
GB="$GPU_CHECK_BUNDLE/bin/gradbus"
KBIN="$GPU_CHECK_BUNDLE/bin/kernels-cuda"
NBIN="$GPU_CHECK_BUNDLE/bin/collectives-nccl"
CONFIG="$GPU_CHECK_BUNDLE/examples/tiny.toml"
PY="$GPU_CHECK_PYTHON"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
GPUS="${GPU_CHECK_GPUS:-0}"

# row CHECK RESULT: one line of the final table.
row() { printf 'ROW %s | %s\n' "$1" "$2"; }
# checks N: N more checks made.
checks() { printf 'CHECKS %d\n' "$1"; }
# target NAME FIGURE OP BOUND: a benchmark figure and its target (OP: >= or <=), judged by gpu-check.sh.
target() { printf 'TARGET %s | %s | %s %s\n' "$1" "$2" "$3" "$4"; }
# fail WHY: a row saying why the step failed, and the exit.
fail() {
  row "  FAILED" "$1"
  exit 1
}

# A test binary's closing line, shortened ("no result line" when it crashed).
result_line() {
  local r
  r=$(grep -a '^test result:' "$1" | tail -n 1 | sed 's/^test result: //; s/; finished in.*//') || true
  echo "${r:-no result line (crashed?)}"
}

# tests_checked LOG: the tests of a test binary's run that passed having checked something: the
# `N passed` of its result lines, less the tests that printed a SKIPPED line (they returned early).
tests_checked() {
  local passed skipped
  passed=$(grep -a '^test result:' "$1" | sed -n 's/.* \([0-9][0-9]*\) passed.*/\1/p' | awk '{ s += $1 } END { print s + 0 }')
  skipped=$(grep -ac '^SKIPPED: ' "$1" || true)
  echo $((passed - skipped))
}

# The reason a run could not use the GPU (a test's GRADBUS_REQUIRE panic, the driver's error), or
# gradbus's own error line, else any line naming an error, else the last line; one line.
why() {
  (grep -a -m1 -E 'must run here, yet: |no CUDA (driver|device)|CUDA_ERROR|built without the cuda feature' "$1" ||
    grep -a -m1 '^gradbus: error: ' "$1" || grep -a -m1 -iE 'error|panicked' "$1" || tail -n 1 "$1") |
    sed 's/.*must run here, yet: //; s/^gradbus: error: //' | cut -c1-120
}

# json FILE EXPR: a Python expression over the JSON file's object `j` (missing or unreadable file:
# nothing printed and a non-zero return, never an empty success).
json() { "$PY" -c 'import json, sys; j = json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2" 2>/dev/null; }

# metric RUN_DIR KEY: KEY of every metrics.jsonl line, one per line (non-zero when the file is
# missing or unreadable, or a line lacks KEY).
metric() { "$PY" -c 'import json, sys
for l in open(sys.argv[1] + "/metrics.jsonl"):
    print(json.loads(l)[sys.argv[2]])' "$1" "$2" 2>/dev/null; }

# gb_run NAME ARGS...: `gradbus run --run-dir $RUNS/NAME ARGS...` with its output in $RUNS/NAME.log;
# returns gradbus's exit code.
RUNS="$GPU_CHECK_LOGS/runs"
mkdir -p "$RUNS"
gb_run() {
  local name=$1
  shift
  rm -rf "${RUNS:?}/$name"
  "$GB" run --run-dir "$RUNS/$name" "$@" >"$RUNS/$name.log" 2>&1
}

# compare_runs WHAT CPU_RUN GPU_RUN1 GPU_RUN2: three rows, two checks. Judged: the first GPU run's
# losses against the CPU run's in step 0 (its 16 updates, from the same initial weights), within
# LOSS_RTOL x (1 + |loss|); and the two GPU runs bitwise over every update (loss and weights
# checksum). Shown, not judged: the largest difference in the later steps - two correct machines
# part after a few steps (a last-bit difference flips a sampled token; docs/gpu.md has the
# measurement). A missing or unreadable metrics.jsonl, or runs of other lengths, fail. Returns 1
# when a check failed.
LOSS_RTOL=1e-4
compare_runs() {
  local out rc
  out=$("$PY" - "$LOSS_RTOL" "$2" "$3" "$4" <<'PY'
import json, sys
tol = float(sys.argv[1])
def lines(d):
    try:
        return [json.loads(l) for l in open(d + "/metrics.jsonl")]
    except (OSError, ValueError) as e:
        print(f"FAILED: {d}/metrics.jsonl: {e}"); print("not compared"); print("not compared"); sys.exit(1)
cpu, g1, g2 = (lines(d) for d in sys.argv[2:5])
if not cpu or len(g1) != len(cpu) or len(g2) != len(cpu):
    print(f"FAILED: {len(cpu)} CPU updates, {len(g1)} and {len(g2)} GPU updates"); print("not compared"); print("not compared"); sys.exit(1)
dev = [(abs(a["loss"] - b["loss"]) / (1 + abs(b["loss"])), a["step"], a["minibatch"]) for a, b in zip(g1, cpu)]
first = [d for d in dev if d[1] == 0]
worst, at_step, at_mb = max(first)
ok1 = worst <= tol
print(f"{len(first)} updates, max |loss_gpu - loss_cpu| / (1 + |loss_cpu|) = {worst:.2e} at update {at_mb}"
      + ("" if ok1 else f": FAILED, over {tol:g}"))
later = [d for d in dev if d[1] > 0]
print("no later steps" if not later else "max %.2e at step %d update %d (later steps: shown, not judged)" % max(later))
if any("checksum" not in r for r in g1 + g2):
    print("FAILED: a GPU run's metrics have no weights checksum"); sys.exit(1)
key = lambda r: (r["step"], r["minibatch"], r["loss"], r["checksum"])
differ = [(a["step"], a["minibatch"]) for a, b in zip(g1, g2) if key(a) != key(b)]
print(f"identical: {len(g1)} updates' loss and weights checksum" if not differ else f"FAILED: differ from step {differ[0][0]} update {differ[0][1]}")
sys.exit(0 if ok1 and not differ else 1)
PY
)
  rc=$?
  row "$1: GPU vs CPU, step 0 (tolerance $LOSS_RTOL x (1+|loss|))" "$(sed -n 1p <<<"$out")"
  row "$1: GPU vs CPU, steps 1-19" "$(sed -n 2p <<<"$out")"
  row "$1: two GPU runs bitwise" "$(sed -n 3p <<<"$out")"
  [ $rc = 0 ] && checks 2
  return $rc
}

# unpack_wheels DIR: every wheel of DIR unpacked into DIR/site (the GPU machine has no package
# registry: the steps put it on PYTHONPATH); prints the folder, or why not and returns 1.
unpack_wheels() {
  local w n=0
  rm -rf "$1/site"
  for w in "$1"/*.whl; do
    [ -e "$w" ] || continue
    "$PY" -m zipfile -e "$w" "$1/site" || { echo "could not unpack $w"; return 1; }
    n=$((n + 1))
  done
  [ $n -gt 0 ] || { echo "no wheel in $1 (gpu-check.sh --prepare puts them there)"; return 1; }
  echo "$1/site"
}
