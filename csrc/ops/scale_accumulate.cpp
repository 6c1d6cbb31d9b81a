// The schema of mbs_ext::scale_accumulate_ and the table of its unchecked kernels
// (ops/kernels.h). The kernels register themselves (cpu/, cuda/); the Python face, with
// the fake kernel, is mbs_ext/ops.py over ops/bindings.cpp.
#include <torch/library.h>

#include <array>
#include <atomic>

#include "ops/kernels.h"

namespace mbs {
namespace {

std::array<std::atomic<Kernel>, static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)>& kernels() {
  static std::array<std::atomic<Kernel>, static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)> table{};
  return table;
}

}  // namespace

bool register_kernel(c10::DeviceType type, Kernel kernel) {
  kernels()[static_cast<size_t>(type)].store(kernel, std::memory_order_release);
  return true;
}

Kernel kernel_for(c10::DeviceType type) {
  return kernels()[static_cast<size_t>(type)].load(std::memory_order_acquire);
}

}  // namespace mbs

// sq_norm, optional and last (calls without it are the calls of before): a 0-dim float32 or
// float64 tensor the op adds sum(g^2) over every grad element to, read in the same pass.
TORCH_LIBRARY(mbs_ext, m) {
  m.def(
      "scale_accumulate_(Tensor(a!)[] accumulators, Tensor[] grads, Tensor scale, "
      "Tensor(b!) found_inf, Tensor(c!)? sq_norm=None) -> ()");
}
