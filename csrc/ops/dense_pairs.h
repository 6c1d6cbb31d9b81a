// The non-empty (accumulator, grad) pairs of one call as tensors the kernels can run
// over with flat indices: dense memory in which element k of the accumulator and
// element k of the grad are the same logical element.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <deque>
#include <utility>
#include <vector>

namespace mbs {

// A pair of dense (non-overlapping, gap-free) tensors with the same strides is used as
// it is, whatever its layout (a channels_last weight and its gradient): elementwise work
// does not care about the order of memory, only that both sides share it. Otherwise a
// non-contiguous accumulator is replaced by a contiguous copy that write_back() copies
// into the original afterwards, and a non-contiguous grad by a contiguous copy that lives
// as long as this object. Tensors used as they are are referred to, not copied (a copy of
// a tensor that Python owns takes the GIL). Expects arguments that passed
// check_scale_accumulate_args and outlive this object.
class DensePairs {
 public:
  DensePairs(at::TensorList accumulators, at::TensorList grads);

  size_t size() const { return acc_.size(); }
  const at::Tensor& acc(size_t i) const { return *acc_[i]; }
  const at::Tensor& grad(size_t i) const { return *grad_[i]; }

  // Copies the results of the contiguous stand-ins into the original accumulators
  // (on the current stream for CUDA tensors: ordered after the kernel).
  void write_back();

 private:
  const at::Tensor* keep(at::Tensor copy);

  std::vector<const at::Tensor*> acc_;
  std::vector<const at::Tensor*> grad_;
  std::deque<at::Tensor> copies_;  // contiguous stand-ins (a deque: their addresses stay put)
  std::vector<std::pair<const at::Tensor*, const at::Tensor*>> pending_;  // (original, contiguous copy)
};

}  // namespace mbs
