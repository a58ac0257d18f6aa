#!/usr/bin/env bash
# The test command of the README, and all that .ci/run does. On a fresh Debian 12 machine with only
# rustup: install what the tests need (only what is missing, so a second run installs nothing),
# probe what this machine can run, run every test of the workspace, then every command of the README
# and of docs/*.md on a fresh clone (scripts/readme-test.sh), and end with the list of what was
# skipped and why.
set -euo pipefail
cd "$(dirname "$0")/.."
t_start=$(date +%s)
# Where a run dies of a full disk, the log says what it started with (python/test.sh's venv alone
# needs 8 GiB).
echo "test.sh: $(df -Pk . | awk 'NR == 2 { printf "%.1f GiB free on %s", $4 / 1048576, $6 }')"

# ---------------------------------------------------------------- system packages
# C toolchain (linking, and the `cc` builds of some crates), pkg-config, git (the README test clones
# the repository), Open MPI and libclang for the `mpi` feature (bindgen), iproute2 for the two-node
# test in network namespaces (tests/mpi.rs), procps (`kill`, which that test runs, and `ps`),
# util-linux and mount (`unshare`, `mount`: the namespaces of tests/mpi.rs and shm_bus.rs).
need=()
has() { type -P "$1" >/dev/null; } # an executable on PATH, not a shell builtin
installed() { dpkg -s "$@" >/dev/null 2>&1; }
{ has cc && installed libc6-dev; } || need+=(gcc libc6-dev)
# g++: kernels/tests/cuda_shim.rs builds the CUDA kernel sources for the CPU (kernels/shim/).
has g++ || need+=(g++)
has pkg-config || need+=(pkg-config)
has git || need+=(git)
has mpirun || need+=(openmpi-bin libopenmpi-dev)
installed libclang1-14 libclang-common-14-dev || need+=(libclang1-14 libclang-common-14-dev)
has ip || need+=(iproute2)
{ has ps && has kill; } || need+=(procps)
has unshare || need+=(util-linux)
has mount || need+=(mount)
# qemu-user-static and readelf (binutils): python/aarch64-check.sh runs the aarch64 wheel here.
has qemu-aarch64-static || need+=(qemu-user-static)
has readelf || need+=(binutils)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ] && ! has sudo; then
    echo "missing system packages: ${need[*]} (install them, or run as root)" >&2
    exit 2
  fi
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  export DEBIAN_FRONTEND=noninteractive
  echo "test.sh: installing ${need[*]}"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# ---------------------------------------------------------------- what this machine can run
# A test that cannot run prints `SKIPPED: <why>` (tests/common/skip.rs) and appends it to
# GRADBUS_SKIP_LOG; a capability named in GRADBUS_REQUIRE turns that test's skip into a failure. The
# probes below do what those tests need, so where a probe passes, the test must run.
tmp=$(mktemp -d "${TMPDIR:-/tmp}/gradbus-test.XXXXXX")
export GRADBUS_SKIP_LOG="$tmp/skipped"
: >"$GRADBUS_SKIP_LOG"
results="$tmp/cargo-test.log"
: >"$results"
require=()
# tmpfs: a 1 MiB tmpfs in a private mount namespace (collectives/tests/shm_bus.rs, full /dev/shm).
mkdir "$tmp/mnt"
if unshare -rm sh -c "mount -t tmpfs -o size=1m tmpfs '$tmp/mnt'" 2>/dev/null; then require+=(tmpfs); fi
# netns: root with CAP_NET_ADMIN and CAP_SYS_ADMIN: a bridge, a network namespace, a tmpfs on
# /dev/shm inside it (tests/mpi.rs, two nodes in network namespaces).
probe_netns() {
  local ns="gbprobe$$"
  [ "$(id -u)" = 0 ] && has ip || return 1
  ip link add "${ns}br" type bridge 2>/dev/null || return 1
  ip link del "${ns}br"
  ip netns add "$ns" 2>/dev/null || return 1
  local ok=0
  ip netns exec "$ns" unshare --mount --propagation private sh -c 'mount -t tmpfs -o size=1m tmpfs /dev/shm' \
    2>/dev/null && ok=1
  ip netns del "$ns"
  [ $ok = 1 ]
}
if probe_netns; then require+=(netns); fi
# slurm: a real one-node cluster (slurmctld, slurmd, munge) that scripts/slurm-local.sh starts per
# test as root, state in a temp dir, on free ports (tests/slurm.rs). Installed when missing (~15 s).
if [ "$(id -u)" = 0 ]; then
  if ! has sbatch || ! [ -x /usr/sbin/slurmd ] || ! [ -x /usr/sbin/munged ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      slurmctld slurmd slurm-client munge >/dev/null
  fi
  require+=(slurm)
fi
# cxx: a C++ compiler, installed above (kernels/tests/cuda_shim.rs runs the .cu sources on the CPU).
if has g++; then require+=(cxx); fi
# simd-<level>: each instruction-set level whose flags /proc/cpuinfo shows (the names and flags of
# gradbus_kernels::simd::Level): kernels/tests/simd.rs must compare that level's path, not take the
# kernels' own word that the CPU lacks it.
flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2 || true) "
cpu_has() { for f; do [[ $flags == *" $f "* ]] || return 1; done; }
if cpu_has avx fma; then require+=(simd-avx); fi
if cpu_has avx2 fma; then require+=(simd-avx2); fi
if cpu_has avx512f avx2 fma; then require+=(simd-avx512); fi
# cuda: a GPU that the driver lists (kernels/tests/cuda.rs, collectives/tests/nccl.rs).
if has nvidia-smi && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then require+=(cuda); fi
GRADBUS_REQUIRE=$(IFS=,; echo "${require[*]}")
export GRADBUS_REQUIRE
echo "test.sh: GRADBUS_REQUIRE=$GRADBUS_REQUIRE (tests that need these must run here, not skip)"

# ---------------------------------------------------------------- the closing list
# Printed however the run ends: the test totals, every SKIPPED line (with how many tests printed
# it; pytest's too), every #[ignore]d test (benchmarks: run by hand; the entries that multi-process
# tests run in their children: not tests), and the time taken.
closing() {
  local rc=$?
  echo
  echo "==================== test.sh: closing list ===================="
  if [ -s "$results" ]; then
    awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($i ~ /^passed/) p += $(i-1); if ($i ~ /^failed/) f += $(i-1); if ($i ~ /^ignored/) g += $(i-1) } n++ }
         END { printf "tests: %d passed, %d failed, %d ignored (%d test harness runs)\n", p, f, g, n }' "$results"
    echo "ignored (#[ignore]: benchmarks and long runs, by hand; child-process entries, run by their tests):"
    grep -E '^test .* \.\.\. ignored' "$results" | sed -E 's/^test (.*) \.\.\. ignored(, )?/  \1: /; s/: $//' | sort -u || echo "  none"
  fi
  echo "skipped (SKIPPED: the test or README command could not run here):"
  if [ -s "$GRADBUS_SKIP_LOG" ]; then
    sort "$GRADBUS_SKIP_LOG" | uniq -c | sed -E 's/^ *1 /  /; s/^ *([0-9]+) /  (x\1) /'
  else
    echo "  none"
  fi
  echo "required here (a skip would have failed): ${GRADBUS_REQUIRE:-nothing}"
  echo "test.sh: $([ $rc = 0 ] && echo ok || echo "FAILED (exit $rc)") in $(($(date +%s) - t_start)) s"
  rm -rf "$tmp"
  exit $rc
}
trap closing EXIT
trap 'exit 130' INT HUP
trap 'exit 143' TERM

# `cargo test`'s output goes to the log too, for the closing list's totals.
run() {
  echo "test.sh: $*"
  "$@" 2>&1 | tee -a "$results"
}
# `run` for a `cargo test ... -- FILTER...` that selects tests by name: each filter must select a test
# that ran (passed, failed or skipped, not ignored), or the run fails - a renamed test would leave its
# filter selecting nothing, and cargo test passes an empty selection.
run_selected() {
  local from filter past=0
  from=$(($(wc -l <"$results") + 1))
  run "$@"
  for filter in "$@"; do
    if [ $past = 1 ] && [[ $filter != -* ]] &&
      ! tail -n "+$from" "$results" | awk -v f="$filter" '$1 == "test" && index($2, f) && $3 == "..." && $4 !~ /^ignored/ { n++ } END { exit !n }'; then
      echo "test.sh: the filter '$filter' selected no test that ran (renamed?): $*" >&2
      exit 1
    fi
    [ "$filter" != -- ] || past=1
  done
}

# ---------------------------------------------------------------- the tests
run cargo test --workspace --release
# The MPI transports (feature `mpi`: rsmpi, bindgen) under real `mpirun`s: only the `mpi` test targets
# (collectives/tests/mpi.rs, tests/mpi.rs); the line above already ran everything else, and keeps the
# default build (no MPI) tested. Costs the feature's build (~2-3 min on 2 cores) and ~40 s of tests.
run cargo test --workspace --release --features mpi --test mpi
# Slurm with the MPI transport (tests/slurm.rs): `srun --mpi=pmix` on one node, and two nodes in
# network namespaces (`two_nodes_`); the other Slurm tests ran above.
run_selected cargo test --workspace --release --features mpi --test slurm -- pmix_ two_nodes_

# The fault matrix (docs/reliability.md): every fault ends with its documented exit code and leaves
# no process or segment, nothing is lost where nothing should be, and every damaged artifact is
# refused naming the file; it exits 1 if any row is not as expected (~1-2 min).
echo "test.sh: scripts/fault-matrix.py"
python3 scripts/fault-matrix.py

# The `cuda` feature builds without CUDA (cudarc loads libcuda/libnvrtc/libnccl at run time), so CI
# keeps it compiling; on this GPU-less machine its GPU tests print "SKIPPED: no CUDA driver" and the
# no-driver paths are tested for real. The GPU checks themselves: scripts/gpu-check.sh on a GPU.
run cargo test --release --features cuda -p gradbus-kernels
run cargo test --release --features cuda -p gradbus-collectives --test nccl
run_selected cargo test --release --features cuda -p gradbus-collectives --lib -- nccl::

# The Python package for PyTorch users (python/, issue #15): builds the PyO3 extension with maturin
# and runs its pytest suite (DDP over gloo, 2-3 processes) with torch from PyPI in target/pyvenv.
# The first run installs 5.3 GB (torch and the CUDA runtime libraries its PyPI wheel needs to import;
# python/test.sh says why; 7.5 GB at the install's peak: it refuses to start with less than 8 GiB
# free). Measured here (2 cores): the install 100 s from PyPI (2026-12-02, no download cache), the
# tests 2-6 min with the load, the extension's first build ~2 min.
echo "test.sh: python/test.sh"
python/test.sh
# gradbus.megatron against megatron-core 0.19.2, which needs Python >= 3.12: Debian 12 has 3.11 (the
# suite above tests 0.16.1 there), and no registry CI reaches ships a CPython, so it runs only where
# GRADBUS_PY312 names a Python 3.12 (python/megatron-py312.sh: a second venv, ~1.5 GB of downloads).
if [ -n "${GRADBUS_PY312:-}" ]; then
  echo "test.sh: python/megatron-py312.sh $GRADBUS_PY312"
  python/megatron-py312.sh "$GRADBUS_PY312"
else
  echo "SKIPPED: python/megatron-py312.sh (gradbus.megatron against megatron-core 0.19.2): needs Python >= 3.12, which Debian 12 lacks; set GRADBUS_PY312=<python3.12> to run it" |
    tee -a "$GRADBUS_SKIP_LOG"
fi
# The aarch64 wheel, cross-built, run under qemu-aarch64 by Debian's arm64 CPython: the same bits as
# the x86_64 wheel just tested, and no glibc symbol newer than 2.17 in either (~1 min; a first run
# also downloads 7 MB of arm64 .debs).
# With GRADBUS_AARCH64_TORCH=1 also the DDP guard's tests with torch 2.5.1 (aarch64) under qemu
# (--torch: ~8 minutes more on 2 cores, a 92 MB download), else a SKIPPED line.
torch=${GRADBUS_AARCH64_TORCH:+--torch}
echo "test.sh: python/aarch64-check.sh $torch"
python/aarch64-check.sh target/pyvenv-clean/bin/python $torch
if [ -z "$torch" ]; then
  echo "SKIPPED: python/aarch64-check.sh --torch (the DDP guard's tests with torch on aarch64, under qemu): ~8 minutes more on 2 cores; set GRADBUS_AARCH64_TORCH=1 to run it" |
    tee -a "$GRADBUS_SKIP_LOG"
fi

# Every kernels/cuda/*.cu compiles with NVRTC, to PTX and to machine code for sm_80 and sm_90 (no
# GPU needed; ~15 s), against PyPI's NVRTC that the venv above holds (torch's nvidia-cuda-nvrtc, in
# nvidia/cu13/lib, beside its builtins). cudarc asks for libnvrtc.so (or .so.12, .so.11, ...), so a
# link of that name to libnvrtc.so.13 goes first.
nvrtc_dir=$(ls -d "$PWD"/target/pyvenv/lib/python3*/site-packages/nvidia/cu13/lib 2>/dev/null | head -n 1 || true)
if [ -z "$nvrtc_dir" ] || [ ! -e "$nvrtc_dir/libnvrtc.so.13" ]; then
  echo "test.sh: no libnvrtc.so.13 in target/pyvenv (python/test.sh builds it with torch's CUDA wheels)" >&2
  exit 1
fi
mkdir -p "$tmp/nvrtc"
ln -sf "$nvrtc_dir/libnvrtc.so.13" "$tmp/nvrtc/libnvrtc.so"
GRADBUS_REQUIRE="$GRADBUS_REQUIRE,nvrtc" LD_LIBRARY_PATH="$tmp/nvrtc:$nvrtc_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  run_selected cargo test --release --features cuda -p gradbus-kernels --test cuda -- kernel_sources_compile

# The GPU check's own logic, on this GPU-less machine (scripts/gpu-check-test.sh): its verdicts with
# stand-in steps and a stand-in nvidia-smi, the real steps failing on a listed GPU they cannot use,
# and every step run with the CPU as the device (gpu_check.py and megatron_check.py --cpu among
# them; ~10 min on 2 loaded cores, most of it the PyTorch guard's DDP jobs).
echo "test.sh: scripts/gpu-check-test.sh"
scripts/gpu-check-test.sh

# Every command of the README, then of docs/*.md, on a fresh clone, in order: the first contact of a
# new user. Its own install (`cargo install --path .`, into a temporary root) is the check that an
# install works; every relative link of those pages must resolve.
echo "test.sh: scripts/readme-test.sh"
scripts/readme-test.sh
