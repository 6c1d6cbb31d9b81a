#!/usr/bin/env bash
# One call of the device tool for the memory headline and the CUDA suite (run 1), or the
# timing studies (run 2, PART=timing), on a GPU machine with torch, torchvision and nvcc
# preinstalled and no network. Everything lands in $OUT (a tar of the logs and results, and a
# summary printed last).
#
#   OUT=/some/dir LEASE_S=540 bash scripts/gpu_headline.sh              # run 1
#   OUT=/some/dir LEASE_S=200 PART=timing bash scripts/gpu_headline.sh  # run 2, same warm machine
#
# Run 1, most important first, each step cut to what is left of LEASE_S:
#   build (kept on a warm machine); the two capped back-off tests alone, -v; every CUDA test
#   (-k cuda) on 12 workers, beside it the memory-flat property on CUDA (bench/flat_memory.py:
#   torch.cuda.max_memory_allocated over a step of 8 and of 1,024 micro-batches, each case a fresh
#   process); then Table 4 on the GPU (ResNet-50 under a 4 GiB cap, TABLE_SWEEP multiples of the
#   largest full batch, one round, one timed step after a warm-up; TABLE_FULL_BATCH=44 skips the
#   search for the largest full batch, which took 215 s on an H100 in 2026-11-28's run).
# Run 2: the ring's overlap at balanced compute in three fresh processes, then the step study.
set -uo pipefail
cd "$(dirname "$0")/.."
DEST="${OUT:?OUT names where results go}"
W=/tmp/gpu_headline
mkdir -p "$W"
LEASE_S="${LEASE_S:-540}"
PART="${PART:-headline}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" MBS_BENCH_OUT="$W/bench"
left() { echo $((LEASE_S - SECONDS)); }
declare -a SUMMARY=()

step() {  # step NAME LIMIT_S COMMAND...: run with a limit cut to what is left, log to $W/NAME.log
  local name="$1" limit="$2"; shift 2
  local l; l=$(($(left) - 15))
  if [ "$l" -lt 20 ]; then SUMMARY+=("$(printf '%-16s not run (%ss left)' "$name" "$(left)")"); return 0; fi
  [ "$l" -lt "$limit" ] && limit=$l
  echo "=== $name (limit ${limit}s, $(left)s left)"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@" > "$W/$name.log" 2>&1
  local rc=$?
  tail -n 6 "$W/$name.log"
  SUMMARY+=("$(printf '%-16s exit %-4s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
}

flat_cuda() {  # every one-process case of bench/flat_memory.py at k=8 and k=1024, 4 at a time
  local jobs=()
  for c in hand_loop leak plain batchnorm device_counts tokens accumulate cached_loss; do
    for k in 8 1024; do jobs+=("$c $k"); done
  done
  printf '%s\n' "${jobs[@]}" | xargs -P 4 -L 1 sh -c 'python3 bench/flat_memory.py --case "$0" --k "$1" --device cuda' \
    > "$W/flat_cuda.jsonl"
  python3 - "$W/flat_cuda.jsonl" <<'EOF'
import json, sys
rows = {}
for line in open(sys.argv[1]):
    if line.startswith("{"):
        r = json.loads(line); rows.setdefault(r["case"], {})[r["k"]] = r
for case, by_k in rows.items():
    a, b = by_k.get(8), by_k.get(1024)
    if a and b:
        print(f"{case:14s} rise {a['rise_mib']:8.2f} MiB at k=8, {b['rise_mib']:8.2f} at k=1024: "
              f"{b['rise_mib'] - a['rise_mib']:+8.2f} MiB (kept {b['kept_mib']:+.2f})")
EOF
}

{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, torchvision; print("torch", torch.__version__, "cuda", torch.version.cuda, "torchvision", torchvision.__version__)'
  nvcc --version | tail -n 1
  nproc; free -g | head -2
} > "$W/env.txt" 2>&1
cat "$W/env.txt"

step build 240 env TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 MBS_EXT_CUDA=1 python3 setup.py build_ext --inplace
python3 -c 'import json, mbs_ext; print(json.dumps(mbs_ext.build_info()))' >> "$W/env.txt" 2>&1

if [ "$PART" = headline ]; then
  step backoff_two 90 python3 -m pytest -v -p no:cacheprovider -rfEs \
    "tests/test_step_cuda.py::test_out_of_memory_back_off_under_a_real_cap_stays_exact"
  flat_cuda > "$W/flat_cuda.log" 2>&1 &
  flat=$!
  step cuda_suite 200 python3 -m pytest -v -p no:cacheprovider -rfEs -n 12 -k cuda --durations=15 tests
  wait "$flat"
  SUMMARY+=("flat_cuda        done")
  cat "$W/flat_cuda.log"
  grep -E "^(FAILED|ERROR) |passed|failed" "$W/cuda_suite.log" | tail -n 20
  step table_gpu 400 python3 -m mbs_ext table --device cuda --model resnet50 --cap-gib 4 --rounds 1 --steps 1 \
    --sweep "${TABLE_SWEEP:-16,91,256}" --full-batch "${TABLE_FULL_BATCH:-0}" --out "$W/table"
else
  step ring_overlap 120 bash -c 'for i in 1 2 3; do python3 bench/ring_overlap_gpu.py; done' 
  cat "$W/ring_overlap.log"
  step bench_step_gpu 150 python3 -m pytest -q -s -p no:cacheprovider bench/bench_step_gpu.py
fi

printf '\n=== summary (%ss used)\n' "$SECONDS"
printf '%s\n' "${SUMMARY[@]}" | tee "$W/summary.txt"
tar -czf "$DEST/gpu_$PART.tgz" -C "$W" --exclude='*.so' . && echo "packed into $DEST/gpu_$PART.tgz"
