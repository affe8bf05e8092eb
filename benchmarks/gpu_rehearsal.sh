#!/usr/bin/env bash
# Rehearse the GPU check with the GPU machine's software, on this machine's CPU:
# Python 3.12 and torch 2.11 (PyPI's CUDA build, which also runs on the CPU), with only
# the packages that machine has (pytest, hypothesis, numpy, rich, matplotlib,
# transformers: no vLLM, no pytest-timeout, reshard not installed, run from the source
# tree). It catches what the library needs from a newer torch or Python before GPU time
# is spent. It downloads about 3 GB the first time (the CUDA build's libraries).
#
#   bash benchmarks/gpu_rehearsal.sh [OUT_DIR]     (default /tmp/gpu_rehearsal)
#
# Runs the check's CPU debug mode, then the unit and multi-process tests; exits non-zero
# if either reports a wrong result. Not part of `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/gpu_rehearsal}
venv=${GPU_REHEARSAL_VENV:-.venv-gpu-rehearsal}
py=
for candidate in python3.12 ~/.pyenv/versions/3.12*/bin/python3.12; do
    if "$candidate" --version >/dev/null 2>&1; then py=$candidate; break; fi
done
if [ -z "$py" ]; then
    echo "gpu_rehearsal: no Python 3.12 found (python3.12, or pyenv's 3.12.x)" >&2
    exit 2
fi
if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv"
    "$venv/bin/pip" install -q "torch==2.11.0" pytest hypothesis numpy rich matplotlib \
        transformers
fi
"$venv/bin/python" -c 'import sys, torch; print("rehearsal:", sys.version.split()[0], "torch", torch.__version__)'
mkdir -p "$out"
status=0
PYTHONPATH="$PWD/src" "$venv/bin/python" benchmarks/gpu_check.py --device cpu --quick \
    --out "$out/check" > "$out/check.txt" 2>&1 || status=$?
tail -1 "$out/check.txt"
PYTHONPATH="$PWD/src" "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/unit tests/multiproc \
    > "$out/pytest.txt" 2>&1 || status=$?
grep -E "^(FAILED|ERROR) " "$out/pytest.txt" || true
tail -1 "$out/pytest.txt"
exit $status
