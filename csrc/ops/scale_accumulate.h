// mbs_ext::scale_accumulate_: the checks and dense-view handling both kernels share.
//
// Python (mbs_ext/ops.py) validates every argument before dispatch and names the
// offending one; the checks here repeat each fact once so that a C++ caller, or a
// call straight through torch.ops, can never reach a kernel with arguments that
// would make it touch memory it does not own.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace mbs {

// Validates the op's arguments before any kernel touches data. Lengths are checked
// before any element is indexed. `kernel_device` is the device type of the kernel
// that calls this (every tensor but a CPU scalar `scale` must be of that type).
// Returns the device the tensors live on.
c10::Device check_scale_accumulate_args(at::TensorList accumulators, at::TensorList grads,
                                        const at::Tensor& scale, const at::Tensor& found_inf,
                                        c10::DeviceType kernel_device);

bool is_supported_float(at::ScalarType t);

// The bytes a tensor can touch, [begin, end), with the argument that owns them.
struct Extent {
  uintptr_t begin;
  uintptr_t end;
  int64_t list;   // 0 accumulators, 1 grads, 2 found_inf, 3 scale
  int64_t index;  // position in the list (0 for found_inf and scale)
  bool written() const { return list == 0 || list == 2; }
};

// The bytes `t` can touch, labelled with its argument (`list`) and position.
Extent extent_of(const at::Tensor& t, int64_t list, int64_t index);

// The first two extents that overlap where at least one is written, if any
// (sorts `extents`).
std::optional<std::pair<Extent, Extent>> first_overlap(std::vector<Extent>& extents);

// No written tensor (an accumulator, found_inf) may share memory with any other
// argument: blocks and threads run in parallel, so an overlap is a data race.
// Returns the first offending pair, if any. Assumes the arguments passed the
// checks up to this point (lengths equal, tensors with storage); never throws
// for such arguments. Empty pairs own no bytes and are left out; a CPU `scale`
// beside device tensors is read by value and left out too.
std::optional<std::pair<Extent, Extent>> find_overlap(at::TensorList accumulators, at::TensorList grads,
                                                      const at::Tensor& scale, const at::Tensor& found_inf);

// The non-empty pairs as contiguous tensors a kernel can run over with flat
// indices. A non-contiguous accumulator is replaced by a contiguous copy that
// write_back() copies into the original afterwards; a non-contiguous grad by a
// contiguous copy that lives as long as this object.
class DensePairs {
 public:
  DensePairs(at::TensorList accumulators, at::TensorList grads);

  size_t size() const { return acc_.size(); }
  const at::Tensor& acc(size_t i) const { return acc_[i]; }
  const at::Tensor& grad(size_t i) const { return grad_[i]; }

  // Copies the results of the contiguous stand-ins into the original accumulators
  // (on the current stream for CUDA tensors: ordered after the kernel).
  void write_back();

 private:
  std::vector<at::Tensor> acc_;
  std::vector<at::Tensor> grad_;
  std::vector<std::pair<at::Tensor, at::Tensor>> pending_;  // (original, contiguous copy)
};

}  // namespace mbs
