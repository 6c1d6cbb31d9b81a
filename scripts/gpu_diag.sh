#!/usr/bin/env bash
# Diagnosis on a GPU machine with torch and nvcc preinstalled (results under ${OUT:-/tmp/gpu_diag};
# a short table last). Three questions, each within its own time limit:
#  1. torch 2.11 there: a fault message made inside the extension killed the process. Which
#     compiler builds the extension, which C++ runtime the process loads, and whether the crash
#     follows the compiler: the extension is built twice, by the compiler torch's build picks
#     (build A) and by the system's g++ (build B), and each case runs against both, with a
#     native backtrace (gdb, else cuda-gdb) of the first crash.
#  2. What holds CUDA memory after an "auto" step: the allocator's own record of where each
#     block still allocated was made (torch.cuda.memory._record_memory_history).
#  3. Tests named in DIAG_TESTS, against build B when it does not crash, else build A.
set -uo pipefail
cd "$(dirname "$0")/.."
SRC="$(pwd)"
OUT="${OUT:-/tmp/gpu_diag}"; mkdir -p "$OUT"
PY="${PYTHON:-python3}"
ARCH="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"
DBG="$(command -v gdb || command -v cuda-gdb || true)"
SYS_CXX=/usr/bin/g++

copy_tree() {  # copy_tree DIR: the sources, without build outputs
  rm -rf "$1"; mkdir -p "$1"
  tar cf - --exclude=./build --exclude='*.so' --exclude=./.git . | tar xf - -C "$1"
}
build() {  # build DIR [CC CXX]: the extension in place in DIR, by the given compilers
  local dir="$1"
  copy_tree "$dir"
  (cd "$dir" && if [ $# -ge 3 ]; then export CC="$2" CXX="$3"; fi
   TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS=8 MBS_EXT_CUDA=1 timeout 150 "$PY" setup.py build_ext --inplace) \
    > "$OUT/build_$(basename "$dir").log" 2>&1
}

{
  echo "== toolchain"
  echo "CC=${CC:-} CXX=${CXX:-}"; which -a g++ gcc c++ 2>&1
  for c in /opt/gcc/bin/g++ "$SYS_CXX"; do
    [ -x "$c" ] || { echo "$c: none"; continue; }
    echo "-- $c: $("$c" --version | head -1)"
    "$c" -v 2>&1 | grep -o -- "--with-default-libstdcxx-abi=[a-z0-9-]*\|--enable-libstdcxx[a-z-]*" | sort -u
    echo | "$c" -dM -E -x c++ -include string - | grep -E "_GLIBCXX_USE_CXX11_ABI|__GLIBCXX__ " 
    echo "libstdc++: $("$c" -print-file-name=libstdc++.so.6)"
  done
  "$PY" - <<'PY'
import sysconfig, torch
print("torch", torch.__version__, "cxx11 abi", torch._C._GLIBCXX_USE_CXX11_ABI, "sysconfig CC/CXX",
      sysconfig.get_config_var("CC"), "/", sysconfig.get_config_var("CXX"))
print(torch.__config__.show().splitlines()[1:4])
PY
} > "$OUT/toolchain.txt" 2>&1

build /root/diag_a &
pid_a=$!
if [ -x "$SYS_CXX" ]; then build /root/diag_b /usr/bin/gcc "$SYS_CXX" & pid_b=$!; fi
wait "$pid_a"; echo "build A exit $?" >> "$OUT/toolchain.txt"
[ -n "${pid_b:-}" ] && { wait "$pid_b"; echo "build B exit $?" >> "$OUT/toolchain.txt"; }
grep -m1 -o "^[^ ]*g++ " "$OUT/build_diag_a.log" | head -1 | sed 's/^/build A compiler: /' >> "$OUT/toolchain.txt"
grep -m1 -o "^[^ ]*g++ \|^\[1/[0-9]*\] [^ ]*" "$OUT/build_diag_b.log" 2>/dev/null | head -2 | sed 's/^/build B: /' >> "$OUT/toolchain.txt"

CASES=(
  'pair_fault|from mbs_ext._native import _C; print(_C._pair_fault([torch.zeros(2)], [], False))'
  'public_api|import mbs_ext; mbs_ext.scale_accumulate_([torch.zeros(2)], [], 1.0)'
  'op_throw|import mbs_ext; torch.ops.mbs_ext.scale_accumulate_([torch.zeros(2)], [], torch.tensor(1.0), torch.zeros(()))'
  'pybind_throw|from mbs_ext._native import _C; _C.split_sizes(10, 0)'
  'cstr_only|from mbs_ext._native import _C; print(_C._pair_fault([torch.zeros(2)], [torch.zeros(3)], False))'
)
declare -A CRASHED=()
for b in a b; do
  dir=/root/diag_$b; ls "$dir"/mbs_ext/_C*.so > /dev/null 2>&1 || continue
  {
    echo "== build $b: $(ldd "$dir"/mbs_ext/_C*.so | grep -E 'stdc\+\+|gcc_s' | tr -s ' \t' ' ')"
    for entry in "${CASES[@]}"; do
      name="${entry%%|*}"; code="import torch; ${entry#*|}"
      for vis in visible hidden; do
        if [ $vis = visible ]; then out="$(cd "$dir" && timeout 60 "$PY" -c "$code" 2>&1)"; rc=$?
        else out="$(cd "$dir" && CUDA_VISIBLE_DEVICES= timeout 60 "$PY" -c "$code" 2>&1)"; rc=$?; fi
        printf '%-13s GPU %-7s exit %-4s %s\n' "$name" "$vis" "$rc" "$(echo "$out" | tail -1 | cut -c1-150)"
        if [ "$rc" -ge 128 ] && [ "$rc" -ne 124 ]; then
          CRASHED[$b]=1
          if [ -n "$DBG" ] && [ -z "${TRACED:-}" ]; then
            TRACED=1
            echo "-- backtrace ($DBG), build $b, $name:"
            (cd "$dir" && timeout 90 "$DBG" -batch -ex run -ex bt -ex "info sharedlibrary" --args "$PY" -c "$code" 2>&1) \
              | grep -E "^#|SIG|libstdc|libgcc|_C\.cpython|libc10\.so|libtorch_python" | head -70
          fi
        fi
      done
    done
  } >> "$OUT/cpp_errors.txt" 2>&1
done

# 2. The "auto" step's leftovers (tests/test_step_cuda.py's out-of-memory child, "auto").
(cd /root/diag_a && timeout 120 "$PY" - > "$OUT/leak.txt" 2>&1) <<'PY'
import gc, sys
import torch
sys.path.insert(0, "tests")
import mbs_ext
from test_step_cuda import OOM_CAP, mse, oom_data, oom_model
batch = oom_data()
warm = oom_model().cuda()
mbs_ext.step(warm, torch.optim.SGD(warm.parameters(), lr=0.1), (batch[0][:8], batch[1][:8]), mse, micro_batch_size=4)
del warm
gc.collect()
base = torch.cuda.memory_allocated()
torch.cuda.memory._record_memory_history(max_entries=200000)
model = oom_model().cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
torch.cuda.set_per_process_memory_fraction(OOM_CAP / torch.cuda.get_device_properties(0).total_memory)
for mode in ("auto", "auto"):
    res = mbs_ext.step(model, opt, batch, mse, micro_batch_size=mode)
    print("step: micro_batch_size", res.micro_batch_size, "micro-batches", res.num_micro_batches)
del model, opt, res
gc.collect()
print("left allocated:", torch.cuda.memory_allocated() - base)
for o in gc.get_objects():
    try:
        if isinstance(o, torch.Tensor) and o.is_cuda:
            print("python-visible CUDA tensor", tuple(o.shape), o.dtype,
                  [type(r).__name__ for r in gc.get_referrers(o)][:8])
    except Exception:
        pass
snap = torch.cuda.memory._snapshot()
for seg in snap["segments"]:
    for blk in seg["blocks"]:
        if blk["state"] != "active_allocated":
            continue
        frames = [f"{f['filename'].split('/site-packages/')[-1]}:{f['line']} {f['name']}" for f in blk.get("frames", [])
                  if "mbs_ext" in f["filename"] or "test_" in f["filename"] or "<stdin>" in f["filename"]]
        print("block", blk["size"], "bytes; allocated at:", frames[:12] or "(no python frame)")
PY

# 3. Tests again.
use=a; [ -z "${CRASHED[b]:-}" ] && ls /root/diag_b/mbs_ext/_C*.so > /dev/null 2>&1 && use=b
echo "tests against build $use" > "$OUT/tests.txt"
if [ -n "${DIAG_TESTS:-}" ]; then
  # shellcheck disable=SC2086
  (cd /root/diag_$use && timeout "${DIAG_TESTS_LIMIT_S:-150}" "$PY" -m pytest -q -p no:cacheprovider -rfEs -n 8 $DIAG_TESTS) \
    >> "$OUT/tests.txt" 2>&1
  echo "exit $?" >> "$OUT/tests.txt"
fi

printf '\n=== toolchain\n'; cat "$OUT/toolchain.txt"
printf '\n=== C++ errors\n'; cat "$OUT/cpp_errors.txt" 2>/dev/null | head -60
printf '\n=== leak\n'; head -40 "$OUT/leak.txt"
printf '\n=== tests\n'; grep -E "^(FAILED|ERROR)|passed|failed|exit|against" "$OUT/tests.txt" | cut -c1-200 | tail -30
