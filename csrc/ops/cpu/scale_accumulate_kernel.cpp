// CPU kernel of mbs_ext::scale_accumulate_: one parallel pass over the elements of
// all pairs together (small tensors never serialize), arithmetic in accumulate/accumulate.h.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <vector>

#include "accumulate/accumulate.h"
#include "ops/arguments.h"
#include "ops/dense_pairs.h"
#include "ops/kernels.h"

namespace mbs {
namespace {

// Elements per thread at least: 2^18 (3 MB of float32 traffic, ~100 us) amortizes waking
// the thread pool, which costs microseconds on an idle machine and milliseconds where the
// cores are shared; smaller calls (a ResNet's list of small tensors) run on the caller's
// thread, as torch._foreach_add_ does with small tensors.
constexpr int64_t kGrain = 1 << 18;

double read_scale(const Scale& scale) {
  if (scale.tensor == nullptr) return scale.value;
  const at::Tensor& t = *scale.tensor;  // a CPU tensor here: no device sync
  return t.scalar_type() == at::kDouble ? *t.const_data_ptr<double>() : *t.const_data_ptr<float>();
}

void run_cpu(at::TensorList accumulators, at::TensorList grads, const Scale& scale, const at::Tensor& found_inf,
             c10::Device /*device*/) {
  if (accumulators.empty()) return;
  const double s = read_scale(scale);

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

void scale_accumulate_cpu(at::TensorList accumulators, at::TensorList grads, const at::Tensor& scale,
                          const at::Tensor& found_inf) {
  // Every check runs before the first element is read or written.
  const c10::Device device = check_scale_accumulate_args(accumulators, grads, scale, found_inf, c10::DeviceType::CPU);
  run_cpu(accumulators, grads, Scale{&scale, 0.0}, found_inf, device);
}

[[maybe_unused]] const bool registered = register_kernel(c10::DeviceType::CPU, &run_cpu);

}  // namespace
}  // namespace mbs

TORCH_LIBRARY_IMPL(mbs_ext, CPU, m) { m.impl("scale_accumulate_", &mbs::scale_accumulate_cpu); }
