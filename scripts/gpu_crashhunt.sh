#!/usr/bin/env bash
# Runs the test suite, and whenever the interpreter dies (signal), names the test that was
# running, deselects it and goes on (up to 6 times). Prints failures and crashing tests.
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD"
OUT="${OUT:-/tmp/crashhunt}"; mkdir -p "$OUT"
[ -f mbs_ext/_C*.so ] 2>/dev/null || TORCH_CUDA_ARCH_LIST="$(python3 -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')" MAX_JOBS="$(nproc)" python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1
desel=()
for i in 1 2 3 4 5 6; do
  timeout 300 python3 -X faulthandler -m pytest -v -p no:cacheprovider -rf tests "${desel[@]}" > "$OUT/run$i.log" 2>&1
  rc=$?
  grep -E "FAILED|ERROR" "$OUT/run$i.log" | grep -v "^E " | tail -20
  if [ $rc -lt 128 ] && [ $rc -ne 124 ]; then tail -3 "$OUT/run$i.log"; break; fi
  last="$(grep -oE "^tests/[^ ]+::[^ ]+" "$OUT/run$i.log" | tail -1)"
  echo "CRASH rc=$rc in: $last"
  grep -A12 "Fatal Python error" "$OUT/run$i.log" | grep -E "Fatal|File \"/work" | head -8
  desel+=("--deselect" "$last")
done
