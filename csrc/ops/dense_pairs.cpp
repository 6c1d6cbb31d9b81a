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

DensePairs::DensePairs(at::TensorList accumulators, at::TensorList grads) {
  acc_.reserve(accumulators.size());
  grad_.reserve(grads.size());
  for (size_t i = 0; i < accumulators.size(); ++i) {
    if (accumulators[i].numel() == 0) continue;
    at::Tensor acc = accumulators[i];
    if (!acc.is_contiguous() && acc.is_non_overlapping_and_dense() && same_layout(acc, grads[i])) {
      acc_.push_back(acc);
      grad_.push_back(grads[i]);
      continue;
    }
    if (!acc.is_contiguous()) {
      at::Tensor dense = acc.contiguous();
      pending_.emplace_back(acc, dense);
      acc = std::move(dense);
    }
    acc_.push_back(std::move(acc));
    grad_.push_back(grads[i].contiguous());
  }
}

void DensePairs::write_back() {
  for (auto& [target, dense] : pending_) target.copy_(dense);
  pending_.clear();
}

}  // namespace mbs
