// The launch plan of the multi-tensor CUDA kernels, in plain C++: the same code
// runs on the device and in a host emulation (csrc/accumulate/tests/test_multi_tensor.cpp)
// that checks, under the sanitizers, that every element is handled exactly once.
//
// One launch covers up to MaxSlots tensor pieces. Its metadata travels BY VALUE as a
// kernel argument: no host->device copy, no staging memory, no host sync, and a CUDA
// graph records it with the launch. The price is the 4 KB argument limit, so a list
// with more pieces takes several launches on one stream.
//
// Each block handles one chunk of one piece, and the grid of a launch is the total
// chunk count. A block finds its piece by a binary search over the pieces' cumulative
// chunk counts, so no per-block table has to fit in the arguments. Chunks are small
// (4,096 elements) and blocks many, which lets the hardware scheduler balance the work
// over the SMs however unequal the tensors are. (A host-built block table of a few
// hundred 64K-element chunks per launch left SMs idle at the end of every launch.)
//
// A piece holds fewer than 2^32 elements, so counts fit 32 bits and more pieces fit a
// launch. A longer tensor is cut into pieces at multiples of max_piece elements, a
// multiple of 16: every piece keeps the tensor's alignment modulo 16 bytes.
#pragma once

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__CUDACC__)
#define MBS_HOST_DEVICE __host__ __device__ __forceinline__
#define MBS_UNROLL _Pragma("unroll")
#else
#define MBS_HOST_DEVICE inline
#define MBS_UNROLL
#endif

namespace mbs::accumulate {

// Elements per piece: 2^31, a multiple of every chunk size and of 16.
constexpr int64_t kMaxPieceElements = int64_t{1} << 31;

template <int Depth, int MaxSlots>
struct TensorListMeta {
  static constexpr int kDepth = Depth;
  static constexpr int kMaxSlots = MaxSlots;

  void* addresses[Depth][MaxSlots];  // each piece's Depth base pointers
  uint32_t numel[MaxSlots];          // each piece's element count (> 0)
  uint32_t chunk_end[MaxSlots];      // chunks in pieces [0, i], increasing
  int32_t slots;                     // pieces in this launch (>= 1)

  // The piece that block `block` (< chunk_end[slots - 1]) works on: the first slot
  // whose cumulative chunk count exceeds the block index. Every piece has at least
  // one chunk, so that slot is at most `block`: the first blocks search less.
  MBS_HOST_DEVICE int slot_of(uint32_t block) const {
    int lo = 0;
    int hi = block < static_cast<uint32_t>(slots - 1) ? static_cast<int>(block) : slots - 1;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (chunk_end[mid] > block) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    return lo;
  }

  // The index of block `block`'s chunk within its piece `slot`.
  MBS_HOST_DEVICE uint32_t chunk_in_slot(int slot, uint32_t block) const {
    return block - (slot == 0 ? 0u : chunk_end[slot - 1]);
  }
};

// Calls launch(meta, blocks) once per launch needed to cover every chunk of every
// tensor. addresses[i] are tensor i's Depth base pointers, numels[i] its element
// count (empty tensors are skipped), element_bytes[d] the element size behind
// pointer d. Host-only bookkeeping: no tensor memory is touched.
template <typename Meta, typename Launch>
void for_each_launch(const std::vector<std::array<void*, Meta::kDepth>>& addresses,
                     const std::vector<int64_t>& numels, const std::array<int64_t, Meta::kDepth>& element_bytes,
                     int64_t chunk, Launch&& launch, int64_t max_piece = kMaxPieceElements) {
  if (addresses.size() != numels.size()) {
    throw std::invalid_argument("multi_tensor: " + std::to_string(addresses.size()) + " address sets for " +
                                std::to_string(numels.size()) + " tensors");
  }
  if (chunk <= 0 || max_piece <= 0 || max_piece % 16 != 0 || max_piece > kMaxPieceElements) {
    throw std::invalid_argument("multi_tensor: chunk " + std::to_string(chunk) + " or piece " +
                                std::to_string(max_piece) + " out of range");
  }
  for (const int64_t bytes : element_bytes) {
    if (bytes <= 0 || 16 % bytes != 0) throw std::invalid_argument("multi_tensor: element size must divide 16");
  }
  // Chunks per launch stay below 2^31 (the grid's limit): MaxSlots pieces of at most
  // max_piece elements.
  if ((max_piece + chunk - 1) / chunk > (int64_t{1} << 31) / Meta::kMaxSlots) {
    throw std::invalid_argument("multi_tensor: chunk too small for the piece size");
  }
  Meta meta{};
  int slots = 0;
  uint32_t chunks = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    const int64_t n = numels[i];
    if (n < 0) throw std::invalid_argument("multi_tensor: negative element count");
    for (int64_t offset = 0; offset < n; offset += max_piece) {
      const int64_t piece = n - offset < max_piece ? n - offset : max_piece;
      for (int d = 0; d < Meta::kDepth; ++d) {
        meta.addresses[d][slots] = static_cast<char*>(addresses[i][d]) + offset * element_bytes[d];
      }
      chunks += static_cast<uint32_t>((piece + chunk - 1) / chunk);
      meta.numel[slots] = static_cast<uint32_t>(piece);
      meta.chunk_end[slots] = chunks;
      if (++slots == Meta::kMaxSlots) {
        meta.slots = slots;
        launch(static_cast<const Meta&>(meta), chunks);
        slots = 0;
        chunks = 0;
      }
    }
  }
  if (slots > 0) {
    meta.slots = slots;
    launch(static_cast<const Meta&>(meta), chunks);
  }
}

}  // namespace mbs::accumulate
