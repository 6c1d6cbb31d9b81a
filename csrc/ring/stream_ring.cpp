#include "ring/stream_ring.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/GradMode.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <c10/util/strides.h>

#include <algorithm>
#include <chrono>
#include <string>

#if MBS_EXT_OPENMP
#include <omp.h>
#endif

namespace mbs {

namespace {

using Clock = std::chrono::steady_clock;

int64_t ns_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

int64_t check_leaves(const std::vector<at::Tensor>& leaves) {
  TORCH_CHECK_VALUE(!leaves.empty(), "StreamRing: batch must contain at least one tensor");
  int64_t n = -1;
  for (size_t k = 0; k < leaves.size(); ++k) {
    const at::Tensor& t = leaves[k];
    TORCH_CHECK_VALUE(t.defined(), "StreamRing: batch tensor ", k, " is undefined");
    TORCH_CHECK_VALUE(t.device().is_cpu(), "StreamRing: batch tensor ", k, " is on ", t.device(),
                      "; the batch must stay on the host (CPU)");
    TORCH_CHECK_VALUE(t.layout() == at::kStrided, "StreamRing: batch tensor ", k,
                      " must be a strided (dense) tensor, got layout ", t.layout());
    TORCH_CHECK_VALUE(t.dim() >= 1, "StreamRing: batch tensor ", k, " is 0-dim; every tensor needs a batch dim 0");
    if (n < 0) n = t.size(0);
    TORCH_CHECK_VALUE(t.size(0) == n, "StreamRing: all batch tensors must share dim-0 size, tensor 0 has ", n,
                      " rows but tensor ", k, " has ", t.size(0));
  }
  TORCH_CHECK_VALUE(n > 0, "StreamRing: batch has 0 rows (dim-0 size N must be >= 1)");
  return n;
}

at::Tensor check_indices(const std::optional<at::Tensor>& indices) {
  if (!indices.has_value() || !indices->defined()) return at::Tensor();
  const at::Tensor& idx = *indices;
  TORCH_CHECK_VALUE(idx.device().is_cpu(), "StreamRing: indices must be a CPU tensor, got ", idx.device());
  TORCH_CHECK_VALUE(idx.dim() == 1, "StreamRing: indices must be 1-d, got shape ", idx.sizes());
  TORCH_CHECK_TYPE(idx.scalar_type() == at::kLong || idx.scalar_type() == at::kInt,
                   "StreamRing: indices must be int64 (or int32), got ", idx.scalar_type());
  TORCH_CHECK_VALUE(idx.numel() > 0, "StreamRing: indices must not be empty");
  return idx.to(at::kLong).contiguous();
}

// Rethrows a staging failure with the micro-batch it concerns, keeping the error class.
[[noreturn]] void rethrow_with_context(int64_t item, size_t leaf) {
  const std::string where = "StreamRing worker, micro-batch " + std::to_string(item) + ", batch tensor " +
                            std::to_string(leaf) + ": ";
  try {
    throw;
  } catch (const c10::IndexError& e) {
    TORCH_CHECK_INDEX(false, where, e.what_without_backtrace());
  } catch (const c10::ValueError& e) {
    TORCH_CHECK_VALUE(false, where, e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    TORCH_CHECK_TYPE(false, where, e.what_without_backtrace());
  } catch (const c10::OutOfMemoryError& e) {  // stays an out-of-memory error for step's back-off
    TORCH_CHECK_WITH(OutOfMemoryError, false, where, e.what_without_backtrace());
  } catch (const std::bad_alloc& e) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, where, e.what());
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, where, e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, where, e.what());
  }
}

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

void HostBufferPool::cache_at_least(size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  max_cached_ = std::max(max_cached_, n);
}

void HostBufferPool::release(void* ctx) {
  auto* buf = static_cast<PooledBuffer*>(ctx);
  buf->pool->give_back(buf->ptr, buf->nbytes);
  delete buf;
}

void HostBufferPool::give_back(void* ptr, size_t nbytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.size() < max_cached_) {
      free_.emplace_back(nbytes, ptr);
      return;
    }
  }
  c10::GetCPUAllocator()->raw_deallocate(ptr);
}

at::Tensor HostBufferPool::empty(at::IntArrayRef shape, at::ScalarType dtype) {
  const int64_t numel = c10::multiply_integers(shape);
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
  if (ptr == nullptr) ptr = c10::GetCPUAllocator()->raw_allocate(std::max<size_t>(nbytes, 1));
  auto* ctx = new PooledBuffer{shared_from_this(), ptr, nbytes};
  c10::DataPtr data(ptr, ctx, &HostBufferPool::release, c10::Device(c10::kCPU));
  // Resizable with the CPU allocator: growing the tensor later moves it to new
  // memory and hands this buffer back to the pool.
  auto storage = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                                       std::move(data), c10::GetCPUAllocator(), /*resizable=*/true);
  return at::empty({0}, at::TensorOptions().dtype(dtype).device(at::kCPU))
      .set_(c10::Storage(std::move(storage)), 0, shape, c10::contiguous_strides(shape));
}

RingStream::RingStream(c10::Device device, int slots, std::vector<at::Tensor> leaves, int64_t micro_batch_size,
                       std::optional<at::Tensor> indices, std::shared_ptr<RingStats> stats,
                       std::shared_ptr<HostBufferPool> pool)
    : device_(device),
      leaves_(std::move(leaves)),
      micro_batch_size_(micro_batch_size),
      indices_(check_indices(indices)),
      total_rows_(indices_.defined() ? indices_.numel() : check_leaves(leaves_)),
      items_((total_rows_ + std::max<int64_t>(micro_batch_size, 1) - 1) / std::max<int64_t>(micro_batch_size, 1)),
      stats_(std::move(stats)),
      pool_(std::move(pool)) {
  check_leaves(leaves_);
  TORCH_CHECK_VALUE(micro_batch_size >= 1, "StreamRing: micro_batch_size must be >= 1, got ", micro_batch_size);
  TORCH_CHECK_VALUE(slots >= 2, "StreamRing: slots must be >= 2, got ", slots);
  if (device_.is_cuda()) {
    transfer_ = make_device_transfer(device_, slots);
  } else {
    TORCH_CHECK_VALUE(device_.is_cpu(), "StreamRing: device must be cpu or cuda, got ", device_);
  }
  // Buffers in flight: the slots, the micro-batch in use and the one being dropped.
  pool_->cache_at_least(leaves_.size() * (static_cast<size_t>(slots) + 2));
  staged_.resize(static_cast<size_t>(slots));
  pinned_.resize(static_cast<size_t>(slots));
  stats_->planned.store(items_);
  core_ = std::make_unique<native::RingCore>(slots, items_, [this](int64_t item, int slot) { stage(item, slot); });
}

RingStream::~RingStream() {
  try {
    close();
  } catch (...) {  // never throw from a destructor
  }
}

std::pair<int64_t, int64_t> RingStream::range_of(int64_t item) const {
  const int64_t start = item * micro_batch_size_;
  return {start, std::min(start + micro_batch_size_, total_rows_)};
}

void RingStream::stage(int64_t item, int slot) {
  thread_local bool configured = false;
  if (!configured) {
    // The worker is one staging thread; intra-op threads stay with the consumer.
#if MBS_EXT_OPENMP
    omp_set_num_threads(1);
#endif
    configured = true;
  }
  const auto t0 = Clock::now();
  c10::AutoGradMode no_grad(false);
  const auto [start, stop] = range_of(item);
  const int64_t len = stop - start;
  at::Tensor idx;
  if (indices_.defined()) idx = indices_.narrow(0, start, len);
  if (transfer_) transfer_->wait_copied(slot);  // the pinned slot is no longer read by a copy
  std::vector<at::Tensor> out;
  out.reserve(leaves_.size());
  int64_t bytes = 0;
  auto& pinned = pinned_[static_cast<size_t>(slot)];
  if (transfer_ && pinned.size() != leaves_.size()) pinned.resize(leaves_.size());
  for (size_t k = 0; k < leaves_.size(); ++k) {
    const at::Tensor& src = leaves_[k];
    try {
      std::vector<int64_t> shape(src.sizes().begin(), src.sizes().end());
      shape[0] = len;
      at::Tensor dst;
      if (transfer_) {
        at::Tensor& buf = pinned[k];
        if (!buf.defined() || buf.size(0) < len) {  // grown when a bigger micro-batch arrives
          buf = transfer_->alloc_pinned(shape, src.scalar_type());
        }
        dst = buf.narrow(0, 0, len);
      } else {
        dst = pool_->empty(shape, src.scalar_type());
      }
      if (idx.defined()) {
        at::index_select_out(dst, src, 0, idx);
      } else {
        dst.copy_(src.narrow(0, start, len));
      }
      bytes += static_cast<int64_t>(dst.nbytes());
      out.push_back(std::move(dst));
    } catch (...) {
      stats_->stage_ns.fetch_add(ns_since(t0));
      rethrow_with_context(item, k);
    }
  }
  staged_[static_cast<size_t>(slot)] = std::move(out);
  stats_->bytes.fetch_add(bytes);
  stats_->stage_ns.fetch_add(ns_since(t0));
}

std::optional<std::vector<at::Tensor>> RingStream::next() {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(!superseded_,
              "StreamRing: this stream was closed because a new stream was started on the same ring");
  if (closed_) return std::nullopt;
  if (held_slot_ >= 0) {  // the previous micro-batch's slot goes back to the worker
    core_->release(held_slot_);
    held_slot_ = -1;
  }
  std::optional<native::RingCore::Ticket> ticket;
  std::vector<at::Tensor> result;
  int64_t item = -1;
  try {
    if (!transfer_) {
      ticket = core_->acquire();
      stats_->wait_ns.store(static_cast<int64_t>(core_->wait_seconds() * 1e9));
      if (!ticket) {
        close_locked();
        return std::nullopt;
      }
      item = ticket->item;
      result = std::move(staged_[static_cast<size_t>(ticket->slot)]);
      staged_[static_cast<size_t>(ticket->slot)].clear();
      held_slot_ = ticket->slot;
    } else {
      DeviceBatch batch;
      if (pending_) {
        batch = std::move(*pending_);
        pending_.reset();
      } else {
        ticket = core_->acquire();
        stats_->wait_ns.store(static_cast<int64_t>(core_->wait_seconds() * 1e9));
        if (!ticket) {
          close_locked();
          return std::nullopt;
        }
        batch = transfer_->enqueue(ticket->item, ticket->slot, staged_[static_cast<size_t>(ticket->slot)]);
        staged_[static_cast<size_t>(ticket->slot)].clear();
        core_->release(ticket->slot);  // the worker waits for the copy before refilling it
      }
      // Overlap: when the following micro-batch is staged already, start its copy now.
      if (auto ahead = core_->try_acquire()) {
        pending_ = transfer_->enqueue(ahead->item, ahead->slot, staged_[static_cast<size_t>(ahead->slot)]);
        staged_[static_cast<size_t>(ahead->slot)].clear();
        core_->release(ahead->slot);
      }
      transfer_->deliver(batch);
      item = batch.item;
      result = std::move(batch.tensors);
    }
  } catch (...) {
    stats_->wait_ns.store(static_cast<int64_t>(core_->wait_seconds() * 1e9));
    throw;
  }
  index_ = item;
  rows_ = range_of(item);
  stats_->micro_batches.fetch_add(1);
  return result;
}

void RingStream::close_locked() {
  if (closed_) return;
  closed_ = true;
  core_->stop();  // joins the worker
  stats_->wait_ns.store(static_cast<int64_t>(core_->wait_seconds() * 1e9));
  if (pending_) {
    DeviceBatch batch = std::move(*pending_);
    pending_.reset();
    transfer_->discard(batch);
  }
  held_slot_ = -1;
  for (auto& s : staged_) s.clear();
}

void RingStream::close() {
  std::lock_guard<std::mutex> lock(mu_);
  close_locked();
}

void RingStream::supersede() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!closed_) superseded_ = true;
  close_locked();
}

bool RingStream::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

#ifndef MBS_EXT_WITH_CUDA
std::unique_ptr<DeviceTransfer> make_device_transfer(c10::Device device, int /*slots*/) {
  TORCH_CHECK(false, "StreamRing: device ", device, " needs CUDA, but mbs_ext was built without CUDA");
}
#endif

StreamRing::StreamRing(c10::Device device, int slots)
    : device_(device),
      slots_(slots),
      stats_(std::make_shared<RingStats>()),
      pool_(std::make_shared<HostBufferPool>(static_cast<size_t>(slots) + 2)) {
  TORCH_CHECK_VALUE(slots >= 2, "StreamRing: slots must be >= 2, got ", slots);
  TORCH_CHECK_VALUE(device.is_cpu() || device.is_cuda(), "StreamRing: device must be cpu or cuda, got ", device);
}

StreamRing::~StreamRing() {
  try {
    close();
  } catch (...) {
  }
}

std::shared_ptr<RingStream> StreamRing::open(std::vector<at::Tensor> leaves, int64_t micro_batch_size,
                                             std::optional<at::Tensor> indices) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto previous = current_.lock()) previous->supersede();
  auto stats = std::make_shared<RingStats>();
  auto stream = std::make_shared<RingStream>(device_, slots_, std::move(leaves), micro_batch_size,
                                             std::move(indices), stats, pool_);
  stats_ = std::move(stats);
  current_ = stream;
  return stream;
}

std::shared_ptr<RingStats> StreamRing::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void StreamRing::close() {
  std::shared_ptr<RingStream> previous;
  {
    std::lock_guard<std::mutex> lock(mu_);
    previous = current_.lock();
    current_.reset();
  }
  if (previous) previous->close();
}

}  // namespace mbs
