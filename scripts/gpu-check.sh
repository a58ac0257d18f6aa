#!/usr/bin/env bash
# gpu-check: every check of the `cuda` feature that needs a GPU, in one run, ending in ONE table whose
# verdicts mean what they say. docs/gpu.md lists the checks, their tolerances and the verdicts.
#
# Usage:
#   scripts/gpu-check.sh --prepare DIR    build here (cargo) and write a self-contained bundle to DIR
#                                         (<= 64 MiB: stripped binaries, configs, wheels, this script
#                                         and its steps; DIR/MANIFEST lists what it runs, each step's
#                                         time budget and the bundle's size); runs nothing
#   bash DIR/gpu-check.sh --prebuilt DIR  on the GPU machine (no Rust needed): run every step from
#                                         the bundle, each within its budget (all together <= 6 min:
#                                         LIMIT_S below)
#   scripts/gpu-check.sh                  build here and run every step (a GPU machine with cargo)
#   GPU_CHECK_ONLY='10 30' ...            run only the steps whose names start with these prefixes
#                                         (set, it must name at least one: empty fails)
#
# Exit codes (this is the one place that decides them; the first that applies):
#   1  FAILED: a step failed, was killed over its budget, made fewer checks than its floor, or could
#      not use a GPU that nvidia-smi lists; or nvidia-smi lists none where NVIDIA GPUs are on the PCI
#      bus or /dev/nvidia* exist (a GPU the driver cannot open); or nothing was selected, or no step ran
#   2  bad usage, or the build (--prepare) failed or does not fit
#   3  NO GPU: nvidia-smi lists none and no NVIDIA GPU is on the PCI bus, so nothing ran; every row
#      says NOT CHECKED
#   5  CPU STAND-IN: GPU_CHECK_DEVICE is not cuda (scripts/gpu-check-test.sh's run): nothing failed,
#      but nothing ran on a GPU - never a GPU check's pass, whatever its targets
#   6  PARTLY RUN: every check that ran passed, but a step reported checks NOT RUN (NOTRUN lines: the
#      rows say why) - not a pass: what did not run is unchecked
#   4  TARGET MISSED: every check passed, but a benchmark missed its target (the rows say which)
#   0  every selected step ran on a GPU and passed, every check ran, every benchmark met its target
#      (a step that needs more GPUs than nvidia-smi lists is NOT RUN, said in its row, and aside)
#
# The step contract (a new check is a new file in gpu-check.d/; `common.sh` has the helpers):
#   name    NN-word (two digits first): run in name order with `bash` (a lost run bit changes
#           nothing), in the bundle's folder, with GPU_CHECK_BUNDLE, GPU_CHECK_LOGS, GPU_CHECK_PYTHON,
#           GPU_CHECK_GPUS (GPUs listed), GPU_CHECK_STEP_BUDGET (its budget, s) and GPU_CHECK_DEVICE
#           (cuda; cpu only in the CPU stand-in run of scripts/gpu-check-test.sh, which also scales the
#           budgets: GPU_CHECK_BUDGET_SCALE) set
#   header  # check: <what it checks, one line>
#           # budget: <seconds>  its wall-clock limit: over it the step and its children are killed
#                                and the step is FAILED
#           # floor: <n>         the fewest checks a run accounts for (>= 1): fewer made plus
#                                NOT RUN is FAILED
#           # gpus: <n>          (optional, default 1) GPUs it needs: with fewer listed it is NOT RUN
#                                (said in its row; not a failure)
#   output  ROW <check> | <result>                     a row of the table
#           CHECKS <n>                                  n more checks made (the step's are summed)
#           NOTRUN <check> | <why>                      a check that could not run here, for a reason
#                                                       its step documents (never an error of its
#                                                       own: that is a failure): shown as the row
#                                                       "<check> | NOT RUN: <why>", counted, and the
#                                                       step is PARTLY RUN, never passed (exit 6)
#           TARGET <figure's name> | <figure> | >= <bound>   (or <=) a benchmark figure and its
#                                                       target: judged here, a miss is TARGET MISSED
#   exit    0 when every check it made passed; anything else is FAILED. A step never decides that
#           there is no GPU: this script does, from nvidia-smi and the PCI bus, before any step.
#
# Libraries: cudarc looks for libnvrtc.so, libcublas.so and libnccl.so (or .so.12, .so.11, ...),
# never the .so.13 / .so.2 that CUDA 13 and NCCL ship: links of those names to what this machine
# has (the torch venv's nvidia/cu13/lib, ldconfig) go into a folder at the front of LD_LIBRARY_PATH.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# The most a run may take (the device run's lease); --prepare refuses steps whose budgets add up to
# more than it less the setup's share.
LIMIT_S=360
SETUP_S=25

mode=build
dir=""
case "${1:-}" in
  "") ;;
  --prepare | --prebuilt)
    mode=${1#--}
    dir=${2:?"$1 needs a folder"}
    ;;
  -h | --help)
    sed -n '2,/^set -euo/p' "$0" | sed '$d'

    exit 0
    ;;
  *)
    echo "gpu-check: unknown argument $1 (see --help)" >&2
    exit 2
    ;;
esac

say() { printf '\n== %s\n' "$*"; }

# ---------------------------------------------------------------- the steps' headers
# header STEP KEY: the value of the step's `# KEY: value` line (empty when it has none).
header() { sed -n "s/^# $2: *//p" "$1" | head -n 1; }
# steps DIR: the step files of a gpu-check.d folder, in name order.
steps() { find "$1" -maxdepth 1 -type f -name '[0-9][0-9]-*' | sort; }
# bad_header STEP: what is wrong with the step's header, or nothing.
bad_header() {
  local b f g
  b=$(header "$1" budget) f=$(header "$1" floor) g=$(header "$1" gpus)
  [ -n "$(header "$1" check)" ] || { echo "no '# check:' line"; return; }
  [[ $b =~ ^[1-9][0-9]*$ ]] || { echo "no '# budget: <seconds>' line"; return; }
  [[ $f =~ ^[1-9][0-9]*$ ]] || { echo "no '# floor: <checks>' line (at least 1)"; return; }
  [[ -z $g || $g =~ ^[1-9][0-9]*$ ]] || echo "'# gpus: $g' is not a count"
}

# ---------------------------------------------------------------- build (here, with cargo)
if [ "$mode" != prebuilt ]; then
  logs=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
  cd "$here/.."
  command -v cargo >/dev/null || { echo "gpu-check: cargo not found (build elsewhere with --prepare)" >&2; exit 2; }
  # The steps first: a bundle with a broken step is refused before minutes of building. The
  # budgets of the steps a one-GPU machine runs must fit its run.
  total=0 multi=0
  for s in $(steps "$here/gpu-check.d"); do
    why=$(bad_header "$s")
    [ -z "$why" ] || { echo "gpu-check: $s: $why (see the step contract in --help)" >&2; exit 2; }
    if [ "$(header "$s" gpus | grep . || echo 1)" -le 1 ]; then
      total=$((total + $(header "$s" budget)))
    else
      multi=$((multi + $(header "$s" budget)))
    fi
  done
  if [ "$total" -gt $((LIMIT_S - SETUP_S)) ]; then
    echo "gpu-check: the one-GPU steps' budgets add up to $total s, over the $((LIMIT_S - SETUP_S)) s a $LIMIT_S s run leaves them" >&2
    exit 2
  fi
  say "build: cargo build --release --features cuda, and the GPU test binaries"
  cargo build --release --features cuda || exit 2
  cargo test --release --features cuda -p gradbus-kernels -p gradbus-collectives --no-run \
    --message-format=json >"$logs/build.json" || exit 2
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
  # The Python checks: the gradbus wheel, python/gpu_check.py, python/gpu/ and the frameworks' wheels.
  python/gpu-bundle.sh "$bundle" >/dev/null || exit 2
  size=$(du -sb "$bundle" | cut -f1)
  {
    echo "gradbus GPU check bundle, built $(date -u +%Y-%m-%dT%H:%MZ) from $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo "run on the GPU machine: bash $bundle/gpu-check.sh --prebuilt $bundle"
    echo
    echo "steps (gpu-check.d/, in order): budget (s), floor (checks), GPUs, what each runs:"
    for s in $(steps "$bundle/gpu-check.d"); do
      printf '  %-22s %4s s  floor %3s  gpus %s  %s\n' "$(basename "$s")" "$(header "$s" budget)" \
        "$(header "$s" floor)" "$(header "$s" gpus | grep . || echo 1)" "$(header "$s" check)"
    done
    echo "  budgets: $total s of the one-GPU steps + $SETUP_S s setup <= $LIMIT_S s (steps that need more GPUs: $multi s more)"
    echo
    echo "files:"
    (cd "$bundle" && find . -type f | sort | while read -r f; do printf '  %-48s %9d bytes\n' "$f" "$(stat -c %s "$f")"; done)
    echo "total: $size bytes ($((size >> 20)) MiB of the 64 MiB a device run carries)"
  } >"$bundle/MANIFEST"
  if [ "$mode" = prepare ]; then
    cat "$bundle/MANIFEST"
    if [ "$size" -gt $((64 << 20)) ]; then
      echo "gpu-check: the bundle is $size bytes, over the 64 MiB a device run carries" >&2
      exit 2
    fi
    echo "prepared: run 'bash $bundle/gpu-check.sh --prebuilt $bundle' on the GPU machine"
    exit 0
  fi
else
  [ -d "$dir" ] || { echo "gpu-check: $dir is not a folder (make a bundle with --prepare DIR)" >&2; exit 2; }
  bundle=$(cd "$dir" && pwd)
  [ -f "$bundle/bin/kernels-cuda" ] && [ -f "$bundle/bin/gradbus" ] && [ -f "$bundle/gpu-check.d/common.sh" ] ||
    { echo "gpu-check: $dir is not a bundle (make one with --prepare DIR)" >&2; exit 2; }
  # A copy that lost its run bits still runs.
  chmod +x "$bundle"/bin/* 2>/dev/null || true
  logs=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
fi
t_start=$(date +%s)

# ---------------------------------------------------------------- the selection
selected=()
for s in $(steps "$bundle/gpu-check.d"); do
  name=$(basename "$s")
  # Set, even empty, it must name steps (an empty or misspelt selection fails below).
  if [ -n "${GPU_CHECK_ONLY+set}" ]; then
    keep=0
    for p in $GPU_CHECK_ONLY; do case "$name" in "$p"*) keep=1 ;; esac; done
    [ $keep = 1 ] || continue
  fi
  selected+=("$s")
done
if [ ${#selected[@]} = 0 ]; then
  echo "gpu-check: FAILED: no step selected: GPU_CHECK_ONLY='${GPU_CHECK_ONLY:-}' names none of: $(steps "$bundle/gpu-check.d" | xargs -r -n1 basename | tr '\n' ' ')" >&2
  exit 1
fi

# ---------------------------------------------------------------- environment
say "environment"
# The GPUs the driver lists. nvidia-smi is the witness: no GPU listed, and no NVIDIA GPU on the PCI
# bus, is the one case of NOT CHECKED.
gpus=0
smi="nvidia-smi: not found"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  smi=$(nvidia-smi -L 2>&1 || true)
  gpus=$(grep -c '^GPU ' <<<"$smi" || true)
fi
echo "GPUs listed by nvidia-smi: $gpus"
echo "bundle: $bundle ($(du -sb "$bundle" | cut -f1) bytes)"
# Two witnesses that need no driver: a GPU they show while nvidia-smi lists none is one the driver
# cannot open (not loaded, a version mismatch), never a machine without a GPU.
# - NVIDIA display-class functions on the PCI bus: vendor 0x10de, class 0x03xxxx (VGA or 3D
#   controller; NVSwitch, audio and USB functions are other classes). GPU_CHECK_PCI replaces
#   /sys/bus/pci/devices (the self-test's stand-in folder).
pci_dir=${GPU_CHECK_PCI:-/sys/bus/pci/devices}
pci=0
for d in "$pci_dir"/*; do
  [ "$(cat "$d/vendor" 2>/dev/null)" = 0x10de ] || continue
  case $(cat "$d/class" 2>/dev/null) in 0x03*) pci=$((pci + 1)) ;; esac
done
echo "NVIDIA GPUs on the PCI bus ($pci_dir): $pci"
# - the device files (GPU_CHECK_DEV replaces /dev).
devs=$(ls "${GPU_CHECK_DEV:-/dev}"/nvidia[0-9]* 2>/dev/null | wc -l || true)
if [ "$gpus" = 0 ] && [ "$pci" -gt 0 ]; then
  echo "gpu-check: FAILED: $pci NVIDIA GPU(s) on the PCI bus ($pci_dir), but nvidia-smi lists none: the driver is not loaded or cannot open them; nvidia-smi -L said: $(head -c 300 <<<"$smi" | tr '\n' ' ')" >&2
  exit 1
fi
if [ "$gpus" = 0 ] && [ "$devs" -gt 0 ]; then
  echo "gpu-check: FAILED: nvidia-smi lists no GPU, but $devs NVIDIA device file(s) exist (${GPU_CHECK_DEV:-/dev}/nvidia*): fix nvidia-smi, or the check would call this GPU absent; nvidia-smi -L said: $(head -c 300 <<<"$smi" | tr '\n' ' ')" >&2
  exit 1
fi
device=${GPU_CHECK_DEVICE:-cuda}
# The CPU stand-in (scripts/gpu-check-test.sh) is slower than a GPU: it scales the budgets.
scale=${GPU_CHECK_BUDGET_SCALE:-1}
[[ $scale =~ ^[1-9][0-9]*$ ]] || { echo "gpu-check: GPU_CHECK_BUDGET_SCALE=$scale is not a whole number >= 1" >&2; exit 2; }
if [ "$device" != cuda ]; then
  echo "gpu-check: CPU STAND-IN RUN (GPU_CHECK_DEVICE=$device, budgets x$scale): the CPU plays the GPU; nothing below ran on a GPU, and the run exits 5 at best"
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
if ! ls "$libs" | grep -q nccl && [ -n "$py" ]; then
  nccl2=$("$py" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null || true)
  if [ -n "$nccl2" ] && [ -e "$nccl2" ]; then ln -sf "$nccl2" "$libs/libnccl.so" && echo "libnccl.so -> $nccl2"; fi
fi
export LD_LIBRARY_PATH="$libs${cu13:+:$cu13}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export GPU_CHECK_BUNDLE="$bundle" GPU_CHECK_LOGS="$logs" GPU_CHECK_PYTHON="${py:-python3}" \
  GPU_CHECK_GPUS="$gpus" GPU_CHECK_DEVICE="$device"

# ---------------------------------------------------------------- steps
# judge_targets LOG: one line per TARGET line of the log: "met|MISSED|BAD <TAB> name: figure (target op bound)".
judge_targets() {
  { grep -a '^TARGET ' "$1" || true; } | sed 's/^TARGET //' | awk -F' [|] ' '
    function num(x) { return x ~ /^-?[0-9]+([.][0-9]+)?([eE][-+]?[0-9]+)?$/ }
    {
      split($3, t, " ")
      if (NF != 3 || !num($2) || (t[1] != ">=" && t[1] != "<=") || !num(t[2])) { printf "BAD\t%s (not NAME | NUMBER | >= or <= NUMBER)\n", $0; next }
      ok = (t[1] == ">=") ? ($2 + 0 >= t[2] + 0) : ($2 + 0 <= t[2] + 0)
      printf "%s\t%s: %s (target %s %s)\n", ok ? "met" : "MISSED", $1, $2, t[1], t[2]
    }'
}
# The steps' helpers: `why LOG` (the line saying why a step failed) is the same for the steps and here.
# shellcheck source=gpu-check.d/common.sh
source "$bundle/gpu-check.d/common.sh"
set -e

: >"$logs/rows"
n_failed=0 n_missed=0 n_passed=0 n_unchecked=0 n_notrun=0 n_partly=0 n_checks_notrun=0
verdict_row() { echo "$1 | $2" >>"$logs/rows"; }
for step in "${selected[@]}"; do
  name=$(basename "$step")
  bad=$(bad_header "$step")
  if [ -n "$bad" ]; then
    verdict_row "$name" "FAILED: $bad (the step contract: gpu-check.sh --help)"
    n_failed=$((n_failed + 1))
    continue
  fi
  budget=$(($(header "$step" budget) * scale)) floor=$(header "$step" floor) need=$(header "$step" gpus)
  need=${need:-1}
  if [ "$gpus" = 0 ]; then
    verdict_row "$name" "NOT CHECKED: no GPU here (nvidia-smi lists none): $(header "$step" check | cut -c1-80)"
    n_unchecked=$((n_unchecked + 1))
    continue
  fi
  if [ "$need" -gt "$gpus" ]; then
    verdict_row "$name" "NOT RUN: needs $need GPUs, nvidia-smi lists $gpus"
    n_notrun=$((n_notrun + 1))
    continue
  fi
  say "step $name (budget $budget s, floor $floor checks): $(header "$step" check)"
  log="$logs/$name.log"
  t0=$(date +%s)
  set +e
  # timeout (exec'd: the subshell's pid) runs the step in a process group of its own, its pid, and
  # past the budget signals the whole group (ranks and children included), then SIGKILLs it. The
  # output goes to the log, shown as it grows: no pipe that a child left behind could hold open.
  (cd "$bundle" && GPU_CHECK_STEP_BUDGET=$budget exec timeout --kill-after=5 "$budget" bash "$step") >"$log" 2>&1 &
  pid=$!
  tail -n +1 -f --pid=$pid "$log" &
  shown=$!
  wait $pid
  rc=$?
  wait $shown
  set -e
  secs=$(($(date +%s) - t0))
  # Anything of the step still running: its process group (a child it left behind), and anything
  # naming the step's logs folder (a rank in a group of its own).
  kill -9 -- "-$pid" 2>/dev/null || true
  pgrep -f -- "$logs/" | grep -vx "$$" | xargs -r kill -9 2>/dev/null || true
  # The rows in the order printed; a NOTRUN line is the row "<check> | NOT RUN: <why>".
  { grep -a '^ROW \|^NOTRUN ' "$log" || true; } | sed 's/^ROW //; s/^NOTRUN \([^|]*\)| /\1| NOT RUN: /' >>"$logs/rows"
  made=$({ grep -a '^CHECKS [0-9][0-9]*$' "$log" || true; } | awk '{ s += $2 } END { print s + 0 }')
  notrun=$(grep -ac '^NOTRUN ' "$log" || true)
  targets=$(judge_targets "$log")
  if [ -n "$targets" ]; then
    while IFS=$'\t' read -r v what; do
      verdict_row "  target: $what" "$([ "$v" = met ] && echo met || echo "$v")"
    done <<<"$targets"
  fi
  missed=$(grep -c '^MISSED' <<<"$targets" || true)
  badt=$(grep -c '^BAD' <<<"$targets" || true)
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    verdict="FAILED: over its budget of $budget s (killed after $secs s)"
  elif [ "$rc" != 0 ]; then
    verdict="FAILED (exit $rc): $(why "$log")"
  elif [ $((made + notrun)) -lt "$floor" ]; then
    verdict="FAILED: $made checks made$([ "$notrun" = 0 ] || echo " and $notrun not run"), below its floor of $floor"
  elif [ "$badt" -gt 0 ]; then
    verdict="FAILED: $badt malformed TARGET line(s)"
  elif [ "$notrun" -gt 0 ]; then
    verdict="PARTLY RUN: $notrun check(s) NOT RUN (their rows say why), $made passed: not a pass"
  elif [ "$missed" -gt 0 ]; then
    verdict="TARGET MISSED: $missed of $(wc -l <<<"$targets") targets ($made checks passed)"
  else
    verdict="passed: $made checks (floor $floor)"
  fi
  case $verdict in
    FAILED*) n_failed=$((n_failed + 1)) ;;
    PARTLY*) n_partly=$((n_partly + 1)) n_checks_notrun=$((n_checks_notrun + notrun)) ;;
    TARGET*) n_missed=$((n_missed + 1)) ;;
    *) n_passed=$((n_passed + 1)) ;;
  esac
  verdict_row "$name" "$verdict in $secs s (budget $budget s)"
done

# ---------------------------------------------------------------- the table
say "gpu-check summary ($(($(date +%s) - t_start)) s; logs in $logs)"
[ "$device" = cuda ] || echo "CPU STAND-IN RUN (GPU_CHECK_DEVICE=$device): nothing here ran on a GPU"
awk -F' [|] ' '{ printf "%-52s %s\n", $1, $2 }' "$logs/rows"
counts="$n_passed passed, $n_failed failed, $n_partly partly run ($n_checks_notrun checks NOT RUN), $n_missed target missed, $n_unchecked not checked, $n_notrun not run (too few GPUs)"
if [ "$n_failed" -gt 0 ]; then
  echo "gpu-check: FAILED ($counts)"
  exit 1
elif [ "$gpus" = 0 ]; then
  echo "gpu-check: NO GPU: nvidia-smi lists none, nothing was checked ($counts)"
  exit 3
elif [ $((n_passed + n_missed + n_partly)) = 0 ]; then
  echo "gpu-check: FAILED: no step ran ($counts)"
  exit 1
elif [ "$device" != cuda ]; then
  echo "gpu-check: CPU STAND-IN (GPU_CHECK_DEVICE=$device): nothing failed, but nothing ran on a GPU: not a GPU check's pass ($counts)"
  exit 5
elif [ "$n_partly" -gt 0 ]; then
  echo "gpu-check: PARTLY RUN: every check that ran passed, but $n_checks_notrun did not run (their rows say why): not a pass ($counts)"
  exit 6
elif [ "$n_missed" -gt 0 ]; then
  echo "gpu-check: TARGET MISSED: every check passed, a benchmark missed its target ($counts)"
  exit 4
fi
echo "gpu-check: passed: every step ran on a GPU, every check ran and passed, every target met ($counts)"
exit 0
