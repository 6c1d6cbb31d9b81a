#include "ops/dense_pairs.h"

namespace mbs {

DensePairs::DensePairs(at::TensorList accumulators, at::TensorList grads) {
  acc_.reserve(accumulators.size());
  grad_.reserve(grads.size());
  for (size_t i = 0; i < accumulators.size(); ++i) {
    if (accumulators[i].numel() == 0) continue;
    at::Tensor acc = accumulators[i];
    if (!acc.is_contiguous() && acc.is_non_overlapping_and_dense() && grads[i].strides() == acc.strides()) {
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
