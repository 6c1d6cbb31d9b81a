// A small multi-tensor launcher: one kernel launch covers many tensors, with all
// the metadata a block needs passed BY VALUE as a kernel argument.
//
// Why by value: a kernel argument is copied by the launch itself, so there is no
// per-call host->device copy, no pinned staging buffer, no host synchronization,
// and CUDA graph capture records the values with the launch. The price is the
// 4 KB limit on kernel arguments: a list with more tensors or chunks than one
// argument block holds is split into as many launches as needed (all on one stream).
//
// Each launch's metadata holds, for up to MaxTensors tensors, Depth pointers (e.g.
// accumulator and grad) and the element count, plus a map from each block of the
// grid to (tensor slot, chunk index). Block b processes elements
// [chunk * chunk_size, min((chunk + 1) * chunk_size, numel)) of its tensor. A
// tensor whose chunks do not fit in the rest of a launch continues in the next one,
// where it occupies slot 0 again with the same base pointer: chunk indices are
// always relative to the tensor's start, so its alignment never changes.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <vector>

namespace mbs::cuda {

// Kernel arguments may total 4096 bytes; keep a margin for the op's own fields.
constexpr size_t kMaxMetaBytes = 3840;

template <int Depth, int MaxTensors, int MaxBlocks>
struct TensorListMeta {
  static constexpr int kDepth = Depth;
  static constexpr int kMaxTensors = MaxTensors;
  static constexpr int kMaxBlocks = MaxBlocks;
  // A block's entry: tensor slot in the low 8 bits, chunk index in the high 24.
  static constexpr int kSlotBits = 8;
  static constexpr int64_t kMaxChunksPerTensor = int64_t{1} << (32 - kSlotBits);

  void* addresses[Depth][MaxTensors];
  int64_t numel[MaxTensors];
  uint32_t block_info[MaxBlocks];

  __device__ __forceinline__ int slot_of_block() const {
    return static_cast<int>(block_info[blockIdx.x] & ((1u << kSlotBits) - 1u));
  }
  __device__ __forceinline__ int64_t chunk_of_block() const {
    return static_cast<int64_t>(block_info[blockIdx.x] >> kSlotBits);
  }
};

// Two pointers per tensor (read-write, read): 96 tensors and 384 blocks per launch.
using PairListMeta = TensorListMeta<2, 96, 384>;

template <typename Meta, typename Op>
__global__ void __launch_bounds__(Op::kThreads) multi_tensor_kernel(const Meta meta, const Op op) {
  op(meta, meta.slot_of_block(), meta.chunk_of_block());
}

// Calls launch(meta, blocks) once per launch needed to cover every chunk of every
// tensor. addresses[i] are tensor i's Depth pointers, numels[i] its element count;
// empty tensors are skipped. Host-only bookkeeping: no device memory is touched.
template <typename Meta, typename Launch>
void for_each_launch(const std::vector<std::array<void*, Meta::kDepth>>& addresses,
                     const std::vector<int64_t>& numels, int64_t chunk_size, Launch&& launch) {
  static_assert(sizeof(Meta) <= kMaxMetaBytes, "multi-tensor metadata exceeds the kernel argument budget");
  static_assert(Meta::kMaxTensors <= (1 << Meta::kSlotBits), "tensor slot does not fit its bits");
  TORCH_CHECK(addresses.size() == numels.size(), "multi_tensor: ", addresses.size(), " address sets for ",
              numels.size(), " tensors");
  TORCH_CHECK(chunk_size > 0, "multi_tensor: chunk size must be positive");
  Meta meta{};
  int slots = 0;   // tensor slots used in this launch
  int blocks = 0;  // blocks mapped in this launch
  for (size_t i = 0; i < numels.size(); ++i) {
    const int64_t n = numels[i];
    TORCH_CHECK(n >= 0, "multi_tensor: negative element count");
    if (n == 0) continue;
    const int64_t chunks = (n + chunk_size - 1) / chunk_size;
    TORCH_CHECK(chunks <= Meta::kMaxChunksPerTensor, "multi_tensor: tensor of ", n,
                " elements has too many chunks");
    for (int d = 0; d < Meta::kDepth; ++d) meta.addresses[d][slots] = addresses[i][d];
    meta.numel[slots] = n;
    ++slots;
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      meta.block_info[blocks] = (static_cast<uint32_t>(chunk) << Meta::kSlotBits) | static_cast<uint32_t>(slots - 1);
      ++blocks;
      const bool last_chunk = chunk + 1 == chunks;
      const bool blocks_full = blocks == Meta::kMaxBlocks;
      const bool slots_full = slots == Meta::kMaxTensors;
      if (!blocks_full && !(slots_full && last_chunk)) continue;
      launch(static_cast<const Meta&>(meta), blocks);
      blocks = 0;
      if (last_chunk) {
        slots = 0;
      } else {  // the tensor goes on in the next launch, from slot 0
        for (int d = 0; d < Meta::kDepth; ++d) meta.addresses[d][0] = meta.addresses[d][slots - 1];
        meta.numel[0] = meta.numel[slots - 1];
        slots = 1;
      }
    }
  }
  if (blocks > 0) launch(static_cast<const Meta&>(meta), blocks);
}

// Runs op over every chunk of every tensor on `stream`; op is a trivially copyable
// functor with kThreads, kChunk and
//   __device__ void operator()(const Meta& meta, int slot, int64_t chunk) const.
// Every thread of a block calls op once (ops may use __syncthreads inside).
template <typename Meta, typename Op>
void multi_tensor_apply(const std::vector<std::array<void*, Meta::kDepth>>& addresses,
                        const std::vector<int64_t>& numels, const Op& op, cudaStream_t stream) {
  static_assert(sizeof(Meta) + sizeof(Op) <= 4096, "kernel arguments exceed 4 KB");
  for_each_launch<Meta>(addresses, numels, Op::kChunk, [&](const Meta& meta, int blocks) {
    multi_tensor_kernel<Meta, Op><<<static_cast<unsigned>(blocks), Op::kThreads, 0, stream>>>(meta, op);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace mbs::cuda
