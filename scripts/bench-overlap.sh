#!/usr/bin/env bash
# Bucket reduces overlapped with backward vs after backward, side by side in one run: the same
# config with `overlap="off"` (the baseline) and `overlap="on"`, alternated REPS times so that load
# on a shared machine hits both alike; prints each run's wall time, the medians and their ratio.
# The two modes give the same bits (tests/workload.rs), so only time differs.
#
# Usage: scripts/bench-overlap.sh [NP] [REPS] [--set key=value ...]   (defaults: 2 ranks, 5 reps,
#        examples/tiny.toml with steps=20)
set -euo pipefail
cd "$(dirname "$0")/.."
np="${1:-2}"
reps="${2:-5}"
shift $(( $# < 2 ? $# : 2 ))
cargo build --release --bins -q
bin=target/release/gradbus
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
echo "# overlap off vs on: $np ranks, $(nproc) cores, $reps reps, examples/tiny.toml --set steps=20 $*"
echo "# load: $(cut -d' ' -f1-3 /proc/loadavg)"
declare -A times
for i in $(seq "$reps"); do
  for mode in off on; do
    rm -rf "$dir/run"
    t0=$(date +%s.%N)
    "$bin" run --np "$np" examples/tiny.toml --run-dir "$dir/run" --set steps=20 "$@" \
      --set "overlap=\"$mode\"" >/dev/null 2>&1
    t1=$(date +%s.%N)
    times[$mode]+="$(echo "$t1 - $t0" | bc) "
    echo "rep $i  overlap=$mode  $(echo "$t1 - $t0" | bc | xargs printf '%.3f') s"
  done
done
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
off=$(echo "${times[off]}" | median)
on=$(echo "${times[on]}" | median)
printf 'median  off %.3f s  on %.3f s  on/off %.3f\n' "$off" "$on" "$(echo "$on / $off" | bc -l)"
