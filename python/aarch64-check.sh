#!/usr/bin/env bash
# The aarch64 wheel (Grace Hopper, Graviton), run on this x86_64 machine: python/build-wheels.sh
# cross-builds it, Debian 12's own arm64 CPython 3.11 (downloaded as .debs through a private apt
# state under target/, the system's apt untouched) runs it under qemu-user, and its transcript of
# the native core (python/tests/arch_transcript.py: scans, checksums, the agreement's verdicts and
# reports) must equal the x86_64 wheel's, line for line. Both wheels must ask for no glibc symbol
# newer than manylinux2014's 2.17. What python/test.sh and scripts/test.sh run after the x86_64 tests.
#
#   python/aarch64-check.sh X86_64_PYTHON     a python with the x86_64 wheel installed
#   python/aarch64-check.sh X86_64_PYTHON --torch
#       also runs four of the DDP guard's tests with torch (python/tests/test_ddp.py: a clean run is
#       plain DDP bit for bit, rerun, a planted NaN is named on every rank, skip keeps weights and
#       Adam state) under qemu, with torch 2.5.1's aarch64 CPU wheel from PyPI (torch 2.15's aarch64
#       wheel is a CUDA build, which needs CUDA's libraries to import). By hand, or
#       GRADBUS_AARCH64_TORCH=1 in scripts/test.sh: ~8 minutes on 2 cores.
#
# Needs: qemu-aarch64-static (Debian: qemu-user-static; scripts/test.sh installs it), readelf
# (binutils), apt-get, and what python/build-wheels.sh needs ($PYTHON: maturin and ziglang).
set -euo pipefail
x86=${1:?"usage: python/aarch64-check.sh X86_64_PYTHON [--torch] (a python with the x86_64 gradbus wheel installed)"}
with_torch=${2:-}
[ -z "$with_torch" ] || [ "$with_torch" = --torch ] ||
  { echo "aarch64-check: unknown option '$with_torch' (hint: --torch, or nothing)" >&2; exit 2; }
cd "$(dirname "$0")/.."
for tool in qemu-aarch64-static readelf apt-get dpkg-deb; do
  command -v "$tool" >/dev/null ||
    { echo "aarch64-check: $tool not found (hint: apt-get install qemu-user-static binutils)" >&2; exit 2; }
done
work=target/aarch64
mkdir -p "$work"

# The wheel.
rm -rf "$work/wheels" "$work/site"
PYTHON="${PYTHON:-target/pyvenv/bin/python}" python/build-wheels.sh "$work/wheels" aarch64
wheel=$(ls "$work"/wheels/gradbus-*-cp39-abi3-manylinux2014_aarch64*.whl)
mkdir -p "$work/site"
"$x86" -m zipfile -e "$wheel" "$work/site"

# glibc: the newest symbol version each wheel's extension asks for.
newest() { readelf -V "$1" | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -n 1; }
x86_so=$("$x86" -c 'import gradbus._core as c; print(c.__file__)')
for so in "$x86_so" "$work"/site/gradbus/_core*.so; do
  v=$(newest "$so")
  [ "$(printf '%s\n2.17\n' "$v" | sort -V | tail -n 1)" = 2.17 ] ||
    { echo "aarch64-check: $so needs GLIBC_$v, newer than manylinux2014's 2.17" >&2; exit 1; }
  echo "aarch64-check: $so: newest glibc symbol GLIBC_$v"
done

# Debian 12's arm64 CPython, unpacked into a sysroot (kept between runs).
root=$work/debian-arm64
# libstdc++6, libgomp1 and libffi8 (ctypes): for torch (--torch). Rebuilt when the list changes.
debs="libc6 libgcc-s1 zlib1g libexpat1 python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libstdc++6 libgomp1 libffi8"
if [ "$(cat "$root/.complete" 2>/dev/null)" != "$debs" ]; then
  rm -rf "$root" "$work/apt"
  mkdir -p "$work/apt/state/lists/partial" "$work/apt/cache/archives/partial" "$work/apt/debs" "$root"
  printf '%s\n' "deb [arch=arm64] http://deb.debian.org/debian bookworm main" \
    "deb [arch=arm64] http://deb.debian.org/debian-security bookworm-security main" >"$work/apt/sources.list"
  apt=(apt-get -q -o APT::Architecture=arm64 -o "APT::Architectures::=arm64" -o "Dir::State=$PWD/$work/apt/state"
    -o "Dir::Cache=$PWD/$work/apt/cache" -o "Dir::Etc::SourceList=$PWD/$work/apt/sources.list"
    -o Dir::Etc::SourceParts=/nonexistent -o Dir::State::status=/dev/null -o APT::Sandbox::User=root)
  "${apt[@]}" update >/dev/null
  # shellcheck disable=SC2086 # $debs: one word per package
  (cd "$work/apt/debs" && "${apt[@]}" download $debs >/dev/null)
  for deb in "$work"/apt/debs/*.deb; do dpkg-deb -x "$deb" "$root"; done
  echo "$debs" >"$root/.complete"
fi

# The two transcripts.
"$x86" python/tests/arch_transcript.py >"$work/x86_64.txt"
qemu-aarch64-static -L "$root" "$root/usr/bin/python3.11" -c \
  "import sys; sys.path.insert(0, '$work/site'); sys.argv = ['arch_transcript.py']; exec(open('python/tests/arch_transcript.py').read())" \
  >"$work/aarch64.txt"
head -n 1 "$work/aarch64.txt" | grep -qx 'machine aarch64' ||
  { echo "aarch64-check: the emulated python says '$(head -n 1 "$work/aarch64.txt")', not aarch64" >&2; exit 1; }
if ! diff <(tail -n +2 "$work/x86_64.txt") <(tail -n +2 "$work/aarch64.txt") >"$work/diff.txt"; then
  echo "aarch64-check: the aarch64 wheel computes other bits than the x86_64 wheel:" >&2
  head -n 20 "$work/diff.txt" >&2
  exit 1
fi
echo "aarch64-check: ok: $(basename "$wheel") under qemu-aarch64 equals the x86_64 wheel on all $(($(wc -l <"$work/x86_64.txt") - 1)) lines of python/tests/arch_transcript.py"

[ "$with_torch" = --torch ] || exit 0
# torch 2.5.1 (aarch64, CPU) and pytest: torch's pure-Python imports and pytest come from the x86_64
# python's site-packages (pure Python: the same files serve aarch64).
t=$work/torch
if [ ! -e "$t/.complete" ]; then
  rm -rf "$t"
  mkdir -p "$t/site"
  "$x86" -m pip download -q torch==2.5.1 --platform manylinux2014_aarch64 --only-binary=:all: --no-deps \
    --python-version 3.11 -d "$t"
  "$x86" -m zipfile -e "$t"/torch-2.5.1-*.whl "$t/site"
  sp=$("$x86" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  for p in typing_extensions.py sympy mpmath networkx jinja2 markupsafe filelock fsspec \
    _pytest pytest py.py pluggy iniconfig packaging pygments; do
    cp -a "$sp/$p" "$t/site/"
  done
  touch "$t/.complete"
fi
# The emulated python as a program: torch.multiprocessing's spawn re-executes it for every rank,
# and a pytest plugin points multiprocessing at it.
printf '%s\n' '#!/usr/bin/env bash' "export PYTHONPATH=$PWD/$work/site:$PWD/$t/site" \
  "exec qemu-aarch64-static -L $PWD/$root $PWD/$root/usr/bin/python3.11 \"\$@\"" >"$t/python"
chmod +x "$t/python"
printf '%s\n' "import multiprocessing" "multiprocessing.set_executable('$PWD/$t/python')" >"$t/site/qemu_spawn.py"
(cd python/tests && PYTHONDONTWRITEBYTECODE=1 "../../$t/python" -m pytest -q -p no:cacheprovider -p qemu_spawn \
  test_ddp.py -k "clean_run_is_plain or rerun_transient or nan-mid-rank1 and not table or skip_leaves")
echo "aarch64-check: ok: the DDP guard's tests pass on aarch64 (qemu) with torch 2.5.1"

