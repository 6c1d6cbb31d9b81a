#!/usr/bin/env bash
# One call of the device tool (10 minutes a call, 15 a task with the machine's start): every
# part of scripts/gpu_check.sh, ordered so that nothing timed shares the GPU or the cores.
#   1. the build, then the timing studies, alone;
#   2. the whole test suite beside the planner study (each planner child reads its own
#      process's allocator, so its memory ratios hold beside the tests; its planning time
#      does not, and is not a target);
#   3. Table 4 (throughput) alone, in what is left.
# Everything lands in $OUT/gpu_check.tgz (the tool brings back few files) and each phase's
# summary is printed. On an H200 (2026-11-27) the build and the studies took 190 s and the
# planner 107 s, but the suite did not end in 271 s on 10 workers: in one 15-minute lease, give
# the suite a call of its own (GPU_CHECK_ONLY=tests GPU_CHECK_JOBS=14 bash scripts/gpu_check.sh)
# and this script, with LEASE_SUITE=0 (no suite in phase 2), the rest.
#   OUT=/some/dir LEASE_S=560 bash scripts/gpu_lease.sh
set -uo pipefail
cd "$(dirname "$0")/.."
DEST="${OUT:?OUT names where the tar goes}"
W=/tmp/gpu_lease
rm -rf "$W"
mkdir -p "$W"
LEASE_S="${LEASE_S:-560}"
left() { echo $((LEASE_S - SECONDS)); }
export MBS_BENCH_ROUNDS="${MBS_BENCH_ROUNDS:-5}" PYTHONUNBUFFERED=1

{
  for tool in readelf ldd g++ c++ nvcc; do echo "$tool: $(command -v "$tool" || echo none)"; done
  echo "CC=${CC:-} CXX=${CXX:-}"
} > "$W/toolchain.txt" 2>&1

echo "=== phase 1: build, timing studies ($(left)s left)"
OUT="$W/timing" GPU_CHECK_DEADLINE_S=$(($(left) - 320)) \
  GPU_CHECK_ONLY="bench_accumulate_gpu bench_step_gpu bench_cached_loss_gpu bench_tokens_gpu bench_ring_gpu bench_soak_gpu" \
  bash scripts/gpu_check.sh > "$W/timing.console" 2>&1
ldd mbs_ext/_C*.so >> "$W/toolchain.txt" 2>&1
cat "$W/timing/summary.txt"

echo "=== phase 2: the suite beside the planner study ($(left)s left)"
P2=$(($(left) - 70))
suite=
if [ "${LEASE_SUITE:-1}" = 1 ]; then
  OUT="$W/suite" GPU_CHECK_BUILD=0 GPU_CHECK_ONLY=tests GPU_CHECK_JOBS=10 GPU_CHECK_DEADLINE_S=$P2 \
    bash scripts/gpu_check.sh > "$W/suite.console" 2>&1 &
  suite=$!
fi
OUT="$W/planner" GPU_CHECK_BUILD=0 GPU_CHECK_ONLY=bench_planner GPU_CHECK_JOBS=4 GPU_CHECK_DEADLINE_S=$P2 \
  bash scripts/gpu_check.sh > "$W/planner.console" 2>&1
[ -z "$suite" ] || wait "$suite"
cat "$W/planner/summary.txt"
if [ -n "$suite" ]; then
  cat "$W/suite/summary.txt"
  grep -E "(FAILED|ERROR) |passed|failed" "$W/suite/tests.log" | tail -n 40
fi

echo "=== phase 3: Table 4 ($(left)s left)"
OUT="$W/table" GPU_CHECK_BUILD=0 GPU_CHECK_ONLY=table_gpu GPU_CHECK_DEADLINE_S=$(($(left) - 10)) \
  bash scripts/gpu_check.sh > "$W/table.console" 2>&1
cat "$W/table/summary.txt"

tar -czf "$DEST/gpu_check.tgz" -C "$W" . && echo "packed into $DEST/gpu_check.tgz ($(left)s left)"
