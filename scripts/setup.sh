#!/usr/bin/env bash
# Sets up .venv with torch and mbs_ext (extension built in place, editable), fitted to the
# machine: without a GPU the CPU build of torch==2.13.0 and a CPU-only extension (about 1.2 GB by du,
# about 3 minutes on 2 cores); with a GPU (or when asked) torch==2.14.1, the CUDA 13 build, and the CUDA
# kernels (about 6 GB). It says which it chose and why; a later run given no MBS_* choice keeps
# what the venv has. Idempotent: a second run with unchanged sources does nothing.
#   MBS_EXT_CUDA=0|1  force a CPU-only extension / require the CUDA kernels (1 also picks the CUDA torch)
#   MBS_TORCH=...     torch requirement (then the CUDA kernels build when that torch has CUDA and nvcc is found)
#   MBS_VENV=dir      the virtual environment to set up (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV="${MBS_VENV:-.venv}"
CPU_TORCH="torch==2.13.0"
CUDA_TORCH="torch==2.14.1"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
# pip compiles every installed .py to bytecode (torch, transformers: tens of thousands of files,
# most never imported); without it a fresh set-up is about a minute shorter, and Python compiles
# what it imports on first use.
NO_PYC=--no-compile

# A GPU is one the NVIDIA driver lists: a CUDA toolkit or an nvidia-smi without a device is no GPU.
gpu_listed() { command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L 2> /dev/null | grep -q '^GPU '; }

choice="$VENV/.mbs_ext-choice"  # what the set-up of $VENV chose: a later run given nothing keeps it
if [ -z "${MBS_TORCH:-}${MBS_EXT_CUDA:-}" ] && [ -f "$choice" ]; then
  read -r TORCH_REQ chosen_cuda < "$choice"
  [ "$chosen_cuda" = auto ] || export MBS_EXT_CUDA="$chosen_cuda"
  why="as $VENV was set up before (MBS_TORCH or MBS_EXT_CUDA chooses again)"
elif [ -n "${MBS_TORCH:-}" ]; then
  TORCH_REQ="$MBS_TORCH" why="MBS_TORCH names it"
elif [ "${MBS_EXT_CUDA:-}" = 1 ]; then
  TORCH_REQ="$CUDA_TORCH" why="MBS_EXT_CUDA=1 asks for the CUDA kernels"
elif gpu_listed; then
  TORCH_REQ="$CUDA_TORCH" why="nvidia-smi lists a GPU ($(nvidia-smi -L | head -n 1 | cut -c1-60))"
else
  TORCH_REQ="$CPU_TORCH" why="no GPU found (no nvidia-smi listing one); MBS_EXT_CUDA=1 picks the CUDA build"
  export MBS_EXT_CUDA="${MBS_EXT_CUDA:-0}"
fi
case "${MBS_EXT_CUDA:-auto}" in
  0) kernels="a CPU-only extension" ;;
  1) kernels="the CUDA kernels (a missing CUDA toolkit is an error)" ;;
  *) kernels="the CUDA kernels too when torch has CUDA and nvcc is found" ;;
esac

# A step of minutes: pip shows what it fetches and installs, and this line every 20 s shows it
# still runs (downloads and the compiler print nothing for minutes when not on a terminal).
long() {
  local label="$1" start=$SECONDS rc=0 ticker
  shift
  (while sleep 20 > /dev/null 2>&1; do echo "[setup]   ... $label: $((SECONDS - start)) s"; done) &
  ticker=$!
  "$@" || rc=$?
  kill "$ticker" 2> /dev/null || true
  wait "$ticker" 2> /dev/null || true
  return "$rc"
}

if [ ! -x "$VENV"/bin/python ]; then
  echo "[setup] creating $VENV"
  if ! "$PY" -m venv "$VENV"; then
    # Debian/Ubuntu without python3-venv: virtualenv from PyPI does the same job.
    rm -rf "$VENV"
    "$PY" -m pip install -q --user virtualenv
    "$PY" -m virtualenv -q "$VENV"
  fi
  # A current pip first: it unpacks torch in a third of the time the pip of Python 3.11's venv takes.
  "$VENV"/bin/python -m pip install $NO_PYC -q -U pip "setuptools>=77" wheel ninja
fi

stamp="$VENV/.mbs_ext-build"
mode="${MBS_EXT_CUDA:-auto}"
[ "$mode" = 1 ] && mode=auto  # same build as auto-detect, only stricter
want="$( (echo "$TORCH_REQ $mode"; cat setup.py pyproject.toml; find csrc -type f | sort | xargs cat) | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && ls mbs_ext/_C*.so > /dev/null 2>&1; then
  echo "[setup] $VENV is up to date ($TORCH_REQ, $kernels)"
  exit 0
fi

echo "[setup] installing $TORCH_REQ with $kernels: $why"
# numpy with it: torch imported without it (as the build does) warns that NumPy failed to initialize.
long "installing $TORCH_REQ" "$VENV"/bin/python -m pip install $NO_PYC "$TORCH_REQ" numpy
# The wheel's own metadata says whether it brought CUDA libraries: importing torch here would
# compile its bytecode on the critical path (the build does that beside the requirements).
cuda_wheel='import importlib.metadata as m; print(any(r.startswith("nvidia") for r in m.requires("torch") or []))'
if [ "$TORCH_REQ" = "$CPU_TORCH" ] && [ "$("$VENV"/bin/python -c "$cuda_wheel")" = True ]; then
  echo "[setup] note: pip found no CPU-only $CPU_TORCH wheel and installed the one with CUDA libraries; for the" \
       "smaller CPU wheel, rerun with PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu"
fi

# The compiler keeps both cores busy for a minute or more while pip would wait for it: the test
# and demo requirements (the extras in pyproject.toml, read by the venv's Python) install beside it.
extras="$("$VENV"/bin/python - <<'PY'
try:
    import tomllib
except ImportError:  # Python 3.10: pip's own copy of the same parser
    from pip._vendor import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    extras = tomllib.load(f)["project"]["optional-dependencies"]
print("\n".join(dict.fromkeys(extras["test"] + extras["demo"])))
PY
)"
build_log="$VENV/.mbs_ext-build.log"
echo "[setup] building mbs_ext with $kernels (a minute or two: C++ against torch's headers; log: $build_log)," \
     "and beside it installing the test and demo requirements"
# setuptools' notice that an editable install may be shadowed by a folder named like the package:
# here that folder is the package itself.
# Its own process group (setsid), so that a set-up stopped early stops the compiler too.
PYTHONWARNINGS="ignore:Editable installation" \
  setsid "$VENV"/bin/python -m pip install $NO_PYC --no-build-isolation --no-deps -e . > "$build_log" 2>&1 &
builder=$!
trap '[ -z "$builder" ] || kill -- -"$builder" 2> /dev/null || true' EXIT
mapfile -t extra_reqs <<< "$extras"
if ! long "installing the test and demo requirements" \
    "$VENV"/bin/python -m pip install $NO_PYC "${extra_reqs[@]}" "pytest-benchmark>=4" ruff; then
  wait "$builder" || true
  exit 1
fi
if ! long "building mbs_ext" wait "$builder"; then
  builder=
  tail -n 40 "$build_log"
  echo "[setup] building mbs_ext failed: the whole log is $build_log" >&2
  exit 1
fi
builder=
echo "$want" > "$stamp"
echo "$TORCH_REQ ${MBS_EXT_CUDA:-auto}" > "$choice"
"$VENV"/bin/python -c "import mbs_ext; print('[setup] mbs_ext', mbs_ext.build_info())"
