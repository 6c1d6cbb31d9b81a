// StreamRing: streams a host batch to a device in micro-batches, staged by a
// background C++ worker thread through a fixed ring of slots (native::RingCore).
//
// Lifetime contract: every micro-batch handed out is a freshly allocated tensor
// that the ring never writes again. On CPU the worker stages straight into fresh
// tensors; on CUDA it stages into pinned host slots that are reused, and each
// micro-batch is copied into fresh device tensors allocated on the consumer's
// current stream.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Stream.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "native/ring_core.h"

namespace mbs {

// Totals of one stream; a new stream gets a new object.
struct RingStats {
  std::atomic<int64_t> stage_ns{0};
  std::atomic<int64_t> wait_ns{0};
  std::atomic<int64_t> micro_batches{0};
  std::atomic<int64_t> bytes{0};
  std::atomic<int64_t> planned{0};
};

// Host memory for CPU micro-batches. A buffer comes back to the pool only when the
// last reference to the tensor built on it is gone, so a handed-out micro-batch is
// never overwritten; reusing freed buffers spares the page faults of fresh memory.
class HostBufferPool : public std::enable_shared_from_this<HostBufferPool> {
 public:
  explicit HostBufferPool(size_t max_cached) : max_cached_(max_cached) {}
  ~HostBufferPool();
  HostBufferPool(const HostBufferPool&) = delete;
  HostBufferPool& operator=(const HostBufferPool&) = delete;
  // A contiguous CPU tensor on a pooled (or new) buffer; resizable like any other.
  at::Tensor empty(at::IntArrayRef shape, at::ScalarType dtype);
  size_t cached() const;
  // Caches up to n free buffers (never lowers the limit).
  void cache_at_least(size_t n);

 private:
  static void release(void* ctx);
  void give_back(void* ptr, size_t nbytes);

  mutable std::mutex mu_;
  size_t max_cached_;
  std::vector<std::pair<size_t, void*>> free_;
};

// One micro-batch whose host->device copy has been enqueued but not yet handed out.
struct DeviceBatch {
  int64_t item = -1;
  int slot = -1;
  std::vector<at::Tensor> tensors;
  c10::Stream alloc_stream{c10::Stream::DEFAULT, c10::Device(c10::kCPU)};
};

// The device side of the ring (CUDA: copy stream, per-slot events, pinned slots).
class DeviceTransfer {
 public:
  virtual ~DeviceTransfer() = default;
  // Worker thread: pinned host tensor for staging.
  virtual at::Tensor alloc_pinned(at::IntArrayRef shape, at::ScalarType dtype) = 0;
  // Worker thread: blocks until the last copy out of `slot` has finished.
  virtual void wait_copied(int slot) = 0;
  // Consumer: allocates device tensors on the current stream and enqueues the copy
  // of the staged host tensors on the copy stream.
  virtual DeviceBatch enqueue(int64_t item, int slot, const std::vector<at::Tensor>& host) = 0;
  // Consumer: makes the current stream wait for the batch's copy (device-side only).
  virtual void deliver(DeviceBatch& batch) = 0;
  // Consumer: drops a batch that will never be handed out, after its copy.
  virtual void discard(DeviceBatch& batch) = 0;
};

std::unique_ptr<DeviceTransfer> make_device_transfer(c10::Device device, int slots);

class RingStream {
 public:
  RingStream(c10::Device device, int slots, std::vector<at::Tensor> leaves, int64_t micro_batch_size,
             std::optional<at::Tensor> indices, std::shared_ptr<RingStats> stats,
             std::shared_ptr<HostBufferPool> pool);
  ~RingStream();
  RingStream(const RingStream&) = delete;
  RingStream& operator=(const RingStream&) = delete;

  // The next micro-batch (one tensor per leaf), or nullopt after the last one.
  // Rethrows a worker failure at the micro-batch it concerns.
  std::optional<std::vector<at::Tensor>> next();
  // Stops the worker and joins it. Idempotent.
  void close();
  // close(), and later next() calls raise: a new stream was started on the ring.
  void supersede();

  int64_t index() const { return index_; }
  std::pair<int64_t, int64_t> rows() const { return rows_; }
  int64_t num_micro_batches() const { return items_; }
  bool closed() const;

 private:
  void stage(int64_t item, int slot);  // worker thread
  std::pair<int64_t, int64_t> range_of(int64_t item) const;
  void sync_stats();
  void close_locked();

  const c10::Device device_;
  const std::vector<at::Tensor> leaves_;
  const int64_t micro_batch_size_;
  const at::Tensor indices_;  // undefined: rows in order
  const int64_t total_rows_;
  const int64_t items_;
  const std::shared_ptr<RingStats> stats_;
  const std::shared_ptr<HostBufferPool> pool_;
  std::unique_ptr<DeviceTransfer> transfer_;
  // Per slot: what the worker staged (handed over through the core's protocol).
  std::vector<std::vector<at::Tensor>> staged_;
  // Per slot and leaf: reusable pinned staging buffers (CUDA only; worker-owned).
  std::vector<std::vector<at::Tensor>> pinned_;

  mutable std::mutex mu_;  // consumer side: next()/close() from any thread
  bool closed_ = false;
  bool superseded_ = false;
  int held_slot_ = -1;
  std::optional<DeviceBatch> pending_;
  int64_t index_ = -1;
  std::pair<int64_t, int64_t> rows_{0, 0};
  std::unique_ptr<native::RingCore> core_;  // last: its thread stops before the rest goes
};

class StreamRing {
 public:
  StreamRing(c10::Device device, int slots);
  ~StreamRing();
  StreamRing(const StreamRing&) = delete;
  StreamRing& operator=(const StreamRing&) = delete;

  // Starts a stream; a previous stream still open on this ring is closed first.
  std::shared_ptr<RingStream> open(std::vector<at::Tensor> leaves, int64_t micro_batch_size,
                                   std::optional<at::Tensor> indices);
  std::shared_ptr<RingStats> stats() const;
  void close();

  c10::Device device() const { return device_; }
  int slots() const { return slots_; }

 private:
  const c10::Device device_;
  const int slots_;
  mutable std::mutex mu_;
  std::weak_ptr<RingStream> current_;
  std::shared_ptr<RingStats> stats_;
  std::shared_ptr<HostBufferPool> pool_;
};

}  // namespace mbs
