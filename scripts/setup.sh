#!/usr/bin/env bash
# Sets up .venv with torch and mbs_ext (extension built in place, editable).
# Idempotent: a second run with unchanged sources does nothing.
#   MBS_EXT_CUDA=0|1  force a CPU-only build / require the CUDA kernels
#   MBS_TORCH=...     torch requirement (default torch==2.14.1, the CUDA 13 build)
#   MBS_VENV=dir      the virtual environment to set up (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
TORCH_REQ="${MBS_TORCH:-torch==2.14.1}"
VENV="${MBS_VENV:-.venv}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

if [ ! -x "$VENV"/bin/python ]; then
  echo "[setup] creating $VENV"
  if ! "$PY" -m venv "$VENV"; then
    # Debian/Ubuntu without python3-venv: virtualenv from PyPI does the same job.
    rm -rf "$VENV"
    "$PY" -m pip install -q --user virtualenv
    "$PY" -m virtualenv -q "$VENV"
  fi
  "$VENV"/bin/python -m pip install -q -U pip setuptools wheel ninja
fi

stamp="$VENV/.mbs_ext-build"
mode="${MBS_EXT_CUDA:-auto}"
[ "$mode" = 1 ] && mode=auto  # same build as auto-detect, only stricter
want="$( (echo "$TORCH_REQ $mode"; cat setup.py pyproject.toml; find csrc -type f | sort | xargs cat) | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && ls mbs_ext/_C*.so > /dev/null 2>&1; then
  echo "[setup] .venv is up to date"
  exit 0
fi

echo "[setup] installing $TORCH_REQ"
"$VENV"/bin/python -m pip install -q "$TORCH_REQ"
echo "[setup] building mbs_ext (CUDA kernels too when torch has CUDA and nvcc is found; a few minutes)"
"$VENV"/bin/python -m pip install -q --no-build-isolation -e ".[test,demo]"
"$VENV"/bin/python -m pip install -q "pytest-benchmark>=4" ruff
echo "$want" > "$stamp"
"$VENV"/bin/python -c "import mbs_ext; print('[setup] mbs_ext', mbs_ext.build_info())"
