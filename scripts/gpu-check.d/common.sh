# Helpers of the gpu-check steps (sourced, not run). The step contract - headers (check, budget,
# floor, gpus), output lines (ROW, CHECKS, NOTRUN, TARGET) and exit codes - is at the top of gpu-check.sh,
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

# why LOG: one line saying why what LOG records failed (a step's log, a run's, a test binary's): a GPU
# it could not use first (a test's GRADBUS_REQUIRE panic, a driver or CUDA error); else a step's
# FAILED row (the last: a step's own `fail` comes last); else gradbus's error line; else a line naming
# an error or a panic; else its last row; else its last line. gpu-check.sh uses it too.
why() {
  (grep -a -m1 -E 'must run here, yet: |no CUDA (driver|device)|CUDA_ERROR|built without the cuda feature' "$1" ||
    grep -a -E '^ROW ( +FAILED \||.*\| *FAIL)' "$1" | tail -n 1 | grep . ||
    grep -a -m1 '^gradbus: error: ' "$1" || grep -a -m1 -iE 'error|panicked' "$1" ||
    grep -a '^ROW ' "$1" | tail -n 1 | grep . || tail -n 1 "$1") |
    sed 's/.*must run here, yet: //; s/^gradbus: error: //; s/^ROW [^|]*| //; s/ | /; /g' | cut -c1-140
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
# returns gradbus's exit code. Run it through `shared` or `own_gpus` below, which pin the path.
RUNS="$GPU_CHECK_LOGS/runs"
mkdir -p "$RUNS"
gb_run() {
  local name=$1
  shift
  rm -rf "${RUNS:?}/$name"
  "$GB" run --run-dir "$RUNS/$name" "$@" >"$RUNS/$name.log" 2>&1
}

# The path of a run's gradients is pinned, never left to the machine: the worker takes NCCL wherever
# each rank has a GPU of its own, and an inherited GRADBUS_TRANSPORT overrides its choice.
# shared NP COMMAND...: COMMAND with NP ranks on GPU 0 (CUDA_VISIBLE_DEVICES=0), their gradients
#   through the host: one rank alone (GRADBUS_TRANSPORT unset: solo), more over the shared-memory bus
#   (GRADBUS_TRANSPORT=shm). On the GPU that is the staged bus.
shared() {
  local np=$1
  shift
  if [ "$np" = 1 ]; then
    (unset GRADBUS_TRANSPORT && CUDA_VISIBLE_DEVICES=0 "$@")
  else
    (CUDA_VISIBLE_DEVICES=0 GRADBUS_TRANSPORT=shm "$@")
  fi
}
# own_gpus COMMAND...: COMMAND with GRADBUS_TRANSPORT unset: a GPU per rank goes over NCCL.
own_gpus() { (unset GRADBUS_TRANSPORT && "$@"); }
# path_of NP VIA DEVICE: what the worker's `gradients:` line says for such a run - VIA shared or
# own_gpus; on the CPU solo (1 rank) or shm, on the GPU "staged over" those or nccl.
path_of() {
  local host=shm
  [ "$1" = 1 ] && host=solo
  if [ "$3" != cuda ]; then
    echo "$host"
  elif [ "$2" = own_gpus ] && [ "$1" -gt 1 ]; then
    echo nccl
  else
    echo "staged over $host"
  fi
}
# gradients_over NAME NP WANT: each of the NP rank logs of run NAME has the worker's line
# `gradients: WANT` (the path its gradients took); else says what they have and returns 1.
gradients_over() {
  local r got bad=""
  for ((r = 0; r < $2; r++)); do
    got=$(sed -n 's/^gradients: //p' "$RUNS/$1/rank-$r.log" 2>/dev/null | head -n 1)
    [ "$got" = "$3" ] || bad="$bad rank $r: ${got:-no 'gradients:' line};"
  done
  [ -z "$bad" ] || { echo "$1: the gradients did not go over $3:$bad"; return 1; }
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
import json, math, sys
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
# The worst deviation: a NaN (a non-finite loss on either side) is the worst there is and fails;
# max() over the tuples would pass over it.
top = lambda ds: next((d for d in ds if math.isnan(d[0])), None) or max(ds)
worst, at_step, at_mb = top(first)
ok1 = worst <= tol
print(f"{len(first)} updates, max |loss_gpu - loss_cpu| / (1 + |loss_cpu|) = {worst:.2e} at update {at_mb}"
      + ("" if ok1 else f": FAILED, over {tol:g}"))
later = [d for d in dev if d[1] > 0]
print("no later steps" if not later else "max %.2e at step %d update %d (later steps: shown, not judged)" % top(later))
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
