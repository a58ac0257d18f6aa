#!/usr/bin/env bash
# The test command of the README, and all that .ci/run does: install what the tests need on a
# fresh Debian/Ubuntu machine (when missing), then run every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages: Open MPI and libclang for the `mpi` feature (bindgen), iproute2; installed only when
# missing, so a second run costs nothing.
need=()
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin libopenmpi-dev)
dpkg -s libclang1-14 libclang-common-14-dev >/dev/null 2>&1 || need+=(libclang1-14 libclang-common-14-dev)
# `ip` for the two-node test in network namespaces (tests/mpi.rs; it skips, saying why, without root).
command -v ip >/dev/null 2>&1 || need+=(iproute2)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ] && ! command -v sudo >/dev/null; then
    echo "missing system packages: ${need[*]} (install them, or run as root)" >&2
    exit 2
  fi
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

cargo test --workspace --release
# The MPI transports (feature `mpi`: rsmpi, bindgen) under real `mpirun`s: only the `mpi` test targets
# (collectives/tests/mpi.rs, tests/mpi.rs); the line above already ran everything else, and keeps the
# default build (no MPI) tested. Costs the feature's build (~2-3 min on 2 cores) and ~40 s of tests.
cargo test --workspace --release --features mpi --test mpi

# The `cuda` feature builds without CUDA (cudarc loads libcuda/libnvrtc/libnccl at run time), so CI
# keeps it compiling; on this GPU-less machine its GPU tests print "SKIPPED: no CUDA driver" and the
# no-driver paths are tested for real. The GPU checks themselves: scripts/gpu-check.sh on a GPU.
cargo test --release --features cuda -p gradbus-kernels
cargo test --release --features cuda -p gradbus-collectives --test nccl
cargo test --release --features cuda -p gradbus-collectives --lib nccl::

# The Python package for PyTorch users (python/, issue #15): builds the PyO3 extension with maturin
# and runs its pytest suite (DDP over gloo, 2-3 processes) with torch from PyPI in target/pyvenv.
# The first run installs 4.4 GB (torch and the CUDA runtime libraries its PyPI wheel needs to import;
# python/test.sh says why). Measured here (2 cores, under load): 9 min from no venv with pip's
# download cache warm and the extension built once before (the tests: 2-6 min with the load); a
# fresh machine adds the wheels' download (torch's alone: 539 MB) and the extension's first build
# (~2 min).
python/test.sh
