// The multi-tensor launcher: one kernel launch covers many tensors, with all the
// metadata a block needs passed by value as a kernel argument. The launch plan and
// the block -> (piece, chunk) lookup are plain C++ in accumulate/multi_tensor.h, tested
// by a host emulation; this header only adds the kernel and the launches.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "accumulate/multi_tensor.h"

namespace mbs::cuda {

// Kernel arguments may total 32,764 bytes on CUDA >= 12.1 with an R530+ driver and a
// Volta or newer GPU, 4,096 bytes otherwise. CUDA 13 runs only where all three hold
// (R580+, Turing+), so builds with it take the large limit at compile time, as
// torch's own foreach kernels do; older toolkits keep the small one.
#if defined(CUDART_VERSION) && CUDART_VERSION >= 13000
constexpr size_t kKernelArgBytes = 32764;
// Two pointers per piece (read-write, read), 24 bytes each: 1,344 pieces per launch.
using PairListMeta = accumulate::TensorListMeta<2, 1344>;
#else
constexpr size_t kKernelArgBytes = 4096;
using PairListMeta = accumulate::TensorListMeta<2, 168>;
#endif

// The sum of `value` over the block's Threads threads, valid in thread 0: a shuffle tree
// within each warp, the warps' sums through shared memory, then one warp's tree again.
template <int Threads> __device__ __forceinline__ double block_sum(double value) {
  static_assert(Threads % 32 == 0 && Threads / 32 <= 32, "whole warps, at most 32 of them");
  constexpr int kWarps = Threads / 32;
  __shared__ double warp_sums[kWarps];
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < kWarps ? warp_sums[lane] : 0.0;
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  }
  return value;
}

// Block b works on one chunk of one piece; every thread calls op once (the op loads,
// computes and stores its own elements only) and the block ORs the flags the threads
// return, so op.report_non_finite() runs at most once per block. An op with kSumSquares
// also hands back each thread's sum (Op::Sum); the block adds them in float64 and
// op.report_squares() runs once per block (one atomic add per block, not per thread).
template <typename Meta, typename Op>
__global__ void __launch_bounds__(Op::kThreads) multi_tensor_kernel(const Meta meta, const Op op) {
  const uint32_t block = blockIdx.x;
  const int slot = meta.slot_of(block);
  typename Op::Sum sum{};
  const bool flagged = op(meta, slot, meta.chunk_in_slot(slot, block), static_cast<int>(threadIdx.x), sum);
  if constexpr (Op::kSumSquares) {
    const double total = block_sum<Op::kThreads>(static_cast<double>(sum.value));
    if (threadIdx.x == 0) op.report_squares(total);
  }
  if (__syncthreads_or(flagged) && threadIdx.x == 0) op.report_non_finite();
}

// Runs op over every chunk of every tensor on `stream`. addresses[i] are tensor i's
// Depth pointers, numels[i] its element count, element_bytes[d] the element size
// behind pointer d. Op is a trivially copyable functor with kThreads, kChunk, kSumSquares,
// a thread's sum type Sum (with a `value` when kSumSquares),
//   bool operator()(const Meta&, int slot, uint32_t chunk, int thread, Sum&) const,
//   void report_non_finite() const and void report_squares(double) const.
template <typename Meta, typename Op>
void multi_tensor_apply(const std::vector<std::array<void*, Meta::kDepth>>& addresses,
                        const std::vector<int64_t>& numels, const std::array<int64_t, Meta::kDepth>& element_bytes,
                        const Op& op, cudaStream_t stream) {
  static_assert(sizeof(Meta) + sizeof(Op) <= kKernelArgBytes, "kernel arguments exceed the limit");
  accumulate::for_each_launch<Meta>(addresses, numels, element_bytes, Op::kChunk, [&](const Meta& meta, uint32_t blocks) {
    multi_tensor_kernel<Meta, Op><<<blocks, Op::kThreads, 0, stream>>>(meta, op);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace mbs::cuda
