// Schema of the mbs_ext ops and the argument checks both backends share.
#include "ops/scale_accumulate.h"

#include <torch/library.h>

namespace mbs {

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

c10::Device check_scale_accumulate_args(at::TensorList accumulators, at::TensorList grads,
                                        const at::Tensor& scale, const at::Tensor& found_inf) {
  TORCH_CHECK_VALUE(accumulators.size() == grads.size(),
                    "scale_accumulate_: accumulators and grads must have the same length, got ",
                    accumulators.size(), " accumulators and ", grads.size(), " grads");
  TORCH_CHECK_VALUE(scale.dim() == 0, "scale_accumulate_: scale must be a 0-dim tensor, got shape ",
                    scale.sizes());
  TORCH_CHECK_TYPE(scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kDouble,
                   "scale_accumulate_: scale must be float32 or float64, got ", scale.scalar_type());
  TORCH_CHECK_VALUE(found_inf.dim() == 0 && found_inf.scalar_type() == at::kFloat,
                    "scale_accumulate_: found_inf must be a 0-dim float32 tensor, got ",
                    found_inf.scalar_type(), " of shape ", found_inf.sizes());
  const c10::Device device = accumulators.empty() ? found_inf.device() : accumulators[0].device();
  for (size_t i = 0; i < accumulators.size(); ++i) {
    const at::Tensor& acc = accumulators[i];
    const at::Tensor& grad = grads[i];
    TORCH_CHECK_TYPE(is_supported_float(acc.scalar_type()), "scale_accumulate_: accumulators[", i,
                     "] must be float32, float64, bfloat16 or float16, got ", acc.scalar_type());
    TORCH_CHECK_TYPE(is_supported_float(grad.scalar_type()), "scale_accumulate_: grads[", i,
                     "] must be float32, float64, bfloat16 or float16, got ", grad.scalar_type());
    TORCH_CHECK_VALUE(acc.sizes() == grad.sizes(), "scale_accumulate_: accumulators[", i,
                      "] has shape ", acc.sizes(), " but grads[", i, "] has shape ", grad.sizes());
    TORCH_CHECK_VALUE(acc.device() == device, "scale_accumulate_: accumulators[", i, "] is on ",
                      acc.device(), " but accumulators[0] is on ", device);
    TORCH_CHECK_VALUE(grad.device() == device, "scale_accumulate_: grads[", i, "] is on ",
                      grad.device(), " but accumulators are on ", device);
  }
  TORCH_CHECK_VALUE(found_inf.device() == device, "scale_accumulate_: found_inf is on ",
                    found_inf.device(), " but the tensors are on ", device);
  TORCH_CHECK_VALUE(scale.device() == device || scale.device().is_cpu(),
                    "scale_accumulate_: scale must be on ", device, " (or a CPU scalar), got ",
                    scale.device());
  return device;
}

}  // namespace mbs

TORCH_LIBRARY(mbs_ext, m) {
  m.def(
      "scale_accumulate_(Tensor(a!)[] accumulators, Tensor[] grads, Tensor scale, "
      "Tensor(b!) found_inf) -> ()");
}
