// CUDA kernel of mbs_ext::scale_accumulate_: a multi-tensor launch per
// (accumulator dtype, grad dtype) group. A chunk table maps each block to one
// chunk of one tensor; the table travels host->device through a pinned buffer on
// the current stream, so the op never synchronizes the host.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <map>
#include <string>

#include "ops/scale_accumulate.h"

namespace mbs {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 4;
constexpr int64_t kChunk = kThreads * kVec * 16;  // elements per block

struct TensorSlot {
  void* acc;
  const void* grad;
  int64_t numel;
  int aligned;  // both pointers allow kVec-wide loads
};

template <typename T, typename C> __device__ __forceinline__ C to_compute(T v) {
  return static_cast<C>(v);
}
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

template <typename T, typename C> __device__ __forceinline__ T from_compute(C v) {
  return static_cast<T>(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_compute<__nv_bfloat16, float>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_compute<__half, float>(float v) { return __float2half_rn(v); }

template <typename T, int N> struct alignas(sizeof(T) * N) Packet {
  T v[N];
};

template <typename A, typename G, typename C>
__global__ void scale_accumulate_kernel(const TensorSlot* __restrict__ slots,
                                        const int* __restrict__ block_slot,
                                        const int* __restrict__ block_chunk, const C* scale_ptr,
                                        C scale_value, float* __restrict__ found_inf) {
  const TensorSlot slot = slots[block_slot[blockIdx.x]];
  const int64_t begin = static_cast<int64_t>(block_chunk[blockIdx.x]) * kChunk;
  const int64_t end = min(begin + kChunk, slot.numel);
  A* acc = static_cast<A*>(slot.acc);
  const G* grad = static_cast<const G*>(slot.grad);
  const C s = scale_ptr ? *scale_ptr : scale_value;
  C poison = 0;
  if (slot.aligned) {
    // kChunk is a multiple of kVec, so every vector inside the chunk is aligned.
    const int64_t vec_end = begin + ((end - begin) / kVec) * kVec;
    for (int64_t i = begin + threadIdx.x * kVec; i < vec_end; i += kThreads * kVec) {
      Packet<A, kVec> a = *reinterpret_cast<const Packet<A, kVec>*>(acc + i);
      const Packet<G, kVec> g = *reinterpret_cast<const Packet<G, kVec>*>(grad + i);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const C gk = to_compute<G, C>(g.v[k]);
        poison += gk * C(0);
        a.v[k] = from_compute<A, C>(to_compute<A, C>(a.v[k]) + s * gk);
      }
      *reinterpret_cast<Packet<A, kVec>*>(acc + i) = a;
    }
    for (int64_t i = vec_end + threadIdx.x; i < end; i += kThreads) {
      const C gk = to_compute<G, C>(grad[i]);
      poison += gk * C(0);
      acc[i] = from_compute<A, C>(to_compute<A, C>(acc[i]) + s * gk);
    }
  } else {
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
      const C gk = to_compute<G, C>(grad[i]);
      poison += gk * C(0);
      acc[i] = from_compute<A, C>(to_compute<A, C>(acc[i]) + s * gk);
    }
  }
  if (poison != poison) *found_inf = 1.0f;  // every writer stores the same value
}

template <typename T> struct CudaType { using type = T; };
template <> struct CudaType<at::BFloat16> { using type = __nv_bfloat16; };
template <> struct CudaType<at::Half> { using type = __half; };

template <typename A, typename G>
void launch_group(const std::vector<std::pair<at::Tensor, at::Tensor>>& pairs, const at::Tensor& scale,
                  const at::Tensor& found_inf) {
  using CA = typename CudaType<A>::type;
  using CG = typename CudaType<G>::type;
  using C = std::conditional_t<std::is_same_v<A, double>, double, float>;

  std::vector<TensorSlot> slots;
  std::vector<int> block_slot, block_chunk;
  for (const auto& [acc, grad] : pairs) {
    const auto acc_addr = reinterpret_cast<uintptr_t>(acc.data_ptr());
    const auto grad_addr = reinterpret_cast<uintptr_t>(grad.const_data_ptr());
    const int aligned = (acc_addr % (sizeof(CA) * kVec) == 0) && (grad_addr % (sizeof(CG) * kVec) == 0);
    const int64_t chunks = (acc.numel() + kChunk - 1) / kChunk;
    TORCH_CHECK(chunks < (int64_t{1} << 31), "scale_accumulate_: tensor too large");
    for (int64_t c = 0; c < chunks; ++c) {
      block_slot.push_back(static_cast<int>(slots.size()));
      block_chunk.push_back(static_cast<int>(c));
    }
    slots.push_back({acc.data_ptr(), grad.const_data_ptr(), acc.numel(), aligned});
  }
  if (block_slot.empty()) return;

  // One pinned table: [slots][block_slot][block_chunk]; the caching host allocator
  // keeps the pinned block alive until the async copy has finished.
  const size_t slots_bytes = slots.size() * sizeof(TensorSlot);
  const size_t index_bytes = block_slot.size() * sizeof(int);
  const size_t total = slots_bytes + 2 * index_bytes;
  at::Tensor host = at::empty({static_cast<int64_t>(total)},
                              at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  auto* base = static_cast<char*>(host.data_ptr());
  std::memcpy(base, slots.data(), slots_bytes);
  std::memcpy(base + slots_bytes, block_slot.data(), index_bytes);
  std::memcpy(base + slots_bytes + index_bytes, block_chunk.data(), index_bytes);
  at::Tensor table = host.to(found_inf.device(), /*non_blocking=*/true);
  const char* dev = static_cast<const char*>(table.const_data_ptr());

  const C* scale_ptr = nullptr;
  C scale_value = 0;
  at::Tensor scale_dev;
  if (scale.device().is_cpu()) {
    scale_value = static_cast<C>(scale.item<double>());
  } else {
    scale_dev = scale.to(std::is_same_v<C, double> ? at::kDouble : at::kFloat);
    scale_ptr = scale_dev.const_data_ptr<C>();
  }
  const auto stream = c10::cuda::getCurrentCUDAStream();
  scale_accumulate_kernel<CA, CG, C><<<static_cast<unsigned>(block_slot.size()), kThreads, 0, stream>>>(
      reinterpret_cast<const TensorSlot*>(dev), reinterpret_cast<const int*>(dev + slots_bytes),
      reinterpret_cast<const int*>(dev + slots_bytes + index_bytes), scale_ptr, scale_value,
      found_inf.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename A>
void dispatch_grad(at::ScalarType grad_type, const std::vector<std::pair<at::Tensor, at::Tensor>>& pairs,
                   const at::Tensor& scale, const at::Tensor& found_inf) {
  switch (grad_type) {
    case at::kFloat: return launch_group<A, float>(pairs, scale, found_inf);
    case at::kDouble: return launch_group<A, double>(pairs, scale, found_inf);
    case at::kBFloat16: return launch_group<A, at::BFloat16>(pairs, scale, found_inf);
    case at::kHalf: return launch_group<A, at::Half>(pairs, scale, found_inf);
    default: TORCH_CHECK_TYPE(false, "scale_accumulate_: unsupported grad dtype ", grad_type);
  }
}

void scale_accumulate_cuda(at::TensorList accumulators, at::TensorList grads, const at::Tensor& scale,
                           const at::Tensor& found_inf) {
  const c10::Device device = check_scale_accumulate_args(accumulators, grads, scale, found_inf);
  if (accumulators.empty()) return;
  const c10::cuda::CUDAGuard guard(device);

  std::map<std::pair<int, int>, std::vector<std::pair<at::Tensor, at::Tensor>>> groups;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back;
  for (size_t i = 0; i < accumulators.size(); ++i) {
    at::Tensor acc = accumulators[i];
    if (acc.numel() == 0) continue;
    if (!acc.is_contiguous()) {
      at::Tensor dense = acc.contiguous();
      write_back.emplace_back(acc, dense);
      acc = dense;
    }
    groups[{static_cast<int>(acc.scalar_type()), static_cast<int>(grads[i].scalar_type())}].emplace_back(
        acc, grads[i].contiguous());
  }
  for (const auto& [key, pairs] : groups) {
    const auto acc_type = static_cast<at::ScalarType>(key.first);
    const auto grad_type = static_cast<at::ScalarType>(key.second);
    switch (acc_type) {
      case at::kFloat: dispatch_grad<float>(grad_type, pairs, scale, found_inf); break;
      case at::kDouble: dispatch_grad<double>(grad_type, pairs, scale, found_inf); break;
      case at::kBFloat16: dispatch_grad<at::BFloat16>(grad_type, pairs, scale, found_inf); break;
      case at::kHalf: dispatch_grad<at::Half>(grad_type, pairs, scale, found_inf); break;
      default: TORCH_CHECK_TYPE(false, "scale_accumulate_: unsupported accumulator dtype ", acc_type);
    }
  }
  for (auto& [target, dense] : write_back) target.copy_(dense);
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
