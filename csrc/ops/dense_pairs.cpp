#include "ops/dense_pairs.h"

namespace mbs {

namespace {

// Whether element k sits at the same offset in both tensors (same sizes): strides agree on
// every dimension that has more than one index (a size-1 dimension's stride is arbitrary).
bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) != 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

}  // namespace

const at::Tensor* DensePairs::keep(at::Tensor copy) {
  copies_.push_back(std::move(copy));
  return &copies_.back();
}

DensePairs::DensePairs(at::TensorList accumulators, at::TensorList grads) {
  acc_.reserve(accumulators.size());
  grad_.reserve(grads.size());
  for (size_t i = 0; i < accumulators.size(); ++i) {
    const at::Tensor& acc = accumulators[i];
    const at::Tensor& grad = grads[i];
    if (acc.numel() == 0) continue;
    if (!acc.is_contiguous() && acc.is_non_overlapping_and_dense() && same_layout(acc, grad)) {
      acc_.push_back(&acc);  // one dense layout on both sides
      grad_.push_back(&grad);
      continue;
    }
    if (acc.is_contiguous()) {
      acc_.push_back(&acc);
    } else {
      const at::Tensor* dense = keep(acc.contiguous());
      pending_.emplace_back(&acc, dense);
      acc_.push_back(dense);
    }
    grad_.push_back(grad.is_contiguous() ? &grad : keep(grad.contiguous()));
  }
}

void DensePairs::write_back() {
  for (const auto& [target, dense] : pending_) target->copy_(*dense);
  pending_.clear();
}

}  // namespace mbs
