#!/usr/bin/env bash
# readme-test: run every command of the ```sh blocks of README.md and then of every docs/*.md page
# (in name order), in order, on a fresh clone of this repository (its committed HEAD: what a new user
# gets), the way a new user would type them; and check that every relative link of those pages
# resolves.
#
#   scripts/readme-test.sh           # scripts/test.sh (and so .ci/run) runs it after the tests
#   scripts/readme-test.sh --cold    # without the build cache below: every crate built from scratch
#   scripts/readme-test.sh --dry-run # print each command as it would run (or why not), run nothing
#
# The rules, so that a command as written works or this fails:
# - A command is a line of a ```sh block (also one indented in a list) with its `\` continuation
#   lines, and the lines after it until the shell can parse it whole (a `for ... done` loop); `#`
#   lines are comments.
# - Expected exit code: 0, or N where the command's trailing comment says `exit N`.
# - Expected outcome: the `# expect` lines right below a command. `# expect: TEXT`: its output
#   (stdout and stderr) contains TEXT; `# expect in PATH: TEXT`: the file PATH (in the clone) exists
#   and contains TEXT. TEXT is literal, except that `$(command)` is replaced by the command's output
#   (run in the clone), e.g. `$(git rev-parse HEAD)`.
# - A command that trains (`gradbus run`, `cargo run ... -- run`, `gradbus worker` without
#   --bench-allreduce) and neither sets `steps=` nor has `# expect` lines gets `--set steps=2`
#   appended; otherwise it runs as written (the page chose its length, or states its outcome).
#   Anything else runs as written.
# - `gradbus` on PATH comes only from the README's own `cargo install`: its root is a temporary
#   CARGO_INSTALL_ROOT whose bin/ is on PATH (as ~/.cargo/bin is after rustup), and PATH entries
#   that already hold a `gradbus` are dropped. GRADBUS_* variables are unset, as in a new shell.
# - Commands that CI cannot run (a Slurm cluster, a GPU, a benchmark of minutes) are listed in SKIP
#   with the reason and the test that covers them, and print `SKIPPED: <command>: <why>` (also
#   appended to $GRADBUS_SKIP_LOG when set). A SKIP entry that matches no command is an error, so
#   the list cannot go stale.
# - Links: every relative markdown link `[text](path#anchor)` outside code blocks of those pages
#   must name a file of the clone, and its anchor a heading of that file (GitHub's anchors).
# - Build cache: unless --cold, the clone's target/release starts as a copy of this checkout's, so
#   dependencies are reused; the workspace's own crates are rebuilt from the clone's sources.
# Each command's output goes to a log; its last lines are shown, all of it when it fails. Exit 0
# when every command ran as expected, 1 at the first that did not (its work directory is kept).
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
cold=0
dry=0
case "${1:-}" in
  "") ;;
  --cold) cold=1 ;;
  --dry-run) dry=1 ;;
  -h | --help) sed -n '2,36p' "$0"; exit 0 ;;
  *) echo "readme-test: unknown argument $1 (see --help)" >&2; exit 2 ;;
esac

# The pages whose ```sh blocks run, in this order: the README, then every docs page by name (a new
# page is tested without being listed here). The README goes first: it installs gradbus and the
# Python package that the pages use.
PAGES=(README.md)
for f in "$src"/docs/*.md; do PAGES+=("docs/${f##*/}"); done

# Command (exactly as on its page, without its trailing comment) -> why it is not run here, and what
# runs it or tests what it does instead. Benchmarks are listed when they take minutes; the cheap ones
# run (docs/benchmarks.md's all-reduce table, the GEMM workbench, bench/guard-cost.sh).
declare -A SKIP=(
  ["scripts/test.sh"]="runs every test and then this README test: it is the command that runs this (CI: .ci/run)"
  # docs/megatron.md
  ["GRADBUS_PY312=~/.pyenv/versions/3.12.1/bin/python scripts/test.sh"]="scripts/test.sh with the megatron-core 0.19.2 suite added: the command that runs this"
  # docs/slurm.md
  ["sbatch examples/slurm.sbatch --set steps=50"]="needs a Slurm cluster; tests/slurm.rs runs this script on a one-node Slurm it starts"
  ["srun --kill-on-bad-exit=1 -n 4 gradbus worker --run-dir runs/s examples/tiny.toml"]="needs a Slurm allocation; tests/slurm.rs runs a bare srun of the worker on a one-node Slurm it starts"
  # docs/gpu.md
  ["scripts/gpu-check.sh"]="needs an NVIDIA GPU with its driver (CI has none)"
  ["scripts/gpu-check.sh --prepare target/gpu-check"]="builds test binaries for the GPU machine only; scripts/test.sh builds and runs the same cuda test targets here (their GPU parts print SKIPPED)"
  ["bash target/gpu-check/gpu-check.sh --prebuilt target/gpu-check"]="needs an NVIDIA GPU and the bundle of --prepare"
  # docs/deepspeed.md
  ["DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8 ninja"]="python/test.sh installs the same pins with --no-deps (python/requirements-frameworks.txt); in its venv, whose torch went in without its GPU-only dependencies, this command would pull in triton and cuda-bindings (pip install --dry-run says so)"
  # docs/pytorch.md
  ["python/build-wheels.sh dist"]="scripts/test.sh builds both wheels this way and tests them (python/test.sh: x86_64 with torch; python/aarch64-check.sh: aarch64 under qemu)"
  # docs/agreement.md (benchmarks)
  ["for run in 1 2 3; do
for np in 2 4 8 16; do
mpirun --allow-run-as-root --oversubscribe --bind-to none -np \$np target/release/gradbus worker --bench-allreduce --agreement --buckets 1,7,30,100,300,1750 --iters 5 --json
done
done > agreement.jsonl"]="a benchmark of minutes (3 runs at 2 to 16 ranks oversubscribed, up to 1750 buckets); docs/mpi.md runs its smallest form (2 ranks, 7 and 100 buckets) through scripts/agreement-cost.py, and the agreement's bits and the path's choice are tested by tests/agreement.rs and the mpi tests"
  ["scripts/agreement-cost.py < agreement.jsonl"]="reads the benchmark above, not run here; docs/mpi.md runs it on the benchmark's smallest form"
  ["for run in 1 2 3; do
for np in 2 4 8 16; do
mpirun --bind-to core -np \$np ./gradbus worker --bench-allreduce --agreement --buckets 1,7,30,100,300,1750 --iters 20 --json
done
done > agreement.jsonl"]="the same benchmark on the 16-core GPU machine, from a folder copied there (./gradbus); docs/mpi.md runs its smallest form here"
  ["python3 agreement-cost.py < agreement.jsonl"]="there, on the output of the loop above"
  ["export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"]="sets the variables of the loop above on the GPU machine; alone, in its own shell, it does nothing to test"
  # docs/benchmarks.md (benchmarks)
  ["scripts/bench-workload.sh --steps 30 --reps 4 --ranks 2,1"]="a benchmark of minutes (gradbus and the PyTorch twin alternated, 30 steps, 4 repetitions, 2 ranks and 1), and it pip-installs torch without BENCH_PYTHON; it times and prints only: the README runs gradbus on this config, python/tests/test_grpo_twin.py the PyTorch twin"
  ["scripts/bench-workload.sh --size tiny,3.2M --ranks 2 --reps 3"]="a benchmark of minutes (both sides at both sizes, 3 repetitions), and it pip-installs torch without BENCH_PYTHON; it times and prints only: the README runs gradbus on this config, python/tests/test_grpo_twin.py the PyTorch twin, kernels/tests/simd.rs the bits at every instruction-set level"
  ["scripts/bench-workload.sh --simd avx2 --size tiny,3.2M --ranks 2 --reps 3"]="the same benchmark with both sides restricted to AVX2 (minutes); kernels/tests/simd.rs runs every kernel at every level this CPU has and requires the same bits"
  ["scripts/bench-workload.sh --size tiny,3.2M --ranks 2 --reps 5"]="a benchmark of minutes (both sides at both sizes, 5 repetitions), and it pip-installs torch without BENCH_PYTHON; it times and prints only: the README runs gradbus on this config, python/tests/test_grpo_twin.py the PyTorch twin"
  ["perf record -F 1999 -o /tmp/perf.data -- ./target/release/gradbus run --np 1 --run-dir /tmp/pf examples/tiny.toml --set steps=4 --set model.channels=256 --set model.layers=4"]="a profile: needs perf (Debian's linux-perf, not installed by CI) and access to perf events, which containers usually deny; it has no outcome to check (the run it profiles is a plain gradbus run)"
  ["perf report -i /tmp/perf.data --no-children --sort symbol"]="reads the profile of perf record above, not run here"
  # docs/reliability.md
  ["scripts/fault-matrix.py"]="scripts/test.sh runs the fault matrix itself, just before this test (~1-2 min); a second run here would add only time"
  ["scripts/fault-matrix.py --set 'overlap=\"on\"'"]="the fault matrix again with overlap on, ~1-2 min more; scripts/test.sh runs the matrix as is, and tests/workload.rs plants a NaN with overlap on and off (the same report) and checks that overlap changes no bit"
  ["bench/sdc-profile.py --runs 8 --bin /tmp/s14/733a59d/gradbus --bin /tmp/s14/one-pass/gradbus"]="a benchmark (32 runs under perf, ~4 min) of two release binaries built at two commits, which a fresh clone does not have; it prints CPU profiles only; tests/twins.rs and kernels/tests/simd.rs check the one-pass optimizer's bits"
  ["bench/sdc-cost.py --reps 10 --steps 8 --split"]="a benchmark (80 runs, 0.5-3 min by the load) that prints timings only; tests/sdc.rs (the_checks_turned_off_change_no_bit) runs the same on and off modes and requires the same bits"
  ["scripts/sdc-clean.py"]="~5 min on 2 cores (8 tiny runs of 320 updates at 4 ranks, the 3.2M size, the 8-rank seed case to step 340); tests/sdc.rs (clean_runs_make_no_finding) runs its small form: tiny at 4 ranks and the fast seed case to its abort"
  # docs/roll-193.md
  ["scripts/roll-193.sh /tmp/roll193"]="~15 min on 2 cores (8 oversubscribed ranks, runs to step 340-400 and a loop over seeds); the README runs its first run, the 8-rank seed case to step 340 with the report checked, and tests/seed_case.rs the mechanism on the fast config"
)

# Commands of the PyTorch pages: they run in "the environment that has torch", which is
# python/test.sh's venv (target/pyvenv of this checkout; scripts/test.sh makes it before this runs).
# Without that venv they are skipped, saying so.
NEEDS_TORCH=(
  "pip install ./python"
  "python bench/pytorch_grpo.py examples/roll-193.toml --np 2 --set optim.lr=3e-2 --set rollout_sync_interval=200 --set steps=30 --guard abort --run-dir runs/twin"
  "pip install maturin ziglang"
  "torchrun --standalone --nproc-per-node 2 examples/pytorch_guard.py --steps 20"
  "torchrun --standalone --nproc-per-node 2 examples/pytorch_guard.py --steps 20 --plant-nan 7"
  "torchrun --standalone --nproc-per-node 2 examples/pytorch_guard.py --steps 20 --plant-nan 7 --policy rerun"
  "torchrun --standalone --nproc-per-node 2 examples/pytorch_guard.py --steps 20 --plant-nan 7 --policy abort --run-dir runs/guard"
  "torchrun --standalone --nproc-per-node 2 examples/pytorch_guard.py --steps 20 --amp fp16"
  "torchrun --standalone --nproc-per-node 2 examples/pytorch_guard.py --steps 20 --amp bf16"
  "torchrun --standalone --nproc-per-node 2 python/examples/megatron_guard.py --cpu --policy abort --plant 1:2:decoder.layers.0.mlp.linear_fc1.weight:77"
  "torchrun --standalone --nproc-per-node 2 python/examples/megatron_guard.py --cpu --policy skip --plant 1:2:decoder.layers.0.mlp.linear_fc1.weight:77"
  "torchrun --standalone --nproc-per-node 2 python/examples/megatron_guard.py --cpu --policy none --plant 1:2:decoder.layers.0.mlp.linear_fc1.weight:77"
  "torchrun --standalone --nproc-per-node 2 python/examples/fsdp_guard.py --policy abort --plant 1:2:mid.lin.weight:4000"
  "torchrun --standalone --nproc-per-node 2 python/examples/fsdp_guard.py --policy skip --plant 1:2:mid.lin.weight:4000"
  "torchrun --standalone --nproc-per-node 2 python/examples/hf_trainer.py --policy abort --plant 1:3:transformer.h.1.mlp.c_fc.weight:42"
  "torchrun --standalone --nproc-per-node 2 python/examples/hf_trainer.py --policy skip --plant 1:3:transformer.h.1.mlp.c_fc.weight:42"
)
# Commands that also need trl in that venv (python/requirements-frameworks.txt); skipped without it,
# as python/tests/test_trl.py is.
NEEDS_TRL=(
  "torchrun --standalone --nproc-per-node 2 python/examples/trl_grpo.py --policy none"
  "torchrun --standalone --nproc-per-node 2 python/examples/trl_grpo.py --policy abort"
)
# Commands that also need deepspeed (and ninja) in that venv (python/requirements-frameworks.txt);
# skipped without it, as python/tests/test_deepspeed.py is.
NEEDS_DEEPSPEED=(
  "torchrun --standalone --nproc-per-node 2 python/examples/deepspeed_guard.py --policy abort --plant 1:2:layers.0.linear1.weight:77"
  "torchrun --standalone --nproc-per-node 2 python/examples/deepspeed_guard.py --no-bf16-check --policy none --plant 1:2:layers.0.linear1.weight:77"
  "torchrun --standalone --nproc-per-node 2 python/examples/deepspeed_guard.py --no-bf16-check --policy skip --plant 1:2:layers.0.linear1.weight:77"
  "torchrun --standalone --nproc-per-node 2 python/examples/deepspeed_guard.py --precision fp16 --policy abort --plant 1:2:layers.0.linear1.weight:77"
  "torchrun --standalone --nproc-per-node 2 python/examples/deepspeed_guard.py --zero 3 --precision fp32 --policy abort --plant 0:1:head.weight:5"
)
pyvenv="$src/target/pyvenv"
if ! [ -e "$pyvenv/.complete" ]; then
  for key in "${NEEDS_TORCH[@]}" "${NEEDS_TRL[@]}" "${NEEDS_DEEPSPEED[@]}"; do
    SKIP[$key]="needs PyTorch and maturin; no target/pyvenv here (python/test.sh makes it)"
  done
else
  if ! "$pyvenv/bin/python" -c "import trl" 2>/dev/null; then
    for key in "${NEEDS_TRL[@]}"; do
      SKIP[$key]="needs trl, not installed in target/pyvenv (python/requirements-frameworks.txt); python/tests/test_trl.py skips too"
    done
  fi
  if ! "$pyvenv/bin/python" -c "import deepspeed" 2>/dev/null; then
    for key in "${NEEDS_DEEPSPEED[@]}"; do
      SKIP[$key]="needs deepspeed, not installed in target/pyvenv (python/requirements-frameworks.txt); python/tests/test_deepspeed.py skips too"
    done
  fi
fi

# The commands of the pages' ```sh blocks, one per array element (continuation lines joined with a
# blank, the lines of a loop with newlines); pages[i]: the page of commands[i]; expects[i]: the
# `# expect` lines of commands[i], one per line.
commands=()
pages=()
expects=()
pending="" # the lines of a command that the shell cannot parse yet (a loop's first lines)
while IFS=$'\t' read -r kind page text; do
  if [ "$kind" = C ]; then
    pending="${pending:+$pending$'\n'}$text"
    if bash -n <<<"$pending" 2>/dev/null; then
      commands+=("$pending")
      pages+=("$page")
      expects+=("")
      pending=""
    fi
  elif [ "$kind" = END ]; then
    [ -z "$pending" ] || { echo "readme-test: $page: a command the shell cannot parse: $pending" >&2; exit 1; }
  elif [ -n "$pending" ]; then
    echo "readme-test: $page: an expectation inside a command: $text" >&2
    exit 1
  elif [ ${#commands[@]} -gt 0 ] && [ "${pages[${#commands[@]} - 1]}" = "$page" ]; then
    expects[${#commands[@]} - 1]+="$text"$'\n'
  else
    echo "readme-test: $page: an expectation before any command: $text" >&2
    exit 1
  fi
done < <(cd "$src" && awk '
  /^[[:space:]]*```sh[[:space:]]*$/ { inblock = 1; next }
  /^[[:space:]]*```/ { if (inblock) { if (cmd != "") print "C\t" FILENAME "\t" cmd; print "END\t" FILENAME "\t" } inblock = 0; cmd = ""; next }
  !inblock { next }
  {
    line = $0
    if (cmd == "") {
      sub(/^[[:space:]]+/, "", line)
      if (line ~ /^#[[:space:]]*expect( in |:)/) { sub(/^#[[:space:]]*/, "", line); print "E\t" FILENAME "\t" line; next }
      if (line == "" || line ~ /^#/) next
    }
    else { sub(/^[[:space:]]+/, " ", line) }
    if (line ~ /\\[[:space:]]*$/) { sub(/[[:space:]]*\\[[:space:]]*$/, "", line); cmd = cmd line; next }
    print "C\t" FILENAME "\t" cmd line; cmd = ""
  }' "${PAGES[@]}")
[ ${#commands[@]} -gt 0 ] || { echo "readme-test: no \`\`\`sh commands in ${PAGES[*]}" >&2; exit 1; }

strip() { # the command without its trailing comment and surrounding blanks
  local c="${1%%[[:space:]]#*}"
  c="${c#"${c%%[![:space:]]*}"}"
  printf '%s' "${c%"${c##*[![:space:]]}"}"
}
for key in "${!SKIP[@]}" "${NEEDS_TORCH[@]}" "${NEEDS_TRL[@]}" "${NEEDS_DEEPSPEED[@]}"; do
  found=0
  for c in "${commands[@]}"; do [ "$(strip "$c")" = "$key" ] && found=1; done
  [ $found = 1 ] || { echo "readme-test: SKIP entry matches no command of ${PAGES[*]}: $key" >&2; exit 1; }
done

trains='(^|[[:space:]])(gradbus[[:space:]]+run|cargo[[:space:]].*--[[:space:]]+run|gradbus[[:space:]]+worker)[[:space:]]'
says_exit='(^|[^[:alnum:]])exit[[:space:]]+([0-9]+)'
# Prints the command as it runs here (bounded unless $2, its expectations, says what it must do)
# and sets `want`, its expected exit code.
bounded() {
  local cmd comment
  cmd=$(strip "$1")
  comment=""
  [ "$cmd" != "$1" ] && comment="${1#*[[:space:]]#}"
  if [[ " $cmd " =~ $trains ]] && [[ $cmd != *--bench-allreduce* ]] && [[ $cmd != *steps=* ]] && [ -z "$2" ]; then
    cmd="$cmd --set steps=2"
  fi
  want=0
  if [[ $comment =~ $says_exit ]]; then want=${BASH_REMATCH[2]}; fi
  printf '%s' "$cmd"
}
# Checks the `# expect` lines $1 of a command whose output is in the file $2; prints what failed.
check_expects() {
  local e text path bad=0
  while IFS= read -r e; do
    [ -n "$e" ] || continue
    text=${e#*: }
    [ "$text" != "$e" ] || text=""
    if [[ $text == *'$('* ]]; then # `$(command)`, run in the clone; nothing else is expanded
      text=$(cd "$clone" && eval "cat <<GRADBUS_README_EXPECT
$text
GRADBUS_README_EXPECT")
    fi
    if [[ $e == "expect in "* ]]; then
      path=${e#expect in }
      path=${path%%: *}
      path=${path%:}
      if ! [ -f "$clone/$path" ] || ! grep -qF -- "$text" "$clone/$path"; then
        echo "readme-test: $path ($([ -f "$clone/$path" ] && echo "exists" || echo "missing")) lacks: $text" >&2
        bad=1
      fi
    elif ! grep -qF -- "$text" "$2"; then
      echo "readme-test: the output lacks: $text" >&2
      bad=1
    fi
  done <<<"$1"
  return $bad
}

# Checks that every relative link of the pages, outside code blocks, names a file under $1 and its
# anchor a heading of that file (GitHub's anchors: lower case, punctuation dropped, blanks to `-`,
# `-1`, `-2` ... for repeats); prints each broken one and the count of those checked.
check_links() {
  python3 - "$1" "${PAGES[@]}" <<'PY'
import os, re, sys
root, pages = sys.argv[1], sys.argv[2:]
def prose(path):  # the lines of a markdown file outside fenced code blocks
    fence = None
    for line in open(path, encoding="utf-8"):
        m = re.match(r"\s*(```+|~~~+)", line)
        if m:
            if fence is None:
                fence = m.group(1)
            elif m.group(1).startswith(fence):
                fence = None
            continue
        if fence is None:
            yield line
def anchors(path):
    seen, out = {}, set()
    for line in prose(path):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        a = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out
bad = checked = 0
for page in pages:
    for line in prose(os.path.join(root, page)):
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue  # https:, mailto: ...
            checked += 1
            path, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(root, os.path.dirname(page), path)) if path else os.path.join(root, page)
            if not os.path.exists(file):
                print(f"readme-test: {page}: link ({target}): no file {os.path.relpath(file, root)}", file=sys.stderr)
                bad += 1
            elif anchor and file.endswith(".md") and anchor not in anchors(file):
                print(f"readme-test: {page}: link ({target}): no heading #{anchor} in {os.path.relpath(file, root)}", file=sys.stderr)
                bad += 1
print(checked)
sys.exit(1 if bad else 0)
PY
}

if [ $dry = 1 ]; then
  to_run=0
  to_skip=0
  for i in "${!commands[@]}"; do
    c=${commands[$i]}
    key=$(strip "$c")
    if [ -n "${SKIP[$key]+x}" ]; then
      echo "${pages[$i]}: SKIPPED: ${key//$'\n'/$'\n    '}: ${SKIP[$key]}"
      to_skip=$((to_skip + 1))
      continue
    fi
    cmd=$(bounded "$c" "${expects[$i]}")
    bounded "$c" "${expects[$i]}" >/dev/null
    echo "${pages[$i]} \$ ${cmd//$'\n'/$'\n    '}    (expect exit $want)"
    printf '%s' "${expects[$i]}" | sed 's/^/    # /'
    to_run=$((to_run + 1))
  done
  links=$(check_links "$src") || { echo "readme-test: broken links (above)" >&2; exit 1; }
  echo "readme-test: dry run: ${#commands[@]} command(s) on ${#PAGES[@]} page(s): $to_run would run, $to_skip skipped; $links relative link(s) resolve"
  exit 0
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/gradbus-readme.XXXXXX")
clone="$work/gradbus"
if [ -n "$(git -C "$src" status --porcelain --untracked-files=no)" ]; then
  echo "readme-test: note: uncommitted changes in $src are not tested (the clone is of HEAD)" >&2
fi
git clone -q "$src" "$clone"
if [ $cold = 0 ] && [ -d "$src/target/release" ]; then
  mkdir -p "$clone/target"
  cp -a "$src/target/release" "$clone/target/release"
fi
links=$(check_links "$clone") || { echo "readme-test: FAILED: broken links in the pages (above)" >&2; exit 1; }
echo "readme-test: $links relative link(s) of ${#PAGES[@]} page(s) resolve"

# A new user's environment: no gradbus on PATH until the README installs it, no GRADBUS_* set.
export CARGO_INSTALL_ROOT="$work/cargo-root"
path=""
IFS=: read -ra dirs <<<"$PATH"
for d in "${dirs[@]}"; do
  [ -n "$d" ] && [ ! -x "$d/gradbus" ] && path="${path:+$path:}$d"
done
export PATH="$CARGO_INSTALL_ROOT/bin:$path"
if [ -e "$pyvenv/.complete" ]; then
  export PATH="$pyvenv/bin:$PATH"
  # python/test.sh installed its own build of the package there: remove it, so that the README's
  # `pip install` really installs the clone's wheel (pip skips a wheel of a version already there).
  "$pyvenv/bin/python" -m pip uninstall -y -q gradbus
fi
skip_log=${GRADBUS_SKIP_LOG:-}
while IFS= read -r name; do unset "$name"; done < <(compgen -e | grep '^GRADBUS_' || true)

ran=0
skipped=0
n=0
t_start=$(date +%s)
for i in "${!commands[@]}"; do
  c=${commands[$i]}
  n=$((n + 1))
  key=$(strip "$c")
  if [ -n "${SKIP[$key]+x}" ]; then
    line="SKIPPED: ${key//$'\n'/ ⏎ }: ${SKIP[$key]}"
    echo "$line"
    if [ -n "$skip_log" ]; then echo "$line" >>"$skip_log"; fi
    skipped=$((skipped + 1))
    continue
  fi
  cmd=$(bounded "$c" "${expects[$i]}")
  bounded "$c" "${expects[$i]}" >/dev/null # sets want (the command substitution above ran in a subshell)
  log="$work/cmd-$n.log"
  echo "${pages[$i]} \$ ${cmd//$'\n'/$'\n    '}    (expect exit $want)"
  t0=$(date +%s)
  set +e
  (cd "$clone" && timeout -k 10 1200 bash -c "$cmd") >"$log" 2>&1
  rc=$?
  set -e
  if [ $rc != "$want" ]; then
    tail -n 200 "$log"
    echo "readme-test: FAILED: \`$cmd\` exited $rc, expected $want (work directory kept: $work)" >&2
    exit 1
  fi
  if ! check_expects "${expects[$i]}" "$log"; then
    tail -n 200 "$log"
    echo "readme-test: FAILED: \`$cmd\`: not the outcome ${pages[$i]} states (work directory kept: $work)" >&2
    exit 1
  fi
  tail -n 4 "$log" | sed 's/^/    /'
  checked=$(grep -c . <<<"${expects[$i]}" || true)
  echo "    ok: exit $rc$([ "$checked" = 0 ] || echo ", $checked stated outcome(s)") in $(($(date +%s) - t0)) s"
  # An install must put the one binary, and nothing else, where the README says PATH finds it.
  if [[ $cmd == "cargo install"* ]]; then
    found=$(command -v gradbus || true)
    bins=$(ls "$CARGO_INSTALL_ROOT/bin")
    if [ "$found" != "$CARGO_INSTALL_ROOT/bin/gradbus" ] || [ "$bins" != gradbus ]; then
      echo "readme-test: FAILED: after \`$cmd\`, gradbus on PATH is '$found' and $CARGO_INSTALL_ROOT/bin holds '$bins'; want the one binary gradbus there" >&2
      exit 1
    fi
  fi
  ran=$((ran + 1))
done
rm -rf "$work"
echo "readme-test: ok: $ran command(s) of ${#PAGES[@]} page(s) ran as expected on a fresh clone in $(($(date +%s) - t_start)) s, $skipped skipped (listed above)"
