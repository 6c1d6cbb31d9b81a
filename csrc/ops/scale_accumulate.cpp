// Schema of mbs_ext::scale_accumulate_ and the argument checks both kernels share.
#include "ops/scale_accumulate.h"

#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

namespace mbs {
namespace {

std::string name_of(const Extent& e) {
  static const char* const names[] = {"accumulators", "grads", "found_inf", "scale"};
  return e.list < 2 ? std::string(names[e.list]) + "[" + std::to_string(e.index) + "]" : names[e.list];
}

}  // namespace

Extent extent_of(const at::Tensor& t, int64_t list, int64_t index) {
  // Torch strides are never negative: the element farthest from data_ptr is at
  // sum((size - 1) * stride).
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const auto begin = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  const auto bytes = static_cast<uintptr_t>((last + 1) * static_cast<int64_t>(t.element_size()));
  return {begin, begin + bytes, list, index};
}

// Sorted sweep: any overlap involving a written extent shows up against the extent
// with the largest end seen so far.
std::optional<std::pair<Extent, Extent>> first_overlap(std::vector<Extent>& extents) {
  std::sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
  const Extent* reach = nullptr;  // the extent seen so far that ends last
  for (const Extent& e : extents) {
    if (reach != nullptr && e.begin < reach->end && (e.written() || reach->written())) {
      return std::make_pair(*reach, e);
    }
    if (reach == nullptr || e.end > reach->end) reach = &e;
  }
  return std::nullopt;
}

std::optional<std::pair<Extent, Extent>> find_overlap(at::TensorList accumulators, at::TensorList grads,
                                                      const at::Tensor& scale, const at::Tensor& found_inf) {
  std::vector<Extent> extents;
  extents.reserve(2 * accumulators.size() + 2);
  for (size_t i = 0; i < accumulators.size() && i < grads.size(); ++i) {
    if (accumulators[i].numel() == 0) continue;
    extents.push_back(extent_of(accumulators[i], 0, static_cast<int64_t>(i)));
    extents.push_back(extent_of(grads[i], 1, static_cast<int64_t>(i)));
  }
  extents.push_back(extent_of(found_inf, 2, 0));
  if (scale.device() == found_inf.device()) extents.push_back(extent_of(scale, 3, 0));
  return first_overlap(extents);
}

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

c10::Device check_scale_accumulate_args(at::TensorList accumulators, at::TensorList grads,
                                        const at::Tensor& scale, const at::Tensor& found_inf,
                                        c10::DeviceType kernel_device) {
  // Lengths before anything is indexed.
  TORCH_CHECK_VALUE(accumulators.size() == grads.size(),
                    "scale_accumulate_: accumulators and grads must have the same length, got ",
                    accumulators.size(), " accumulators and ", grads.size(), " grads");

  TORCH_CHECK_VALUE(found_inf.defined(), "scale_accumulate_: found_inf is an undefined tensor");
  TORCH_CHECK_TYPE(found_inf.layout() == at::kStrided, "scale_accumulate_: found_inf must be a dense tensor, got ",
                   found_inf.layout());
  TORCH_CHECK_VALUE(found_inf.dim() == 0 && found_inf.scalar_type() == at::kFloat,
                    "scale_accumulate_: found_inf must be a 0-dim float32 tensor, got ",
                    found_inf.scalar_type(), " of shape ", found_inf.sizes());
  TORCH_CHECK_VALUE(scale.defined(), "scale_accumulate_: scale is an undefined tensor");
  TORCH_CHECK_TYPE(scale.layout() == at::kStrided, "scale_accumulate_: scale must be a dense tensor, got ",
                   scale.layout());
  TORCH_CHECK_VALUE(scale.dim() == 0, "scale_accumulate_: scale must be a 0-dim tensor, got shape ",
                    scale.sizes());
  TORCH_CHECK_TYPE(scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kDouble,
                   "scale_accumulate_: scale must be float32 or float64, got ", scale.scalar_type());

  if (!accumulators.empty()) {
    TORCH_CHECK_VALUE(accumulators[0].defined(), "scale_accumulate_: accumulators[0] is an undefined tensor");
  }
  const c10::Device device = accumulators.empty() ? found_inf.device() : accumulators[0].device();
  // The dispatcher picks the kernel from the highest-priority device among all
  // tensor arguments; a kernel must never be handed tensors of another device type.
  TORCH_CHECK_VALUE(device.type() == kernel_device, "scale_accumulate_: the ",
                    c10::DeviceTypeName(kernel_device), " kernel was called with tensors on ", device,
                    "; every tensor argument must be on one device (scale may also be a CPU scalar)");

  for (size_t i = 0; i < accumulators.size(); ++i) {
    const at::Tensor& acc = accumulators[i];
    const at::Tensor& grad = grads[i];
    TORCH_CHECK_VALUE(acc.defined(), "scale_accumulate_: accumulators[", i, "] is an undefined tensor");
    TORCH_CHECK_VALUE(grad.defined(), "scale_accumulate_: grads[", i, "] is an undefined tensor");
    TORCH_CHECK_TYPE(acc.layout() == at::kStrided, "scale_accumulate_: accumulators[", i,
                     "] must be a dense tensor, got ", acc.layout());
    TORCH_CHECK_TYPE(grad.layout() == at::kStrided, "scale_accumulate_: grads[", i,
                     "] must be a dense tensor, got ", grad.layout());
    TORCH_CHECK_TYPE(is_supported_float(acc.scalar_type()), "scale_accumulate_: accumulators[", i,
                     "] must be float32, float64, bfloat16 or float16, got ", acc.scalar_type());
    TORCH_CHECK_TYPE(is_supported_float(grad.scalar_type()), "scale_accumulate_: grads[", i,
                     "] must be float32, float64, bfloat16 or float16, got ", grad.scalar_type());
    TORCH_CHECK_VALUE(acc.sizes() == grad.sizes(), "scale_accumulate_: accumulators[", i, "] has shape ",
                      acc.sizes(), " but grads[", i, "] has shape ", grad.sizes());
    TORCH_CHECK_VALUE(acc.device() == device, "scale_accumulate_: accumulators[", i, "] is on ", acc.device(),
                      " but accumulators[0] is on ", device);
    TORCH_CHECK_VALUE(grad.device() == device, "scale_accumulate_: grads[", i, "] is on ", grad.device(),
                      " but accumulators[0] is on ", device);
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(acc.const_data_ptr()) % acc.element_size() == 0,
                      "scale_accumulate_: accumulators[", i, "] data is not aligned to its element size");
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(grad.const_data_ptr()) % grad.element_size() == 0,
                      "scale_accumulate_: grads[", i, "] data is not aligned to its element size");
    TORCH_CHECK_VALUE(at::has_internal_overlap(acc) != at::MemOverlap::Yes, "scale_accumulate_: accumulators[",
                      i, "] has elements that share memory (e.g. an expanded tensor) and cannot be written in place");
  }
  TORCH_CHECK_VALUE(found_inf.device() == device, "scale_accumulate_: found_inf is on ", found_inf.device(),
                    " but the tensors are on ", device);
  TORCH_CHECK_VALUE(scale.device() == device || scale.device().is_cpu(), "scale_accumulate_: scale is on ",
                    scale.device(), " but must be on ", device, " or be a CPU scalar");

  const auto overlap = find_overlap(accumulators, grads, scale, found_inf);
  TORCH_CHECK_VALUE(!overlap, "scale_accumulate_: ", overlap ? name_of(overlap->first) : "", " and ",
                    overlap ? name_of(overlap->second) : "",
                    " may share memory; accumulators and found_inf must not overlap any other argument");
  return device;
}

DensePairs::DensePairs(at::TensorList accumulators, at::TensorList grads) {
  TORCH_CHECK(accumulators.size() == grads.size(), "scale_accumulate_: length mismatch");
  acc_.reserve(accumulators.size());
  grad_.reserve(grads.size());
  for (size_t i = 0; i < accumulators.size(); ++i) {
    if (accumulators[i].numel() == 0) continue;
    at::Tensor acc = accumulators[i];
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

TORCH_LIBRARY(mbs_ext, m) {
  m.def(
      "scale_accumulate_(Tensor(a!)[] accumulators, Tensor[] grads, Tensor scale, "
      "Tensor(b!) found_inf) -> ()");
}
