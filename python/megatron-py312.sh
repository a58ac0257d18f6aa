#!/usr/bin/env bash
# test_megatron.py against megatron-core 0.19.2, which needs Python >= 3.12 (python/test.sh's venv is
# 3.11, where 0.16.1 is the newest release): a second venv, target/pyvenv312, from pyenv's 3.12, with
# torch 2.15.0 (cp312), triton 3.9.0 (megatron-core 0.19 imports it even on a CPU), megatron-core
# 0.19.2 and the gradbus wheel; torch's CUDA runtime libraries are hard links to python/test.sh's venv
# (run that first). Not run by CI: it downloads ~1.5 GB (torch 0.54, triton ~1) and adds ~1 GB.
#
#   python/megatron-py312.sh [PYTHON3.12]   (default: ~/.pyenv/versions/3.12.1/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-$HOME/.pyenv/versions/3.12.1/bin/python}
base=target/pyvenv
venv=target/pyvenv312
[ -e "$base/.complete" ] || { echo "megatron-py312: run python/test.sh first (its venv holds the CUDA libraries)" >&2; exit 2; }
if [ ! -e "$venv/.complete" ]; then
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --no-deps torch==2.15.0 triton==3.9.0 megatron-core==0.19.2 \
    numpy packaging typing-extensions filelock sympy mpmath networkx jinja2 markupsafe fsspec setuptools \
    pytest iniconfig pluggy pygments
  from=$(echo "$base"/lib/python3.*/site-packages)
  to=$(echo "$venv"/lib/python3.*/site-packages)
  for d in "$from"/nvidia "$from"/cuda "$from"/nvidia_*.dist-info "$from"/cuda_toolkit*.dist-info; do
    [ -e "$d" ] || continue # `cuda` (cuda-bindings) is in some venvs only
    cp -al "$d" "$to"/
  done
  touch "$venv/.complete"
fi
rm -rf target/pywheels312
"$base/bin/maturin" build --release --quiet -m python/Cargo.toml -o target/pywheels312
"$venv/bin/python" -m pip install -q --force-reinstall --no-deps target/pywheels312/gradbus-*.whl
cd python/tests
# megatron-core was installed above: its import failing fails the run (python/tests/skip.py).
GRADBUS_REQUIRE="${GRADBUS_REQUIRE:+$GRADBUS_REQUIRE,}megatron-core" \
  ../../"$venv"/bin/python -m pytest -q -p no:cacheprovider test_megatron.py
