// StreamRing: streams a host batch to a device in micro-batches, staged by a
// background C++ thread through a fixed ring of slots (ring_core::RingCore). Staging
// copies run on the ring's own WorkerPool (staging_threads), never on torch's
// intra-op threads, so torch.set_num_threads does not change them.
//
// Micro-batches are balanced (ring_core::split_sizes): sizes differ by at most one.
//
// One path for every device: the worker stages micro-batch i into slot i % slots
// (or, from a pinned batch on a CUDA ring, takes a view: nothing to stage), and the
// consumer hands it to a DeviceTransfer: HostTransfer on CPU, CudaTransfer on CUDA.
//
// Lifetime contract: every micro-batch handed out is a freshly allocated tensor
// that the ring never writes again. On CPU the worker stages straight into fresh
// pooled tensors; on CUDA it stages into pinned host slots that are reused, and each
// micro-batch is copied into fresh device tensors allocated on the consumer's
// current stream.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ring/core/ring_core.h"
#include "ring/core/worker_pool.h"
#include "ring/device_transfer.h"
#include "ring/host_buffer_pool.h"

namespace mbs {

// Totals of one stream; a new stream gets a new object.
struct RingStats {
  std::atomic<int64_t> stage_ns{0};
  std::atomic<int64_t> wait_ns{0};
  std::atomic<int64_t> micro_batches{0};
  std::atomic<int64_t> bytes{0};
  std::atomic<int64_t> staged_bytes{0};  // bytes the worker copied (0 for direct copies from pinned memory)
  std::atomic<int64_t> planned{0};
};

// One stream of micro-batches over one batch (Python: mbs_ext.RingIterator).
class RingIterator {
 public:
  RingIterator(c10::Device device, int slots, std::vector<at::Tensor> leaves, int64_t micro_batch_size,
               std::optional<at::Tensor> indices, std::shared_ptr<RingStats> stats,
               std::shared_ptr<HostBufferPool> pool, std::shared_ptr<ring_core::WorkerPool> workers);
  ~RingIterator();
  RingIterator(const RingIterator&) = delete;
  RingIterator& operator=(const RingIterator&) = delete;

  // The next micro-batch (one tensor per leaf), or nullopt after the last one.
  // Rethrows a worker failure at the micro-batch it concerns. A failure on the
  // consumer's side (the device copy) ends the stream: it is closed, every
  // micro-batch in flight is dropped safely, and later calls raise again.
  std::optional<std::vector<at::Tensor>> next();
  // Stops the worker and joins it. Idempotent.
  void close();
  // close(), and later next() calls raise: a new stream was started on the ring.
  void supersede();

  int64_t index() const;
  std::pair<int64_t, int64_t> rows() const;
  int64_t num_micro_batches() const { return items_; }
  bool closed() const;

 private:
  using Ticket = ring_core::RingCore::Ticket;

  void stage(int64_t item, int slot);  // worker thread
  // The steps of next(), consumer side, under mu_.
  void check_usable_locked() const;
  std::optional<Ticket> next_ticket();
  DeviceBatch take(const Ticket& ticket);
  DeviceBatch take_pending();
  void copy_ahead();
  void prepare_next(int64_t item);  // reserve device memory for `item`
  HostLayout staged_layout(size_t leaf, int64_t rows) const;  // of a staged micro-batch
  void end_with_error(std::optional<DeviceBatch>& batch) noexcept;
  void record_position(int64_t item);
  void record_wait();
  void close_locked();
  void drop(DeviceBatch& batch) noexcept;  // discard() that never throws (error paths)

  const std::vector<at::Tensor> leaves_;
  const int64_t micro_batch_size_;
  const at::Tensor indices_;  // undefined: rows in order
  const int64_t total_rows_;
  const int64_t items_;
  const std::shared_ptr<RingStats> stats_;
  const std::shared_ptr<ring_core::WorkerPool> workers_;
  std::unique_ptr<DeviceTransfer> transfer_;
  // Per leaf, decided once per stream: the staged rows' strides (empty: rows are not blocks,
  // staged contiguous by torch's copy) and whether the transfer reads the rows in place.
  std::vector<std::vector<int64_t>> block_strides_;
  std::vector<char> in_place_;
  // Per slot: what the worker staged (handed over through the core's protocol).
  std::vector<std::vector<at::Tensor>> staged_;

  mutable std::mutex mu_;  // consumer side: next()/close() from any thread
  bool closed_ = false;
  bool superseded_ = false;
  std::string failed_;  // why a consumer-side failure ended the stream
  std::optional<DeviceBatch> pending_;              // the next micro-batch, its copy enqueued
  std::optional<Ticket> held_;                      // the next micro-batch, acquired but not copied yet
  bool copy_ahead_ = true;                          // off after an out-of-memory error copying ahead
  bool reserve_ahead_ = true;                       // off after a failed reservation
  // Position of the last micro-batch handed out: its own lock, so that index()/rows()
  // never wait behind a next() that blocks for data.
  mutable std::mutex pos_mu_;
  int64_t index_ = -1;
  std::pair<int64_t, int64_t> rows_{0, 0};
  std::unique_ptr<ring_core::RingCore> core_;  // last: its thread stops before the rest goes
};

class StreamRing {
 public:
  StreamRing(c10::Device device, int slots, int staging_threads);
  ~StreamRing();
  StreamRing(const StreamRing&) = delete;
  StreamRing& operator=(const StreamRing&) = delete;

  // Starts a stream; a previous stream still open on this ring is closed first.
  std::shared_ptr<RingIterator> open(std::vector<at::Tensor> leaves, int64_t micro_batch_size,
                                     std::optional<at::Tensor> indices);
  std::shared_ptr<RingStats> stats() const;
  void close();

  c10::Device device() const { return device_; }
  int slots() const { return slots_; }
  int staging_threads() const { return workers_->threads(); }

 private:
  const c10::Device device_;
  const int slots_;
  mutable std::mutex mu_;
  std::weak_ptr<RingIterator> current_;
  std::shared_ptr<RingStats> stats_;
  std::shared_ptr<HostBufferPool> pool_;
  std::shared_ptr<ring_core::WorkerPool> workers_;
};

}  // namespace mbs
