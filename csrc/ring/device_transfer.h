// DeviceTransfer: where the ring's staged micro-batches go. One implementation per
// device kind: ring/cpu/host_transfer.cpp and ring/cuda/cuda_transfer.cpp (a CPU-only
// build links ring/no_cuda/ instead, which refuses CUDA rings).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "ring/host_buffer_pool.h"

namespace mbs {

// One micro-batch on its way to the consumer.
struct DeviceBatch {
  int64_t item = -1;
  int slot = -1;
  std::vector<at::Tensor> tensors;
  c10::Stream alloc_stream{c10::Stream::DEFAULT, c10::Device(c10::kCPU)};
};

class DeviceTransfer {
 public:
  virtual ~DeviceTransfer() = default;
  // Whether rows of this batch tensor must be copied by the worker; false when the
  // transfer can read the batch itself (a pinned batch on a CUDA ring). Asked once per
  // leaf and stream, only for rows the ring could hand over in place (dense runs of rows,
  // no indices).
  virtual bool needs_staging(const at::Tensor& leaf) const = 0;
  // Worker thread: a host tensor of `layout` (dense) to stage leaf `leaf` of slot `slot` into.
  virtual at::Tensor staging_buffer(int slot, size_t leaf, const HostLayout& layout, at::ScalarType dtype) = 0;
  // Worker thread: blocks until nothing reads `slot`'s staging memory any more.
  virtual void wait_copied(int slot) = 0;
  // Consumer: reserves device memory for micro-batch `item` (in `slot`) on the
  // current stream now, before the consumer enqueues more compute, so that its copy
  // later waits only for work enqueued before this point (a per-slot event), never
  // for the compute on the micro-batch in use. Optional: enqueue allocates otherwise,
  // so the ring ignores an out-of-memory error here (it leaves nothing reserved).
  // `like` has one tensor per leaf with the sizes, strides and dtype the micro-batch will
  // have on the host (a view of the batch, or a meta tensor for staged rows).
  virtual void prepare(int64_t item, int slot, const std::vector<at::Tensor>& like) = 0;
  // Consumer: starts moving the staged tensors to the device (CUDA: fresh device
  // tensors on the current stream, copy enqueued on the copy stream). If it throws,
  // nothing it enqueued can still touch memory that is freed or reused afterwards.
  virtual DeviceBatch enqueue(int64_t item, int slot, std::vector<at::Tensor> host) = 0;
  // Consumer: makes the batch usable on the current stream (device-side waits only).
  virtual void deliver(DeviceBatch& batch) = 0;
  // Consumer: drops a batch that will never be handed out, safely for its memory.
  virtual void discard(DeviceBatch& batch) = 0;
  // Consumer, when the stream closes: gives back memory prepare() reserved.
  virtual void release_reserved() noexcept = 0;
};

std::unique_ptr<DeviceTransfer> make_host_transfer(std::shared_ptr<HostBufferPool> pool);
// A CPU-only build links ring/no_cuda/, whose make_cuda_transfer refuses.
std::unique_ptr<DeviceTransfer> make_cuda_transfer(c10::Device device, int slots);

}  // namespace mbs
