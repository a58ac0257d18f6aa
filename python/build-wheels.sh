#!/usr/bin/env bash
# build-wheels: the gradbus Python package as wheels that install where people train - abi3 (one
# wheel for every CPython >= 3.9), tagged manylinux2014 (glibc 2.17: RHEL/Rocky 7 and 8, Ubuntu
# 18.04 and later), for x86_64 and aarch64 (Grace Hopper) - cross-built here with `maturin --zig`
# (zig links against glibc 2.17's symbols, whatever this machine's glibc is).
#
#   python/build-wheels.sh OUT_DIR                 both architectures
#   python/build-wheels.sh OUT_DIR x86_64          one (CI builds this one and tests it)
#
# Needs: Rust with rustup (the script adds the targets it lacks), and a Python that has maturin and
# ziglang (`pip install maturin ziglang`): $PYTHON, or python3 on PATH. Install a wheel with
# `pip install OUT_DIR/gradbus-*-manylinux2014_$(uname -m)*.whl`.
set -euo pipefail
out=${1:?"usage: python/build-wheels.sh OUT_DIR [x86_64] [aarch64]"}
shift
arches=("$@")
[ ${#arches[@]} -gt 0 ] || arches=(x86_64 aarch64)
mkdir -p "$out"
out=$(cd "$out" && pwd)
python=$(command -v "${PYTHON:-python3}") || { echo "build-wheels: no ${PYTHON:-python3} on PATH (set PYTHON)" >&2; exit 2; }
# Absolute, but not through its symlink (a venv's python is one): zig runs from other folders.
python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")"
cd "$(dirname "$0")/.."
for mod in maturin ziglang; do
  "$python" -c "import $mod" 2>/dev/null ||
    { echo "build-wheels: $python lacks $mod (hint: $python -m pip install maturin ziglang)" >&2; exit 2; }
done
command -v rustup >/dev/null || { echo "build-wheels: rustup not found (it adds the cross targets; https://rustup.rs)" >&2; exit 2; }
# maturin runs zig as `python3 -m ziglang`: the python3 of that interpreter's folder first on PATH.
export PATH="$(dirname "$python"):$PATH"

for arch in "${arches[@]}"; do
  case $arch in
    x86_64 | aarch64) ;;
    *) echo "build-wheels: architecture $arch: expected x86_64 or aarch64" >&2; exit 2 ;;
  esac
  target=$arch-unknown-linux-gnu
  rustup target list --installed | grep -qx "$target" || rustup target add "$target"
  "$python" -m maturin build --release --quiet --zig --target "$target" --compatibility manylinux2014 \
    -m python/Cargo.toml -o "$out"
  wheel=$( (ls -t "$out"/gradbus-*-cp39-abi3-*manylinux2014_"$arch"*.whl 2>/dev/null || true) | head -n 1)
  [ -n "$wheel" ] || { echo "build-wheels: no manylinux2014 $arch wheel in $out" >&2; exit 1; }
  echo "build-wheels: $wheel"
done
