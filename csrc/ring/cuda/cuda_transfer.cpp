// CUDA side of the streaming ring: a dedicated copy stream from the pool, one
// "copied" event per slot, reusable pinned staging memory per slot (sized in
// bytes), and device tensors allocated on the consumer's current stream, so the
// caching allocator needs no record_stream. The copy stream waits on compute only
// through events recorded on the consumer's stream when a copy is enqueued.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/accumulate.h>
#include <cuda_runtime_api.h>

#include <vector>

#include "ring/device_transfer.h"

namespace mbs {

namespace {

// Error paths: orders `waiter` behind the work enqueued on `source` so far (through
// `ev`), or, when not even that can be enqueued, waits for `source` here. Never throws
// and leaves no CUDA error set: the exception in flight says what went wrong. Returns
// whether `ev` now marks that point.
bool order_behind_or_sync(cudaEvent_t ev, cudaStream_t source, cudaStream_t waiter) noexcept {
  const bool marked = cudaEventRecord(ev, source) == cudaSuccess && cudaStreamWaitEvent(waiter, ev, 0) == cudaSuccess;
  if (!marked) (void)cudaStreamSynchronize(source);
  C10_CUDA_CLEAR_ERROR();
  return marked;
}

// Device memory for a micro-batch copied from the host rows `rows`: laid out like them
// when they are dense (the ring stages and hands over only dense rows), so a channels_last
// image batch stays channels_last and its copy is one block (torch copies between
// different layouts through a contiguous host temporary, on the consumer's thread and from
// pageable memory); contiguous otherwise.
at::Tensor device_like(const at::Tensor& rows, c10::Device device) {
  const auto options = at::TensorOptions().dtype(rows.scalar_type()).device(device);
  if (rows.is_non_overlapping_and_dense()) return at::empty_strided(rows.sizes(), rows.strides(), options);
  return at::empty(rows.sizes(), options);
}

// Whether `reserved` (from device_like) can take a copy of `rows`.
bool laid_out_for(const at::Tensor& reserved, const at::Tensor& rows) {
  if (reserved.sizes() != rows.sizes() || reserved.scalar_type() != rows.scalar_type()) return false;
  return rows.is_non_overlapping_and_dense() ? reserved.strides() == rows.strides() : reserved.is_contiguous();
}

class CudaTransfer final : public DeviceTransfer {
 public:
  CudaTransfer(c10::Device device, int slots)
      : device_(device), copy_stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())) {
    c10::cuda::CUDAGuard guard(device_);
    copied_.assign(static_cast<size_t>(slots), nullptr);
    reserved_.assign(static_cast<size_t>(slots), nullptr);
    prepared_.resize(static_cast<size_t>(slots));
    recorded_.assign(static_cast<size_t>(slots), 0);
    pinned_.resize(static_cast<size_t>(slots));
    try {  // a constructor that throws runs no destructor: the events made so far go here
      C10_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
      // The worker waits on these (wait_copied) for most of a stream: blocking sync lets it
      // sleep there instead of spinning a CPU core the caller's own threads need.
      for (auto& ev : copied_) {
        C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventBlockingSync));
      }
      for (auto& ev : reserved_) C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    } catch (...) {
      destroy_events();
      throw;
    }
  }

  ~CudaTransfer() override {
    release_reserved();
    // Nothing may escape a destructor: the device guard throws when the CUDA runtime is
    // already going away (at interpreter exit), and then the events go with it.
    try {
      c10::cuda::CUDAGuard guard(device_);
      destroy_events();
    } catch (...) {
    }
    C10_CUDA_CLEAR_ERROR();
  }

  // A pinned batch is read by the copy engine directly: no memcpy into a slot.
  bool needs_staging(const at::Tensor& leaf) const override { return !leaf.is_pinned(); }

  at::Tensor staging_buffer(int slot, size_t leaf, const HostLayout& layout, at::ScalarType dtype) override {
    // Worker thread only. The slot's byte buffer for this leaf grows when needed;
    // with balanced micro-batches the first one is the largest, so it never does.
    auto& bufs = pinned_[static_cast<size_t>(slot)];
    if (bufs.size() <= leaf) bufs.resize(leaf + 1);
    const int64_t nbytes = c10::multiply_integers(layout.sizes) * static_cast<int64_t>(c10::elementSize(dtype));
    at::Tensor& buf = bufs[leaf];
    if (!buf.defined() || buf.numel() < nbytes) {
      c10::cuda::CUDAGuard guard(device_);
      buf = at::empty({std::max<int64_t>(nbytes, 1)},
                      at::TensorOptions().dtype(at::kByte).device(at::kCPU).pinned_memory(true));
    }
    return at::empty({0}, at::TensorOptions().dtype(dtype).device(at::kCPU))
        .set_(buf.storage(), 0, layout.sizes, layout.strides);
  }

  void wait_copied(int slot) override {
    // recorded_[slot] is written by the consumer before it releases the slot; the
    // ring core's hand-over orders that write before this read.
    if (!recorded_[static_cast<size_t>(slot)]) return;
    c10::cuda::CUDAGuard guard(device_);
    C10_CUDA_CHECK(cudaEventSynchronize(copied_[static_cast<size_t>(slot)]));
  }

  void prepare(int64_t item, int slot, const std::vector<at::Tensor>& like) override {
    Prepared& p = prepared_[static_cast<size_t>(slot)];
    if (p.item == item) return;
    release_prepared(slot);
    c10::cuda::CUDAGuard guard(device_);
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device_.index());
    try {
      p.tensors.reserve(like.size());
      // Fresh device memory, owned by the current stream, laid out as enqueue will need it.
      for (const at::Tensor& rows : like) p.tensors.push_back(device_like(rows, device_));
      // The copy may write that memory once the current stream's work so far is done.
      C10_CUDA_CHECK(cudaEventRecord(reserved_[static_cast<size_t>(slot)], current.stream()));
    } catch (...) {
      release_prepared(slot);  // nothing was written to it: back to the pool at once
      throw;
    }
    p.stream = current.unwrap();
    p.item = item;
  }

  DeviceBatch enqueue(int64_t item, int slot, std::vector<at::Tensor> host) override {
    c10::cuda::CUDAGuard guard(device_);
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device_.index());
    DeviceBatch batch;
    batch.item = item;
    batch.slot = slot;
    Prepared& p = prepared_[static_cast<size_t>(slot)];
    bool fits = p.item == item && p.stream == current.unwrap() && p.tensors.size() == host.size();
    for (size_t k = 0; fits && k < host.size(); ++k) fits = laid_out_for(p.tensors[k], host[k]);
    if (fits) {  // reserved earlier: wait only for the work before the reservation
      batch.tensors = std::move(p.tensors);
      p.tensors.clear();
      p.item = -1;
      C10_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_.stream(), reserved_[static_cast<size_t>(slot)], 0));
    } else {
      release_prepared(slot);
      batch.tensors.reserve(host.size());
      for (const at::Tensor& h : host) batch.tensors.push_back(device_like(h, device_));  // owned by the current stream
      // The copy may only write that memory after the current stream's earlier work.
      C10_CUDA_CHECK(cudaEventRecord(ready_, current.stream()));
      C10_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_.stream(), ready_, 0));
    }
    batch.alloc_stream = current.unwrap();
    cudaEvent_t copied = copied_[static_cast<size_t>(slot)];
    try {
      {
        c10::cuda::CUDAStreamGuard stream_guard(copy_stream_);
        for (size_t k = 0; k < host.size(); ++k) batch.tensors[k].copy_(host[k], /*non_blocking=*/true);
      }
      C10_CUDA_CHECK(cudaEventRecord(copied, copy_stream_.stream()));
    } catch (...) {
      // Copies enqueued before the failure may still write batch.tensors (freed to the
      // current stream as this unwinds) and read the slot's pinned memory (refilled
      // once copied_ fires): mark where they end and order both behind that mark, or
      // wait for them here if not even that can be enqueued.
      recorded_[static_cast<size_t>(slot)] = order_behind_or_sync(copied, copy_stream_.stream(), current.stream());
      throw;
    }
    recorded_[static_cast<size_t>(slot)] = 1;
    return batch;
  }

  void deliver(DeviceBatch& batch) override {
    c10::cuda::CUDAGuard guard(device_);
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device_.index());
    C10_CUDA_CHECK(cudaStreamWaitEvent(current.stream(), copied_[static_cast<size_t>(batch.slot)], 0));
    if (current.unwrap() != batch.alloc_stream) {
      // The caller switched streams since the copy was enqueued. Rather than
      // record_stream, copy into memory owned by the current stream and free the
      // originals on their own stream once that copy (and so the transfer) is done.
      const c10::cuda::CUDAStream alloc(c10::cuda::CUDAStream::UNCHECKED, batch.alloc_stream);
      std::vector<at::Tensor> own;
      own.reserve(batch.tensors.size());
      try {
        for (const auto& t : batch.tensors) own.push_back(t.clone());
      } catch (...) {
        // Clones enqueued so far read the originals: they go back to their stream after them.
        (void)order_behind_or_sync(ready_, current.stream(), alloc.stream());
        throw;
      }
      C10_CUDA_CHECK(cudaEventRecord(ready_, current.stream()));
      C10_CUDA_CHECK(cudaStreamWaitEvent(alloc.stream(), ready_, 0));
      batch.tensors = std::move(own);
    }
  }

  void discard(DeviceBatch& batch) override {
    c10::cuda::CUDAGuard guard(device_);
    const c10::cuda::CUDAStream alloc(c10::cuda::CUDAStream::UNCHECKED, batch.alloc_stream);
    // Memory goes back to the allocation stream only after the copy into it.
    C10_CUDA_CHECK(cudaStreamWaitEvent(alloc.stream(), copied_[static_cast<size_t>(batch.slot)], 0));
    batch.tensors.clear();
  }

  void release_reserved() noexcept override {
    for (size_t slot = 0; slot < prepared_.size(); ++slot) release_prepared(static_cast<int>(slot));
  }

 private:
  struct Prepared {
    int64_t item = -1;
    std::vector<at::Tensor> tensors;
    c10::Stream stream{c10::Stream::DEFAULT, c10::Device(c10::kCPU)};
  };

  // Events are created in the constructor only; a null one was never made. Device guard held.
  void destroy_events() noexcept {
    // Pending work keeps what it needs; destroying a recorded event is allowed.
    for (auto& ev : copied_) {
      if (ev) (void)cudaEventDestroy(ev);
      ev = nullptr;
    }
    for (auto& ev : reserved_) {
      if (ev) (void)cudaEventDestroy(ev);
      ev = nullptr;
    }
    if (ready_) (void)cudaEventDestroy(ready_);
    ready_ = nullptr;
  }

  // Unused reserved memory goes back to its stream's pool; nothing was written to it.
  void release_prepared(int slot) noexcept {
    Prepared& p = prepared_[static_cast<size_t>(slot)];
    p.tensors.clear();
    p.item = -1;
  }

  const c10::Device device_;
  const c10::cuda::CUDAStream copy_stream_;
  cudaEvent_t ready_ = nullptr;
  std::vector<cudaEvent_t> copied_;
  std::vector<char> recorded_;
  std::vector<std::vector<at::Tensor>> pinned_;  // per slot and leaf: pinned bytes (worker-owned)
  std::vector<cudaEvent_t> reserved_;            // per slot: recorded when its device memory was reserved
  std::vector<Prepared> prepared_;               // per slot: device memory reserved ahead (consumer-owned)
};

}  // namespace

std::unique_ptr<DeviceTransfer> make_cuda_transfer(c10::Device device, int slots) {
  return std::make_unique<CudaTransfer>(device, slots);
}

}  // namespace mbs
