// The op's kernels behind their checks, by device type. Each kernel file registers its own
// beside its TORCH_LIBRARY_IMPL (which checks the arguments, then runs it); the Python face
// runs one directly for an eager call it has checked (ops/bindings.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace mbs {

// A 0-dim float32/float64 tensor on the tensors' device or the CPU, or (tensor null) a value.
struct Scale {
  const at::Tensor* tensor;
  double value;
};

// Arguments that passed check_scale_accumulate_args (ops/arguments.h); `device` is the tensors'.
// sq_norm: null, or a 0-dim float32/float64 tensor to which the kernel adds the sum of the
// squares of every grad element (in the same pass over the grads).
using Kernel = void (*)(at::TensorList accumulators, at::TensorList grads, const Scale& scale,
                        const at::Tensor& found_inf, const at::Tensor* sq_norm, c10::Device device);

// Called once per device type, at static initialization; returns true for use as an initializer.
bool register_kernel(c10::DeviceType type, Kernel kernel);
// nullptr when this build has no kernel for `type`.
Kernel kernel_for(c10::DeviceType type);

// sq_norm += the sum of the squares of every element of `tensors` (dense CPU float tensors;
// sq_norm a 0-dim float64 or float32 CPU tensor), as the op sums its grads' squares; found_inf
// (0-dim float32) set to 1.0 when an element is inf or NaN. One read: the squared norm of
// the accumulated sums and their non-finite check at once (mbs_ext/model/grads.py).
void sum_squares_cpu(at::TensorList tensors, const at::Tensor& sq_norm, const at::Tensor& found_inf);
// accumulators[i] += grads[i] (dense CPU pairs of one layout), sq_norm += the squares of the grads
// as the op sums them; found_inf set where a grad is inf or NaN. With acc_sq_norm (else null), also
// acc_sq_norm += the squares of the accumulators as read, before the update, and found_inf set
// where one is inf or NaN: the first addition into a sum that is still a gradient as it was taken
// gives that gradient's squares in the same pass. Only then: on a sum no longer in the caches the
// pass is bound by the loads in flight, and the accumulators' squares cost it 10-15% more.
void add_squares_cpu(at::TensorList accumulators, at::TensorList grads, const at::Tensor& sq_norm,
                     const at::Tensor* acc_sq_norm, const at::Tensor& found_inf);

}  // namespace mbs
