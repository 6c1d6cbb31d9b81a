// CPU side of the streaming ring: micro-batches are staged straight into fresh
// buffers from the ring's HostBufferPool and handed out as they are. Nothing is
// copied after staging, so there is nothing to wait for.
#include <utility>

#include "ring/device_transfer.h"

namespace mbs {

namespace {

class HostTransfer final : public DeviceTransfer {
 public:
  explicit HostTransfer(std::shared_ptr<HostBufferPool> pool) : pool_(std::move(pool)) {}

  bool needs_staging(const at::Tensor& /*leaf*/) const override { return true; }  // fresh tensors promised

  at::Tensor staging_buffer(int /*slot*/, size_t /*leaf*/, const HostLayout& layout, at::ScalarType dtype) override {
    return pool_->empty(layout, dtype);  // handed out as is: a new buffer every time
  }

  void wait_copied(int /*slot*/) override {}
  void prepare(int64_t, int, const std::vector<at::Tensor>&) override {}  // nothing to reserve

  DeviceBatch enqueue(int64_t item, int slot, std::vector<at::Tensor> host) override {
    DeviceBatch batch;
    batch.item = item;
    batch.slot = slot;
    batch.tensors = std::move(host);
    return batch;
  }

  void deliver(DeviceBatch& /*batch*/) override {}
  void discard(DeviceBatch& batch) override { batch.tensors.clear(); }
  void release_reserved() noexcept override {}

 private:
  const std::shared_ptr<HostBufferPool> pool_;
};

}  // namespace

std::unique_ptr<DeviceTransfer> make_host_transfer(std::shared_ptr<HostBufferPool> pool) {
  return std::make_unique<HostTransfer>(std::move(pool));
}

}  // namespace mbs
