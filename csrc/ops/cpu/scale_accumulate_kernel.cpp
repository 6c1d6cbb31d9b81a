// CPU kernel of mbs_ext::scale_accumulate_: one parallel pass over the elements of
// all pairs together (small tensors never serialize), arithmetic in accumulate/accumulate.h.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <optional>
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

// With sq_norm, the flat range is cut into fixed blocks of this many elements, each summing
// its squares on its own, and the blocks' sums are added in block order on the caller's
// thread: the sum does not depend on how many threads ran or which took which block, so a
// call gives the same sum every time. Threads still take kGrain elements at least.
constexpr int64_t kSquaresBlock = 1 << 16;
static_assert(kGrain % kSquaresBlock == 0, "a thread's grain is whole blocks");

double read_scale(const Scale& scale) {
  if (scale.tensor == nullptr) return scale.value;
  const at::Tensor& t = *scale.tensor;  // a CPU tensor here: no device sync
  return t.scalar_type() == at::kDouble ? *t.const_data_ptr<double>() : *t.const_data_ptr<float>();
}

// *sq_norm += squares, rounded once into its dtype.
void add_squares(const at::Tensor& sq_norm, double squares) {
  if (sq_norm.scalar_type() == at::kDouble) {
    *sq_norm.data_ptr<double>() += squares;
  } else {
    float* out = sq_norm.data_ptr<float>();
    *out = static_cast<float>(static_cast<double>(*out) + squares);
  }
}

// span(begin, end, block_sums) over [0, total) in blocks of kSquaresBlock, in parallel, each
// block summing N sums of its own; the blocks' sums added to `sums` in block order. Returns
// whether any span returned true.
template <size_t N, typename Span> bool in_blocks(int64_t total, std::array<double, N>& sums, Span&& span) {
  const int64_t blocks = (total + kSquaresBlock - 1) / kSquaresBlock;
  if (blocks <= kGrain / kSquaresBlock) {  // one thread's grain: this thread, blocks in order, no list
    bool bad = false;
    for (int64_t b = 0; b < blocks; ++b) {
      std::array<double, N> block{};
      const int64_t begin = b * kSquaresBlock;
      bad = span(begin, std::min(begin + kSquaresBlock, total), block) || bad;
      for (size_t i = 0; i < N; ++i) sums[i] += block[i];
    }
    return bad;
  }
  std::vector<std::array<double, N>> block_sums(static_cast<size_t>(blocks));
  std::atomic<bool> bad{false};
  at::parallel_for(0, blocks, kGrain / kSquaresBlock, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      std::array<double, N> block{};
      const int64_t begin = b * kSquaresBlock;
      if (span(begin, std::min(begin + kSquaresBlock, total), block)) bad.store(true, std::memory_order_relaxed);
      block_sums[static_cast<size_t>(b)] = block;
    }
  });
  for (const auto& block : block_sums) {
    for (size_t i = 0; i < N; ++i) sums[i] += block[i];
  }
  return bad.load();
}

void run_cpu(at::TensorList accumulators, at::TensorList grads, const Scale& scale, const at::Tensor& found_inf,
             const at::Tensor* sq_norm, c10::Device /*device*/) {
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
  bool bad = false;
  if (sq_norm == nullptr) {
    std::atomic<bool> any{false};
    at::parallel_for(0, flat.total(), kGrain, [&](int64_t begin, int64_t end) {
      if (flat.run(begin, end, s)) any.store(true, std::memory_order_relaxed);
    });
    bad = any.load();
  } else {
    std::array<double, 1> squares{};
    bad = in_blocks(flat.total(), squares, [&](int64_t begin, int64_t end, std::array<double, 1>& block) {
      return flat.run(begin, end, s, block[0]);
    });
    add_squares(*sq_norm, squares[0]);
  }
  dense.write_back();
  if (bad) found_inf.fill_(1.0);
}

void scale_accumulate_cpu(at::TensorList accumulators, at::TensorList grads, const at::Tensor& scale,
                          const at::Tensor& found_inf, const std::optional<at::Tensor>& sq_norm) {
  // Every check runs before the first element is read or written.
  const at::Tensor* sq = sq_norm.has_value() ? &*sq_norm : nullptr;
  const c10::Device device =
      check_scale_accumulate_args(accumulators, grads, scale, found_inf, sq, c10::DeviceType::CPU);
  run_cpu(accumulators, grads, Scale{&scale, 0.0}, found_inf, sq, device);
}

}  // namespace

void sum_squares_cpu(at::TensorList tensors, const at::Tensor& sq_norm, const at::Tensor& found_inf) {
  std::vector<accumulate::Pair> pairs;
  pairs.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    const accumulate::DType dtype = *float_dtype(t.scalar_type());
    pairs.push_back({nullptr, t.const_data_ptr(), t.numel(), dtype, dtype});
  }
  const accumulate::FlatPairs flat(std::move(pairs));
  std::array<double, 1> squares{};
  const bool bad = in_blocks(flat.total(), squares, [&](int64_t begin, int64_t end, std::array<double, 1>& block) {
    return flat.read(begin, end, block[0]);
  });
  add_squares(sq_norm, squares[0]);
  if (bad) found_inf.fill_(1.0);
}

void add_squares_cpu(at::TensorList accumulators, at::TensorList grads, const at::Tensor& sq_norm,
                     const at::Tensor* acc_sq_norm, const at::Tensor& found_inf) {
  std::vector<accumulate::Pair> pairs;
  pairs.reserve(accumulators.size());
  for (size_t i = 0; i < accumulators.size(); ++i) {
    pairs.push_back({accumulators[i].data_ptr(), grads[i].const_data_ptr(), accumulators[i].numel(),
                     *float_dtype(accumulators[i].scalar_type()), *float_dtype(grads[i].scalar_type())});
  }
  const accumulate::FlatPairs flat(std::move(pairs));
  bool bad = false;
  if (acc_sq_norm == nullptr) {
    std::array<double, 1> squares{};
    bad = in_blocks(flat.total(), squares, [&](int64_t begin, int64_t end, std::array<double, 1>& block) {
      return flat.run(begin, end, 1.0, block[0]);
    });
    add_squares(sq_norm, squares[0]);
  } else {
    std::array<double, 2> squares{};
    bad = in_blocks(flat.total(), squares, [&](int64_t begin, int64_t end, std::array<double, 2>& block) {
      return flat.run(begin, end, 1.0, block[0], block[1]);
    });
    add_squares(sq_norm, squares[0]);
    add_squares(*acc_sq_norm, squares[1]);
  }
  if (bad) found_inf.fill_(1.0);
}

namespace {

[[maybe_unused]] const bool registered = register_kernel(c10::DeviceType::CPU, &run_cpu);

}  // namespace
}  // namespace mbs

TORCH_LIBRARY_IMPL(mbs_ext, CPU, m) { m.impl("scale_accumulate_", &mbs::scale_accumulate_cpu); }
