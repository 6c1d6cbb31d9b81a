// CPU kernel of mbs_ext::scale_accumulate_: one parallel pass over the elements of
// all pairs together (small tensors never serialize), arithmetic in accumulate/accumulate.h.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <vector>

#include "accumulate/accumulate.h"
#include "ops/arguments.h"
#include "ops/dense_pairs.h"

namespace mbs {
namespace {

// Elements per task: large enough to amortize scheduling, small enough that a
// few hundred small tensors still spread over all threads.
constexpr int64_t kGrain = 1 << 15;

void scale_accumulate_cpu(at::TensorList accumulators, at::TensorList grads, const at::Tensor& scale,
                          const at::Tensor& found_inf) {
  // Every check runs before the first element is read or written.
  check_scale_accumulate_args(accumulators, grads, scale, found_inf, c10::DeviceType::CPU);
  if (accumulators.empty()) return;
  const double s = scale.item<double>();  // a CPU tensor here: no device sync

  DensePairs dense(accumulators, grads);
  std::vector<accumulate::Pair> pairs;
  pairs.reserve(dense.size());
  for (size_t i = 0; i < dense.size(); ++i) {
    const at::Tensor& acc = dense.acc(i);
    const at::Tensor& grad = dense.grad(i);
    pairs.push_back({acc.data_ptr(), grad.const_data_ptr(), acc.numel(), *float_dtype(acc.scalar_type()),
                     *float_dtype(grad.scalar_type())});
  }
  const accumulate::FlatPairs flat(std::move(pairs));
  std::atomic<bool> bad{false};
  at::parallel_for(0, flat.total(), kGrain, [&](int64_t begin, int64_t end) {
    if (flat.run(begin, end, s)) bad.store(true, std::memory_order_relaxed);
  });
  dense.write_back();
  if (bad.load()) found_inf.fill_(1.0);
}

}  // namespace
}  // namespace mbs

TORCH_LIBRARY_IMPL(mbs_ext, CPU, m) { m.impl("scale_accumulate_", &mbs::scale_accumulate_cpu); }
