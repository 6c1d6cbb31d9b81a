// Shared argument checks for mbs_ext::scale_accumulate_ (CPU and CUDA kernels).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace mbs {

// Validates the op's arguments; errors name the argument and what was expected.
// Returns the device the pairs live on (scale's device when there are no pairs).
c10::Device check_scale_accumulate_args(at::TensorList accumulators, at::TensorList grads,
                                        const at::Tensor& scale, const at::Tensor& found_inf);

bool is_supported_float(at::ScalarType t);

}  // namespace mbs
