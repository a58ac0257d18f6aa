#!/usr/bin/env bash
# Build the gradbus Python package (python/, PyO3 + maturin) as the x86_64 manylinux2014 wheel users
# install (python/build-wheels.sh: maturin --zig), install it into a clean venv with torch (CPU) from
# plain PyPI, and run the pytest suite there: what scripts/test.sh runs at its end, and what .ci/run
# runs through it.
#
# Everything goes into a venv at target/pyvenv (git-ignored, kept between runs, so a second run only
# rebuilds the extension). torch's PyPI wheel for Linux x86_64 is its CUDA build; it runs on a CPU
# but imports only with the CUDA runtime libraries present, so python/requirements-ci.txt installs
# those and leaves out triton and cuda-bindings (torch itself goes in with --no-deps).
# Cost on a fresh machine (2 cores): 5.3 GB of venv, 7.5 GB of disk at the install's peak (pip holds
# the downloaded wheels until it has unpacked them); docs/pytorch.md ("Tests, and what CI pays").
set -euo pipefail
cd "$(dirname "$0")/.."

venv=target/pyvenv
# No second copy of those wheels in pip's download cache (~/.cache/pip; the venv is kept instead).
export PIP_NO_CACHE_DIR=1
# `.complete` is written last: a venv whose install was interrupted is made anew.
if [ ! -e "$venv/.complete" ]; then
  # Refused up front, naming the space, rather than "[Errno 28] No space left on device" half-way;
  # counted after an interrupted install's remains are gone, and with pip's unpacking (its
  # temporary folder, $TMPDIR) on the same disk.
  rm -rf "$venv" target/pip-tmp
  mkdir -p target
  free_kib=$(df -Pk target | awk 'NR == 2 { print $4 }')
  if [ "$free_kib" -lt $((8 * 1024 * 1024)) ]; then
    echo "python/test.sh: making the test venv $venv (torch and the CUDA runtime libraries its Linux wheel imports) needs 8 GiB free on $(df -P target | awk 'NR == 2 { print $6 }') (7.5 GB at the install's peak, 5.3 GB kept); $((free_kib / 1024)) MiB are free there (hint: free disk space, e.g. old build folders' target/, then run it again)" >&2
    exit 1
  fi
  if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
    # Debian's python3 lacks venv/ensurepip without python3-venv.
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends python3-venv python3-pip >/dev/null
  fi
  python3 -m venv "$venv"
  mkdir target/pip-tmp
  venv_pip() { TMPDIR="$PWD/target/pip-tmp" "$venv/bin/python" -m pip "$@"; }
  venv_pip install -q --upgrade pip
  # pip then reports torch's missing triton and cuda-bindings as "dependency conflicts": expected.
  venv_pip install -q --no-deps torch==2.15.0
  venv_pip install -q -r python/requirements-ci.txt
  rm -rf target/pip-tmp
  touch "$venv/.complete"
fi
# The framework adapters' test dependencies (megatron-core, transformers, trl, deepspeed; ~510 MB), all
# pinned and installed without their dependencies (see the file); again whenever the file changes.
# DeepSpeed's sdist is built with DS_BUILD_OPS=0 and --no-build-isolation (its setup.py imports torch).
fw=$(sha256sum python/requirements-frameworks.txt | cut -c1-16)
if [ ! -e "$venv/.frameworks-$fw" ]; then
  DS_BUILD_OPS=0 "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -r python/requirements-frameworks.txt
  rm -f "$venv"/.frameworks-*
  touch "$venv/.frameworks-$fw"
fi
# The build tools (maturin, ziglang) live in the venv above; a venv made before ziglang was added
# gets it here.
"$venv/bin/python" -c 'import ziglang' 2>/dev/null || "$venv/bin/python" -m pip install -q "$(grep '^ziglang' python/requirements-ci.txt)"

# The extension's own workspace and target dir (python/target): the runtime's build never sees it.
rm -rf target/pywheels
PYTHON="$venv/bin/python" python/build-wheels.sh target/pywheels x86_64
wheel=$(ls target/pywheels/gradbus-*-cp39-abi3-manylinux2014_x86_64*.whl)

# The clean venv: torch and its dependencies as above, without the build tools or any gradbus - a
# hard-linked copy (seconds, no disk; pip's uninstall unlinks only the copy's files) - into which
# pip installs the wheel from the file alone (--no-index: nothing else is fetched).
clean=target/pyvenv-clean
rm -rf "$clean"
cp -al "$venv" "$clean"
rm "$clean/.complete"
"$clean/bin/python" -m pip uninstall -y -q maturin ziglang gradbus 2>/dev/null || true
"$clean/bin/python" -m pip install -q --no-index "$wheel"
echo "python/test.sh: testing $wheel in $clean"

# DeepSpeed's CPU accelerator JIT-builds its shm op (C++, with ninja, g++ and Python's headers) at
# deepspeed.init_distributed, into ~/.cache/torch_extensions. The build is keyed by the venv's paths
# (a build for target/pyvenv is redone for target/pyvenv-clean, and back): build it here for the venv
# the tests run in (~1 min of 2 cores; seconds when it is there), so that a missing compiler fails
# here, saying so, and the DeepSpeed tests' time is theirs.
if ! type -P g++ >/dev/null || ! "$clean/bin/python" -c 'import os, sysconfig; assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' 2>/dev/null; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends g++ python3-dev >/dev/null
fi
if ! log=$(PATH="$PWD/$clean/bin:$PATH" "$clean/bin/python" -c '
from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder("ShareMemCommBuilder").load()' 2>&1); then
  echo "$log" >&2
  echo "python/test.sh: DeepSpeed's CPU shm op did not build (above)" >&2
  exit 1
fi

# The frameworks installed above must import, so their tests run: GRADBUS_REQUIRE turns a file's
# "does not import" skip into a failure (python/tests/skip.py). pip installs them without their
# dependencies, and one missing from the pinned list would otherwise skip a whole file, green.
export GRADBUS_REQUIRE="${GRADBUS_REQUIRE:+$GRADBUS_REQUIRE,}megatron-core,transformers,trl,deepspeed"

# From python/tests, so that `import gradbus` is the installed wheel, not the source folder.
cd python/tests
../../"$clean"/bin/python -c 'import gradbus, sys; assert "site-packages" in gradbus.__file__, gradbus.__file__'
# -rs: each skipped test prints its reason; conftest.py also appends it to GRADBUS_SKIP_LOG, the
# closing list of scripts/test.sh.
../../"$clean"/bin/python -m pytest -q -rs -p no:cacheprovider .
