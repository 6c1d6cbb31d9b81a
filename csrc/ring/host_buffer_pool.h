// HostBufferPool: host memory for CPU micro-batches.
//
// A buffer comes back to the pool only when the last reference to the tensor built
// on it is gone, so a handed-out micro-batch is never overwritten; reusing freed
// buffers spares the page faults of fresh memory. At most max_cached free buffers
// are kept, so the pool's memory is bounded by the ring's depth.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace mbs {

// Sizes and strides of a dense (non-overlapping, gap-free) host tensor: a staged micro-batch.
struct HostLayout {
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
};

class HostBufferPool : public std::enable_shared_from_this<HostBufferPool> {
 public:
  explicit HostBufferPool(size_t max_cached);
  ~HostBufferPool();
  HostBufferPool(const HostBufferPool&) = delete;
  HostBufferPool& operator=(const HostBufferPool&) = delete;
  // A CPU tensor of `layout` on a pooled (or new) buffer; resizable like any other.
  at::Tensor empty(const HostLayout& layout, at::ScalarType dtype);
  size_t cached() const;
  // Caches up to n free buffers (never lowers the limit).
  void cache_at_least(size_t n);

 private:
  // The tensor's deleter: runs wherever the last reference goes, so it never throws
  // (free_ keeps capacity for max_cached entries; push_back within it cannot fail).
  static void release(void* ctx) noexcept;
  void give_back(void* ptr, size_t nbytes) noexcept;

  mutable std::mutex mu_;
  size_t max_cached_;
  std::vector<std::pair<size_t, void*>> free_;
};

}  // namespace mbs
