#!/usr/bin/env bash
# Diagnosis on a GPU machine: where a C++ exception thrown by the extension crashes (gdb
# backtraces), then the CUDA-only step tests. Results under ${OUT:-/tmp/gpu_diag}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_diag}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD"
ARCH="$(python3 -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"
TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="$(nproc)" MBS_EXT_CUDA=1 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
{
  g++ --version | head -1; python3 --version; python3 -c 'import sys; print(sys.version)'
  python3 -c 'import torch; print(torch.__version__, torch._C._GLIBCXX_USE_CXX11_ABI, torch.__config__.show())'
  ldd mbs_ext/_C*.so
  libstdcxx="$(ldd mbs_ext/_C*.so | awk '/libstdc\+\+/{print $3}')"
  echo "newest GLIBCXX in $libstdcxx: $(strings "$libstdcxx" | grep -E '^GLIBCXX_3\.4\.[0-9]+$' | sort -V | tail -1)"
} > "$OUT/env.txt" 2>&1
# torch 2.11 on the GPU machine: a c10::Error thrown here killed the process (torch 2.13/2.14,
# and torch 2.11 on a CPU machine with Python 3.11 or 3.12, raise normally). Each case runs
# with the GPU visible and hidden, to tell an initialized CUDA runtime from the toolchain.
for case in op ring; do
  if [ $case = op ]; then code='import torch, mbs_ext; torch.ops.mbs_ext.scale_accumulate_([torch.zeros(2)], [], torch.tensor(1.0), torch.zeros(()))'
  else code='import torch, mbs_ext; from mbs_ext._native import _C; print(_C.split_sizes(10, 0))'; fi
  timeout 60 python3 -X faulthandler -c "$code" > "$OUT/$case.txt" 2>&1; echo "rc=$?" >> "$OUT/$case.txt"
  CUDA_VISIBLE_DEVICES= timeout 60 python3 -X faulthandler -c "$code" > "$OUT/$case.nogpu.txt" 2>&1
  echo "rc=$?" >> "$OUT/$case.nogpu.txt"
  timeout 90 gdb -batch -ex run -ex bt -ex "info sharedlibrary" --args python3 -c "$code" > "$OUT/$case.gdb.txt" 2>&1
done
timeout 240 python3 -X faulthandler -m pytest -q -p no:cacheprovider -x tests/test_step_cuda.py tests/test_syncs.py \
  > "$OUT/step_cuda.txt" 2>&1; echo "rc=$?" >> "$OUT/step_cuda.txt"
tail -30 "$OUT/step_cuda.txt"; tail -3 "$OUT"/op*.txt "$OUT"/ring*.txt; grep -A25 "^#0" "$OUT/op.gdb.txt" | head -40
