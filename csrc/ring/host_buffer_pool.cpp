#include "ring/host_buffer_pool.h"

#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <memory>

namespace mbs {

namespace {
struct PooledBuffer {
  std::shared_ptr<HostBufferPool> pool;
  void* ptr;
  size_t nbytes;
};
}  // namespace

HostBufferPool::~HostBufferPool() {
  for (auto& [nbytes, ptr] : free_) c10::GetCPUAllocator()->raw_deallocate(ptr);
}

size_t HostBufferPool::cached() const {
  std::lock_guard<std::mutex> lock(mu_);
  return free_.size();
}

HostBufferPool::HostBufferPool(size_t max_cached) : max_cached_(max_cached) { free_.reserve(max_cached_); }

void HostBufferPool::cache_at_least(size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  if (n <= max_cached_) return;
  free_.reserve(n);  // may throw here, never in give_back
  max_cached_ = n;
}

void HostBufferPool::release(void* ctx) noexcept {
  std::unique_ptr<PooledBuffer> buf(static_cast<PooledBuffer*>(ctx));
  buf->pool->give_back(buf->ptr, buf->nbytes);
}

void HostBufferPool::give_back(void* ptr, size_t nbytes) noexcept {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.size() < max_cached_) {
      free_.emplace_back(nbytes, ptr);  // within the reserved capacity: no allocation
      return;
    }
  }
  c10::GetCPUAllocator()->raw_deallocate(ptr);
}

at::Tensor HostBufferPool::empty(const HostLayout& layout, at::ScalarType dtype) {
  const int64_t numel = c10::multiply_integers(layout.sizes);
  const size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  void* ptr = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < free_.size(); ++i) {
      if (free_[i].first == nbytes) {
        ptr = free_[i].second;
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      }
    }
  }
  if (ptr == nullptr) {
    try {
      ptr = c10::GetCPUAllocator()->raw_allocate(std::max<size_t>(nbytes, 1));
    } catch (const c10::Error& e) {  // host memory is short: an out-of-memory error for step's back-off
      TORCH_CHECK_WITH(OutOfMemoryError, false, "host staging buffer of ", nbytes, " bytes: ",
                       e.what_without_backtrace());
    }
  }
  std::unique_ptr<PooledBuffer> owner;
  try {
    owner.reset(new PooledBuffer{shared_from_this(), ptr, nbytes});
  } catch (...) {
    give_back(ptr, nbytes);
    throw;
  }
  c10::DataPtr data(ptr, owner.release(), &HostBufferPool::release, c10::Device(c10::kCPU));
  // Resizable with the CPU allocator: growing the tensor later moves it to new
  // memory and hands this buffer back to the pool.
  auto storage = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                                       std::move(data), c10::GetCPUAllocator(), /*resizable=*/true);
  return at::empty({0}, at::TensorOptions().dtype(dtype).device(at::kCPU))
      .set_(c10::Storage(std::move(storage)), 0, layout.sizes, layout.strides);
}

}  // namespace mbs
