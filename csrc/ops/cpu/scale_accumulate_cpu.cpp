// CPU kernel of mbs_ext::scale_accumulate_: one parallel pass over the elements of
// all pairs together (small tensors never serialize), arithmetic in native/accumulate.h.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>

#include "native/accumulate.h"
#include "ops/scale_accumulate.h"

namespace mbs {
namespace {

native::DType native_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return native::DType::f32;
    case at::kDouble: return native::DType::f64;
    case at::kBFloat16: return native::DType::bf16;
    case at::kHalf: return native::DType::f16;
    default: TORCH_CHECK_TYPE(false, "scale_accumulate_: unsupported dtype ", t);
  }
}

// Elements per task: large enough to amortize scheduling, small enough that a
// few hundred small tensors still spread over all threads.
constexpr int64_t kGrain = 1 << 15;

void scale_accumulate_cpu(at::TensorList accumulators, at::TensorList grads, const at::Tensor& scale,
                          const at::Tensor& found_inf) {
  check_scale_accumulate_args(accumulators, grads, scale, found_inf);
  TORCH_CHECK_VALUE(found_inf.device().is_cpu(), "scale_accumulate_: found_inf must be on cpu");
  if (accumulators.empty()) return;
  const double s = scale.item<double>();

  std::vector<native::Pair> pairs;
  std::vector<at::Tensor> keep;  // contiguous copies that must outlive the pass
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back;
  pairs.reserve(accumulators.size());
  for (size_t i = 0; i < accumulators.size(); ++i) {
    at::Tensor acc = accumulators[i];
    if (acc.numel() == 0) continue;
    at::Tensor grad = grads[i].contiguous();
    if (!acc.is_contiguous()) {
      at::Tensor dense = acc.contiguous();
      write_back.emplace_back(acc, dense);
      acc = dense;
    }
    keep.push_back(grad);
    pairs.push_back({acc.data_ptr(), grad.const_data_ptr(), acc.numel(),
                     native_dtype(acc.scalar_type()), native_dtype(grad.scalar_type())});
  }
  const native::FlatPairs flat(std::move(pairs));
  std::atomic<bool> bad{false};
  at::parallel_for(0, flat.total(), kGrain, [&](int64_t begin, int64_t end) {
    if (flat.run(begin, end, s)) bad.store(true, std::memory_order_relaxed);
  });
  for (auto& [target, dense] : write_back) target.copy_(dense);
  if (bad.load()) found_inf.fill_(1.0);
}

}  // namespace
}  // namespace mbs

TORCH_LIBRARY_IMPL(mbs_ext, CPU, m) { m.impl("scale_accumulate_", &mbs::scale_accumulate_cpu); }
