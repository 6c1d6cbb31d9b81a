#!/usr/bin/env bash
# One command for a GPU machine with torch and nvcc preinstalled and no network:
# build the extension in place for the local GPU, run the whole test suite, then the GPU
# studies and the GPU Table 4 (when torchvision is installed), writing everything to
# ${OUT:-bench/results/gpu}.
#
#   bash scripts/gpu_check.sh              # results in bench/results/gpu/
#   OUT=/some/dir bash scripts/gpu_check.sh
#
# Keeps going after a failing part, prints a summary, exits non-zero if any part failed.
# Each part has its own time limit; GPU_CHECK_TABLE=0 skips the (longest) Table 4 part.
# GPU_CHECK_ONLY="tests bench_accumulate_gpu" runs only the named parts (the build always
# runs): parts are cpp_errors, tests, bench_accumulate_gpu, bench_step_gpu,
# bench_cached_loss_gpu, bench_tokens_gpu, bench_ring_gpu, bench_soak_gpu, bench_planner,
# table_gpu. Where one command may run 10 minutes at most, split the
# parts over several calls (a split for the device tool below).
# GPU_CHECK_TAR=FILE also packs everything written to $OUT into one gzipped tar at the end,
# for a runner that brings back only a few files.
#
# GPU_CHECK_DEADLINE_S=N: no part starts after N seconds, and a part's limit is cut to what is
# left, so one call never runs past a lease's limit (parts run most important first).
# GPU_CHECK_JOBS=N runs the tests on N pytest-xdist workers; every test that fails there is
# then run again alone (part tests_alone), which tells a real failure from two tests meeting
# on one GPU.
#
# With the device tool (15 minutes of device time a task, the machine's start included; 10 a
# call; 8 files back), one call, as much as fits in 540 s:
#   R=$OUT; OUT=/tmp/gc GPU_CHECK_TAR=$R/gpu_check.tgz GPU_CHECK_DEADLINE_S=540 GPU_CHECK_JOBS=8 \
#     GPU_CHECK_TABLE=0 MBS_BENCH_ROUNDS=5 bash scripts/gpu_check.sh
# then, on the still-warm machine (the build is kept), GPU_CHECK_ONLY= the parts that did not run.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
PY="${PYTHON:-python3}"
OUT="${OUT:-$ROOT/bench/results/gpu}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export MBS_BENCH_OUT="$OUT" PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
declare -a SUMMARY=()
FAILED=0

wanted() {  # wanted NAME: whether GPU_CHECK_ONLY (default: every part) selects NAME
  [ "$1" = tests_alone ] && set -- tests  # goes with the tests
  [ -z "${GPU_CHECK_ONLY:-}" ] || [ "$1" = build ] || [[ " $GPU_CHECK_ONLY " == *" $1 "* ]]
}

not_run() {  # not_run NAME WHY: record a part that did not run, and why
  SUMMARY+=("$(printf '%-22s %s' "$1" "$2")")
}

part() {  # part NAME LIMIT_S COMMAND...: run one part, log it, record how it went
  local name="$1" limit="$2"; shift 2
  if ! wanted "$name"; then
    not_run "$name" "not selected (GPU_CHECK_ONLY)"
    return 0
  fi
  if [ -n "${GPU_CHECK_DEADLINE_S:-}" ]; then
    local left=$((GPU_CHECK_DEADLINE_S - SECONDS))
    if [ "$left" -lt 30 ]; then
      not_run "$name" "not run: ${left}s left before GPU_CHECK_DEADLINE_S"
      return 0
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  printf '\n=== %s (limit %ss) ===\n' "$name" "$limit"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  local verdict="ok"
  [ "$rc" -eq 0 ] || { verdict="FAILED (exit $rc)"; FAILED=1; }
  [ "$rc" -eq 124 ] && verdict="TIMED OUT after ${limit}s"
  SUMMARY+=("$(printf '%-22s %-24s %4ss' "$name" "$verdict" "$((SECONDS - t0))")")
}

{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || echo "nvidia-smi: not found"
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available() and torch.cuda.get_device_name())'
  nvcc --version 2>&1 | tail -n 1
  git rev-parse HEAD 2>/dev/null || true
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: torch sees no CUDA device here; nothing to check" >&2
  exit 2
fi
ARCH="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"

# GPU_CHECK_BUILD=0: the extension is already built here (scripts/gpu_lease.sh runs parts side by
# side after one build; two builds at once would share one build folder).
if [ "${GPU_CHECK_BUILD:-1}" = 1 ]; then
  part build 180 env TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="$(nproc)" MBS_EXT_CUDA=1 \
    "$PY" setup.py build_ext --inplace
fi
"$PY" -c 'import json, mbs_ext; print(json.dumps(mbs_ext.build_info()))' >> "$OUT/env.txt" 2>&1

# torch 2.11 on the GPU machine: a fault message made inside the extension killed the
# process; scripts/gpu_diag.sh builds with two compilers and runs the cases against both.
part cpp_errors 240 env OUT="$OUT/diag" bash scripts/gpu_diag.sh

if [ -n "${GPU_CHECK_JOBS:-}" ]; then
  # -v: each result is named as it comes, so a run cut off by its limit still names its failures.
  part tests 300 "$PY" -m pytest -v -p no:cacheprovider -rfEs -n "$GPU_CHECK_JOBS" --durations=25 \
    --junitxml="$OUT/tests.xml" tests
  # Each test that failed among the workers, again alone in one process.
  failed_ids() { grep -E "^(FAILED|ERROR) tests/" "$OUT/tests.log" | sed -E 's/^(FAILED|ERROR) //; s/ - .*$//' | sort -u; }
  if wanted tests && [ -f "$OUT/tests.log" ] && [ -n "$(failed_ids)" ]; then
    mapfile -t AGAIN < <(failed_ids)
    part tests_alone 120 "$PY" -m pytest -q -p no:cacheprovider -rfEs "${AGAIN[@]}"
  fi
else
  part tests 300 "$PY" -m pytest -v -p no:cacheprovider -rfEs --junitxml="$OUT/tests.xml" tests
fi
for study in bench_accumulate_gpu bench_step_gpu bench_cached_loss_gpu bench_tokens_gpu bench_ring_gpu \
  bench_soak_gpu; do
  [ -f "bench/$study.py" ] && part "$study" 100 "$PY" -m pytest -q -s -p no:cacheprovider "bench/$study.py"
done
# The planner study's CUDA rows (the CPU rows are committed from CPU runs): one fresh child
# per model and budget plans, then steps at the planned size; real/budget is
# torch.cuda.max_memory_allocated over the allocation before the step, reserved/budget
# the rise of max_memory_reserved (the caching allocator's footprint).
# The children share the GPU, as many at once as the tests' workers.
[ -f bench/bench_planner.py ] && part bench_planner 420 \
  env MBS_PLANNER_DEVICES=cuda MBS_PLANNER_JOBS="${GPU_CHECK_JOBS:-1}" \
  "$PY" -m pytest -q -s -p no:cacheprovider bench/bench_planner.py
if ! wanted table_gpu; then
  not_run table_gpu "not selected (GPU_CHECK_ONLY)"
elif [ "${GPU_CHECK_TABLE:-1}" != 1 ]; then
  not_run table_gpu "skipped (GPU_CHECK_TABLE=0)"
elif "$PY" -c 'import torchvision' > /dev/null 2>&1; then
  part table_gpu 240 "$PY" -m mbs_ext table --device cuda --model resnet50 --cap-gib 4 --rounds 1 --out "$OUT/table"
else
  not_run table_gpu "skipped (no torchvision)"
fi

printf '\n=== summary (results in %s) ===\n' "$OUT"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
if [ -n "${GPU_CHECK_TAR:-}" ]; then
  tar -czf "$GPU_CHECK_TAR" -C "$OUT" . && echo "packed into $GPU_CHECK_TAR" || FAILED=1
fi
exit "$FAILED"
