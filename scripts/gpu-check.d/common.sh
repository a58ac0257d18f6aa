# Helpers of the gpu-check steps (sourced, not run). A step runs in the bundle's folder with
# GPU_CHECK_BUNDLE, GPU_CHECK_LOGS and GPU_CHECK_PYTHON set by gpu-check.sh, prints its table rows
# with `row`, and exits 0 (passed), 1 (failed) or 3 (not checked here, the rows say why).
set -uo pipefail
GB="$GPU_CHECK_BUNDLE/bin/gradbus"
KBIN="$GPU_CHECK_BUNDLE/bin/kernels-cuda"
NBIN="$GPU_CHECK_BUNDLE/bin/collectives-nccl"
CONFIG="$GPU_CHECK_BUNDLE/examples/tiny.toml"
PY="$GPU_CHECK_PYTHON"

# row CHECK RESULT: one line of the final table.
row() { printf 'ROW %s | %s\n' "$1" "$2"; }

# A test binary's closing line, shortened ("no result line" when it crashed).
result_line() {
  local r
  r=$(grep -a '^test result:' "$1" | tail -n 1 | sed 's/^test result: //; s/; finished in.*//') || true
  echo "${r:-no result line (crashed?)}"
}

# Whether a run's output says the GPU could not be used (no driver, no device, the worker not wired).
no_gpu_in() { grep -aqE 'SKIPPED: no CUDA|no CUDA driver|no CUDA device|not yet wired|built without the cuda feature' "$1"; }

# Whether this machine has a GPU the driver lists.
have_gpu() { command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; }

# field FILE.json KEY: a top-level field of a JSON file.
field() { "$PY" -c 'import json,sys; print(json.load(open(sys.argv[1])).get(sys.argv[2]))' "$1" "$2" 2>/dev/null; }

# metric RUN_DIR KEY: KEY of every metrics.jsonl line, one per line.
metric() { "$PY" -c 'import json,sys
for l in open(sys.argv[1] + "/metrics.jsonl"):
    print(json.loads(l).get(sys.argv[2]))' "$1" "$2" 2>/dev/null; }

# gb_run NAME ARGS...: `gradbus run --run-dir $RUNS/NAME ARGS...` with its output in $RUNS/NAME.log;
# returns gradbus's exit code.
RUNS="$GPU_CHECK_LOGS/runs"
mkdir -p "$RUNS"
gb_run() {
  local name=$1
  shift
  "$GB" run --run-dir "$RUNS/$name" "$@" >"$RUNS/$name.log" 2>&1
}

# Whether the last run could not use the GPU because this build's worker has no device = "cuda" path
# (an older gradbus: `device` is an unknown key, or the worker says so). Then the step is not checked.
not_wired() { grep -aqE 'unknown field `device`|not yet wired|built without the cuda feature' "$1"; }

# why LOG: the line of a run's output that says why it could not use the GPU: gradbus's own error
# line first (a benchmark's log echoes the command line, which names cuda, before it), else any line
# naming an error or CUDA, else its last line.
why() {
  (grep -a -m1 '^gradbus: error: ' "$1" || grep -a -m1 -E 'error|CUDA|cuda' "$1" || tail -n 1 "$1") |
    sed 's/^gradbus: error: //' | cut -c1-100
}
