#!/usr/bin/env bash
# The seed case, end to end, as docs/roll-193.md tells it: every number in that document comes from
# this script's output. Takes ~15 minutes on a 2-core machine (8 ranks, oversubscribed).
#
#   scripts/roll-193.sh [OUT_DIR]            # the runs
#   SEEDS="0 1 2 3 4 5 6 7" scripts/roll-193.sh   # also the across-seeds table (8 more runs)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/roll-193}
cfg=examples/roll-193.toml
cargo build --release --quiet
gb=target/release/gradbus
rm -rf "$out"; mkdir -p "$out"

# The first update whose agreed headroom (88.72 - the largest log-ratio fed to an exp) fell under
# 20 nats, and how many updates before the abort it came.
lead() {
  python3 - "$1/metrics.jsonl" <<'PY'
import json, sys
L = [json.loads(l) for l in open(sys.argv[1])]
def gap(l):
    v = [x for x in (l["max_logratio_response"], l["max_logratio_masked"]) if isinstance(x, (int, float))]
    return max(v) if v else float("inf")
w = next((i for i, l in enumerate(L) if 88.72 - gap(l) < 20), None)
f = next((i for i, l in enumerate(L) if l["verdict"] == "abort"), None)
if f is not None and w is not None:
    print(f"warning at step {L[w]['step']} update {L[w]['minibatch']} (headroom {88.72 - gap(L[w]):.2f}); failure at step {L[f]['step']} update {L[f]['minibatch']}: {f - w} updates ahead")
PY
}

field() { python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r.get(sys.argv[2]))" "$1" "$2"; }

echo "== 1. roll loss, stale rollouts, 8 ranks, policy abort"
set +e
$gb run --np 8 --run-dir "$out/roll" $cfg > "$out/roll.log" 2>&1; rc=$?
set -e
tail -n 12 "$out/roll.log"
echo "exit code: $rc"
echo "report.json:"; cat "$out/roll/report.json"
step=$(field "$out/roll/report.json" step)

echo "== 2. the same run again"
set +e; $gb run --np 8 --run-dir "$out/again" $cfg > "$out/again.log" 2>&1; rc2=$?; set -e
echo "exit code: $rc2, failing step: $(field "$out/again/report.json" step), same report: $(cmp -s "$out/roll/report.json" "$out/again/report.json" && echo yes || echo no)"

echo "== 3. resume from the last checkpoint before step $step"
cp "$out/roll/report.json" "$out/report-first.json"
ls "$out/roll/checkpoints"
set +e; $gb run --np 8 --resume "$out/roll" $cfg > "$out/resume.log" 2>&1; rc3=$?; set -e
grep -m1 "resumed from" "$out/roll/rank-0.log" || true
echo "exit code: $rc3, failing step: $(field "$out/roll/report.json" step), same report: $(cmp -s "$out/report-first.json" "$out/roll/report.json" && echo yes || echo no)"

echo "== 4. replay the failing update in one process, with the trace"
/usr/bin/time -f "replay wall time: %es" $gb replay "$out/roll" --trace

echo "== 5. the early warning: first update whose agreed log-ratio headroom fell under 20 nats"
lead "$out/roll"

echo "== 6. the fix: loss.style=safe, same seed, 400 steps"
$gb run --np 8 --run-dir "$out/safe" $cfg --set loss.style=safe > "$out/safe.log" 2>&1
python3 - "$out/safe/metrics.jsonl" <<'PY'
import json, sys
L = [json.loads(l) for l in open(sys.argv[1])]
print(f"updates: {len(L)}, last step: {L[-1]['step']}, verdicts: {sorted(set(l['verdict'] for l in L))}, skipped: {L[-1]['skipped']}, non-finite ranks ever: {sum(len(l['nonfinite_ranks']) for l in L)}")
PY

echo "== 7. on-policy reference: rollout_sync_interval=1, safe loss, 400 steps"
$gb run --np 8 --run-dir "$out/onpolicy" $cfg --set loss.style=safe --set rollout_sync_interval=1 > "$out/onpolicy.log" 2>&1

echo "== 8. mean reward per 25-step window"
python3 - "$out" <<'PY'
import json, sys, os
out = sys.argv[1]
def windows(name):
    p = os.path.join(out, name, "metrics.jsonl")
    L = [json.loads(l) for l in open(p)]
    per = {}
    for l in L:
        if l["attempt"] == 0:
            per.setdefault(l["step"] // 25, []).append(l["reward"])
    return {k: sum(v) / len(v) for k, v in per.items()}
runs = ["roll", "safe", "onpolicy"]
w = {r: windows(r) for r in runs}
print("steps      " + "".join(f"{r:>12}" for r in ["roll (K=50)", "safe (K=50)", "safe (K=1)"]))
for k in range(16):
    cells = "".join(f"{w[r][k]:12.3f}" if k in w[r] else f"{'-':>12}" for r in runs)
    print(f"{k*25:3d}-{k*25+24:3d}    {cells}")
PY

if [ -n "${SEEDS:-}" ]; then
  echo "== 9. first non-finite step across seeds (roll loss, 300 steps, policy abort)"
  for s in $SEEDS; do
    set +e; $gb run --np 8 --run-dir "$out/seed-$s" $cfg --set seed=$s --set steps=300 --set checkpoint.every=0 > "$out/seed-$s.log" 2>&1; rc=$?; set -e
    if [ -f "$out/seed-$s/report.json" ]; then echo "seed $s: step $(field "$out/seed-$s/report.json" step) (exit $rc); $(lead "$out/seed-$s")"; else echo "seed $s: none in 300 steps (exit $rc)"; fi
  done
fi
