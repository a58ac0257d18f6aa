#!/usr/bin/env bash
# The replica checksum's share of an update ("guard on vs off"), at the tiny size and at 3.2M
# parameters: a 1-rank run gives the median `time_update_ms` (guard on), the kernel workbench the
# checksum's own time at the run's parameter count, alone and through a separate pass (an upper bound
# of what the AdamW pass spends on it), and the one-chain FNV-1a it replaced (run twice per update).
# Guard off = the update minus the checksum. A benchmark: it prints numbers, asserts nothing.
#
# Usage: bench/guard-cost.sh [STEPS]    (default 4; run it on a quiet machine)
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${1:-4}"
cargo build --release --quiet --bins
cargo build --release --quiet -p gradbus-kernels --example workbench
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
printf '%-6s %10s %12s %12s %8s %12s %8s %12s %8s\n' size params update_ms in_adamw_ms share one_pass_ms share fnv1a_x2_ms was
for size in tiny 3.2M; do
  sets=(--set "steps=$steps" --set checkpoint.every=0)
  [ "$size" = 3.2M ] && sets+=(--set model.channels=256 --set model.layers=4)
  ./target/release/gradbus run --np 1 --run-dir "$tmp/$size" examples/tiny.toml "${sets[@]}" >"$tmp/$size.out" 2>&1
  params="$(grep -o '[0-9]* parameters in' "$tmp/$size.out" | head -1 | cut -d' ' -f1)"
  ./target/release/examples/workbench checksum "$params" >"$tmp/$size.wb"
  python3 - "$tmp/$size/metrics.jsonl" "$tmp/$size.wb" "$size" "$params" <<'PY'
import json, statistics, sys
upd = statistics.median(json.loads(l)["time_update_ms"] for l in open(sys.argv[1]))
row = [l.split() for l in open(sys.argv[2]) if not l.startswith("#") and l.split()[0].isdigit()][0]
fnv, lanes, hot = float(row[1]), float(row[3]), float(row[5])
was = 2 * fnv / (upd - hot + 2 * fnv)  # the same update with the two old passes instead
print(f"{sys.argv[3]:<6} {sys.argv[4]:>10} {upd:>12.3f} {hot:>12.4f} {100 * hot / upd:>7.2f}% {lanes:>12.4f} {100 * lanes / upd:>7.2f}% {2 * fnv:>12.3f} {100 * was:>7.1f}%")
PY
done
echo "# update_ms: median time_update_ms of a 1-rank run (the checksum now inside AdamW's pass);"
echo "# in_adamw_ms: the lane hash on pieces already in cache, as the AdamW pass runs it (workbench"
echo "# lanes-hot); one_pass_ms: the same hash as a separate pass over the weights (an upper bound);"
echo "# fnv1a_x2_ms: the two one-chain FNV-1a passes per update it replaced; was: their share of an"
echo "# update that ran them instead (update_ms - in_adamw_ms + fnv1a_x2_ms). Shares are of update_ms."
