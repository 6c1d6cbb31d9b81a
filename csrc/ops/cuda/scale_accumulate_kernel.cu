// CUDA kernel of mbs_ext::scale_accumulate_: acc[i] += scale * grad[i] over many
// tensors per launch (multi_tensor.cuh), one launch set per (accumulator dtype, grad
// dtype) pair present. Metadata travels as kernel arguments, scale and found_inf stay
// on the device: no host synchronization, no host staging memory, capturable in a
// CUDA graph. Runs on the current stream.
//
// Memory access: each thread moves up to 16 elements per loop step as independent
// 16-byte vector loads of both operands (4 fp32, 8 bf16/fp16 or 2 fp64 lanes per 16 bytes;
// the narrower dtype sets the lane count, the wider one takes several 16-byte loads),
// issued before any arithmetic so that they are all in flight together. The vector
// path runs from the first element at which both tensors are 16-byte aligned; the
// elements before it, the tail after the last whole vector, and tensors whose two
// pointers can never be aligned together take a scalar path with the same ILP.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <array>
#include <string>
#include <type_traits>
#include <vector>

#include "ops/cuda/multi_tensor.cuh"
#include "ops/scale_accumulate.h"

namespace mbs {
namespace {

using cuda::PairListMeta;

template <typename T, typename C> __device__ __forceinline__ C to_compute(T v) { return static_cast<C>(v); }
template <> __device__ __forceinline__ float to_compute<__nv_bfloat16, float>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <> __device__ __forceinline__ float to_compute<__half, float>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ double to_compute<__nv_bfloat16, double>(__nv_bfloat16 v) {
  return static_cast<double>(__bfloat162float(v));
}
template <> __device__ __forceinline__ double to_compute<__half, double>(__half v) {
  return static_cast<double>(__half2float(v));
}

template <typename T, typename C> __device__ __forceinline__ T from_compute(C v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_compute<__nv_bfloat16, float>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_compute<__half, float>(float v) { return __float2half_rn(v); }

// inf or NaN: an all-ones exponent (a bit test, immune to any math-flag folding).
__device__ __forceinline__ bool non_finite(float v) {
  return (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
}
__device__ __forceinline__ bool non_finite(double v) {
  return (static_cast<unsigned long long>(__double_as_longlong(v)) & 0x7ff0000000000000ull) ==
         0x7ff0000000000000ull;
}

__device__ __forceinline__ float fused_multiply_add(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double fused_multiply_add(double a, double b, double c) { return __fma_rn(a, b, c); }

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// L elements of T, a whole number of 16-byte words, loaded and stored as such.
template <typename T, int L> struct alignas(16) Vec {
  static_assert((sizeof(T) * L) % 16 == 0, "a vector must be whole 16-byte words");
  T v[L];
};

template <typename A, typename G> struct ScaleAccumulateOp {
  // float64 math only for float64 accumulators, as on the CPU.
  using C = std::conditional_t<std::is_same_v<A, double>, double, float>;

  static constexpr int kThreads = 512;
  static constexpr int kLanes = 16 / static_cast<int>(sizeof(A) < sizeof(G) ? sizeof(A) : sizeof(G));
  // Vectors per thread per loop step, all loaded before any is used: 4 x 16 bytes
  // of the narrower operand (16 elements; 8 for fp64/fp64), as many of the wider.
  static constexpr int kVecsPerThread = kLanes >= 4 ? 16 / kLanes : 4;
  static constexpr int kScalarsPerThread = 8;  // same idea on the scalar path
  static constexpr int64_t kChunk = 65536;     // elements per block
  static_assert(kVecsPerThread >= 1, "at least one vector per thread");
  static_assert(kChunk % kLanes == 0, "chunks must start on a vector boundary");
  static_assert(16 % sizeof(A) == 0 && 16 % sizeof(G) == 0, "element sizes must divide 16");

  const void* scale_ptr;  // device scale (float or double), or null: use scale_value
  C scale_value;
  float* found_inf;
  bool scale_is_double;

  __device__ __forceinline__ C load_scale() const {
    if (scale_ptr == nullptr) return scale_value;
    return scale_is_double ? static_cast<C>(*static_cast<const double*>(scale_ptr))
                           : static_cast<C>(*static_cast<const float*>(scale_ptr));
  }

  // acc <- acc + s * g in C; flags a non-finite g (checked after conversion to C,
  // like the CPU kernel, so a float64 grad too large for float32 counts as inf).
  __device__ __forceinline__ static A update(A a, G g, C s, bool& bad) {
    const C gc = to_compute<G, C>(g);
    bad |= non_finite(gc);
    return from_compute<A, C>(fused_multiply_add(s, gc, to_compute<A, C>(a)));
  }

  // Smallest h in [0, kLanes) such that acc + h and grad + h are both 16-byte
  // aligned, or -1 when no such h exists (the offsets disagree modulo 16 bytes).
  __device__ __forceinline__ static int vector_head(const A* acc, const G* grad) {
    const auto a = reinterpret_cast<uintptr_t>(acc);
    const auto g = reinterpret_cast<uintptr_t>(grad);
    if (a % sizeof(A) != 0 || g % sizeof(G) != 0) return -1;  // the host rejects this; stay safe anyway
    constexpr int ma = 16 / static_cast<int>(sizeof(A));      // alignment period of acc, in elements
    constexpr int mg = 16 / static_cast<int>(sizeof(G));
    const int ha = static_cast<int>((16 - a % 16) % 16 / sizeof(A));  // in [0, ma)
    const int hg = static_cast<int>((16 - g % 16) % 16 / sizeof(G));  // in [0, mg)
    // ma and mg are powers of two; the longer period (= kLanes) decides, the
    // shorter one must agree with it.
    if (ma >= mg) return (ha % mg == hg) ? ha : -1;
    return (hg % ma == ha) ? hg : -1;
  }

  // Elements [0, n) of acc/grad one at a time, kScalarsPerThread independent
  // loads of each operand per thread per step. n <= kChunk, so offsets fit an int.
  __device__ __forceinline__ static void scalar_range(A* __restrict__ acc, const G* __restrict__ grad, int n, C s,
                                                      bool& bad) {
    for (int base = 0; base < n; base += kThreads * kScalarsPerThread) {
      A a[kScalarsPerThread];
      G g[kScalarsPerThread];
#pragma unroll
      for (int k = 0; k < kScalarsPerThread; ++k) {
        const int i = base + static_cast<int>(threadIdx.x) + k * kThreads;
        if (i < n) {
          a[k] = acc[i];
          g[k] = grad[i];
        }
      }
#pragma unroll
      for (int k = 0; k < kScalarsPerThread; ++k) {
        const int i = base + static_cast<int>(threadIdx.x) + k * kThreads;
        if (i < n) acc[i] = update(a[k], g[k], s, bad);
      }
    }
  }

  // The few (< kLanes) elements [0, n) before or after the vectors.
  __device__ __forceinline__ static void scalar_few(A* acc, const G* grad, int n, C s, bool& bad) {
    const int i = static_cast<int>(threadIdx.x);
    if (i < n) acc[i] = update(acc[i], grad[i], s, bad);
  }

  // n_vec vectors of kLanes elements from acc/grad, both 16-byte aligned;
  // n_vec <= kChunk / kLanes.
  __device__ __forceinline__ static void vector_range(A* __restrict__ acc, const G* __restrict__ grad, int n_vec, C s,
                                                      bool& bad) {
    using VA = Vec<A, kLanes>;
    using VG = Vec<G, kLanes>;
    VA* __restrict__ av = reinterpret_cast<VA*>(acc);
    const VG* __restrict__ gv = reinterpret_cast<const VG*>(grad);
    for (int base = 0; base < n_vec; base += kThreads * kVecsPerThread) {
      VA a[kVecsPerThread];
      VG g[kVecsPerThread];
#pragma unroll
      for (int k = 0; k < kVecsPerThread; ++k) {
        const int v = base + static_cast<int>(threadIdx.x) + k * kThreads;
        if (v < n_vec) {
          a[k] = av[v];
          g[k] = gv[v];
        }
      }
#pragma unroll
      for (int k = 0; k < kVecsPerThread; ++k) {
        const int v = base + static_cast<int>(threadIdx.x) + k * kThreads;
        if (v < n_vec) {
#pragma unroll
          for (int l = 0; l < kLanes; ++l) a[k].v[l] = update(a[k].v[l], g[k].v[l], s, bad);
          av[v] = a[k];
        }
      }
    }
  }

  // One chunk of one tensor. Every thread of the block runs this to the end (the
  // found_inf reduction below is a block-wide barrier).
  template <typename Meta>
  __device__ __forceinline__ void operator()(const Meta& meta, int slot, int64_t chunk) const {
    A* acc = static_cast<A*>(meta.addresses[0][slot]);
    const G* grad = static_cast<const G*>(meta.addresses[1][slot]);
    const int64_t n = meta.numel[slot];
    const int64_t begin = chunk * kChunk;          // < n by construction
    const int64_t end = min64(begin + kChunk, n);
    const bool last_chunk = begin + kChunk >= n;
    const C s = load_scale();
    bool bad = false;

    const int head = vector_head(acc, grad);
    if (head < 0) {
      scalar_range(acc + begin, grad + begin, static_cast<int>(end - begin), s, bad);
    } else {
      // Vectors start at h, h + kLanes, ...; chunk c owns the vectors that start in
      // [c * kChunk + h, (c + 1) * kChunk + h). Chunk 0 also does the head [0, h),
      // the last chunk the tail [vec_end, n). Each element is written exactly once.
      const int64_t h = min64(head, n);
      const int64_t vec_end = h + (n - h) / kLanes * kLanes;
      const int64_t v_lo = begin + h;
      const int64_t v_hi = min64(begin + kChunk + h, vec_end);
      if (chunk == 0) scalar_few(acc, grad, static_cast<int>(h), s, bad);
      if (v_lo < v_hi) vector_range(acc + v_lo, grad + v_lo, static_cast<int>((v_hi - v_lo) / kLanes), s, bad);
      if (last_chunk) scalar_few(acc + vec_end, grad + vec_end, static_cast<int>(n - vec_end), s, bad);
    }
    // Any thread that saw inf/NaN: one store of 1.0 per block (all writers store
    // the same value, so concurrent blocks do not race in any harmful way).
    if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.0f;
  }
};

template <typename T> struct CudaType { using type = T; };
template <> struct CudaType<at::BFloat16> { using type = __nv_bfloat16; };
template <> struct CudaType<at::Half> { using type = __half; };

struct ScaleArg {
  const void* ptr;  // device scale, or null
  double value;     // CPU scale
  bool is_double;
};

template <typename A, typename G>
void launch_group(const DensePairs& dense, const std::vector<size_t>& members, const ScaleArg& scale,
                  float* found_inf, cudaStream_t stream) {
  using Op = ScaleAccumulateOp<typename CudaType<A>::type, typename CudaType<G>::type>;
  std::vector<std::array<void*, 2>> addresses;
  std::vector<int64_t> numels;
  addresses.reserve(members.size());
  numels.reserve(members.size());
  for (const size_t i : members) {
    addresses.push_back({dense.acc(i).data_ptr(), const_cast<void*>(dense.grad(i).const_data_ptr())});
    numels.push_back(dense.acc(i).numel());
  }
  Op op{};
  op.scale_ptr = scale.ptr;
  op.scale_value = static_cast<typename Op::C>(scale.value);
  op.found_inf = found_inf;
  op.scale_is_double = scale.is_double;
  cuda::multi_tensor_apply<PairListMeta>(addresses, numels, op, stream);
}

template <typename A>
void dispatch_grad(at::ScalarType grad_type, const DensePairs& dense, const std::vector<size_t>& members,
                   const ScaleArg& scale, float* found_inf, cudaStream_t stream) {
  switch (grad_type) {
    case at::kFloat: return launch_group<A, float>(dense, members, scale, found_inf, stream);
    case at::kDouble: return launch_group<A, double>(dense, members, scale, found_inf, stream);
    case at::kBFloat16: return launch_group<A, at::BFloat16>(dense, members, scale, found_inf, stream);
    case at::kHalf: return launch_group<A, at::Half>(dense, members, scale, found_inf, stream);
    default: TORCH_CHECK_TYPE(false, "scale_accumulate_: unsupported grad dtype ", grad_type);
  }
}

int dtype_slot(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kDouble: return 1;
    case at::kBFloat16: return 2;
    case at::kHalf: return 3;
    default: TORCH_CHECK_TYPE(false, "scale_accumulate_: unsupported dtype ", t);
  }
}
constexpr at::ScalarType kSlotDtype[4] = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf};

void scale_accumulate_cuda(at::TensorList accumulators, at::TensorList grads, const at::Tensor& scale,
                           const at::Tensor& found_inf) {
  // All checks (including that every tensor is a CUDA tensor on one device) run
  // before any pointer is taken.
  const c10::Device device =
      check_scale_accumulate_args(accumulators, grads, scale, found_inf, c10::DeviceType::CUDA);
  TORCH_CHECK_VALUE(device.is_cuda() && found_inf.is_cuda(), "scale_accumulate_: the CUDA kernel needs CUDA tensors");
  if (accumulators.empty()) return;
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();

  ScaleArg scale_arg{nullptr, 0.0, false};
  if (scale.is_cpu()) {
    scale_arg.value = scale.item<double>();  // host memory: no device sync
  } else {
    scale_arg.ptr = scale.const_data_ptr();
    scale_arg.is_double = scale.scalar_type() == at::kDouble;
  }
  float* found_inf_ptr = found_inf.data_ptr<float>();

  DensePairs dense(accumulators, grads);
  std::vector<size_t> groups[4][4];  // [acc dtype][grad dtype] -> pair indices
  for (size_t i = 0; i < dense.size(); ++i) {
    TORCH_CHECK(dense.acc(i).is_cuda() && dense.grad(i).is_cuda(), "scale_accumulate_: pair ", i,
                " is not on the GPU");
    groups[dtype_slot(dense.acc(i).scalar_type())][dtype_slot(dense.grad(i).scalar_type())].push_back(i);
  }
  for (int a = 0; a < 4; ++a) {
    for (int g = 0; g < 4; ++g) {
      const std::vector<size_t>& members = groups[a][g];
      if (members.empty()) continue;
      switch (kSlotDtype[a]) {
        case at::kFloat: dispatch_grad<float>(kSlotDtype[g], dense, members, scale_arg, found_inf_ptr, stream); break;
        case at::kDouble: dispatch_grad<double>(kSlotDtype[g], dense, members, scale_arg, found_inf_ptr, stream); break;
        case at::kBFloat16:
          dispatch_grad<at::BFloat16>(kSlotDtype[g], dense, members, scale_arg, found_inf_ptr, stream);
          break;
        case at::kHalf: dispatch_grad<at::Half>(kSlotDtype[g], dense, members, scale_arg, found_inf_ptr, stream); break;
        default: TORCH_CHECK_TYPE(false, "scale_accumulate_: unsupported accumulator dtype ", kSlotDtype[a]);
      }
    }
  }
  dense.write_back();
}

}  // namespace

std::string compiled_cuda_archs() {
#ifdef __CUDA_ARCH_LIST__
#define MBS_STR2(...) #__VA_ARGS__
#define MBS_STR(...) MBS_STR2(__VA_ARGS__)
  return MBS_STR(__CUDA_ARCH_LIST__);
#else
  return "";
#endif
}

}  // namespace mbs

TORCH_LIBRARY_IMPL(mbs_ext, CUDA, m) { m.impl("scale_accumulate_", &mbs::scale_accumulate_cuda); }
