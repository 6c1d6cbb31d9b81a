#include "ops/arguments.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/StringUtil.h>

#include <algorithm>

namespace mbs {
namespace {

template <typename... Args> Fault type_fault(const Args&... args) { return {Fault::Kind::Type, c10::str(args...)}; }
template <typename... Args> Fault value_fault(const Args&... args) { return {Fault::Kind::Value, c10::str(args...)}; }

bool aligned(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % t.element_size() == 0;
}

// One list element; `list` is "accumulators" or "grads".
MaybeFault tensor_fault(const at::Tensor& t, const char* list, size_t i, c10::Device device, bool grad_mode) {
  if (!t.defined()) return value_fault(list, "[", i, "] is an undefined tensor");
  if (t.layout() != at::kStrided) {
    return type_fault(list, "[", i, "] must be a dense (strided) tensor, got layout ", t.layout());
  }
  if (!float_dtype(t.scalar_type())) {
    return type_fault(list, "[", i, "] must be float32, float64, bfloat16 or float16, got ", t.scalar_type());
  }
  if (t.device() != device) return value_fault(list, "[", i, "] is on ", t.device(), " but accumulators[0] is on ", device);
  if (grad_mode && t.requires_grad()) {
    // The op is not differentiable and writes in place outside autograd.
    return value_fault(list, "[", i, "] requires grad; scale_accumulate_ is not differentiable: pass .grad tensors ",
                       "or detached buffers, or call it under torch.no_grad()");
  }
  if (!aligned(t)) return value_fault(list, "[", i, "] data is not aligned to its element size");
  return std::nullopt;
}

const char* list_name(int64_t list) {
  static const char* const names[] = {"accumulators", "grads", "found_inf", "scale"};
  return names[list];
}

std::string name_of(const Extent& e) {
  return e.list <= Extent::kGrads ? c10::str(list_name(e.list), "[", e.index, "]") : list_name(e.list);
}

Extent extent_of(const at::Tensor& t, int64_t list, int64_t index) {
  // Torch strides are never negative: the element farthest from data_ptr is at
  // sum((size - 1) * stride).
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const auto begin = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  const auto bytes = static_cast<uintptr_t>((last + 1) * static_cast<int64_t>(t.element_size()));
  return {begin, begin + bytes, list, index};
}

void raise(const MaybeFault& fault) {
  if (!fault) return;
  TORCH_CHECK_TYPE(fault->kind != Fault::Kind::Type, "scale_accumulate_: ", fault->message);
  TORCH_CHECK_VALUE(false, "scale_accumulate_: ", fault->message);
}

}  // namespace

std::optional<accumulate::DType> float_dtype(at::ScalarType t) {
  using accumulate::DType;
  switch (t) {
    case at::kFloat: return DType::f32;
    case at::kDouble: return DType::f64;
    case at::kBFloat16: return DType::bf16;
    case at::kHalf: return DType::f16;
    default: return std::nullopt;
  }
}

MaybeFault lengths_fault(size_t accumulators, size_t grads) {
  if (accumulators == grads) return std::nullopt;
  return value_fault("accumulators and grads must have the same length, got ", accumulators, " accumulators and ",
                     grads, " grads");
}

MaybeFault device_fault(c10::Device device, const char* owner) {
  if (device.is_cpu() || device.is_cuda()) return std::nullopt;
  return value_fault(owner, " is on ", device, "; scale_accumulate_ runs on cpu and cuda tensors");
}

MaybeFault pair_fault(const at::Tensor& acc, const at::Tensor& grad, size_t i, c10::Device device, bool grad_mode) {
  if (auto fault = tensor_fault(acc, "accumulators", i, device, grad_mode)) return fault;
  if (auto fault = tensor_fault(grad, "grads", i, device, grad_mode)) return fault;
  if (acc.sizes() != grad.sizes()) {
    return value_fault("accumulators[", i, "] has shape ", acc.sizes(), " but grads[", i, "] has shape ", grad.sizes());
  }
  if (at::has_internal_overlap(acc) == at::MemOverlap::Yes) {
    return value_fault("accumulators[", i, "] has elements that share memory (an expanded tensor) and cannot be ",
                       "written in place");
  }
  return std::nullopt;
}

MaybeFault found_inf_fault(const at::Tensor& found_inf) {
  if (!found_inf.defined()) return value_fault("found_inf is an undefined tensor");
  if (found_inf.layout() != at::kStrided) return type_fault("found_inf must be a dense tensor, got ", found_inf.layout());
  if (found_inf.dim() != 0 || found_inf.scalar_type() != at::kFloat) {
    return value_fault("found_inf must be a 0-dim float32 tensor, got ", found_inf.scalar_type(), " of shape ",
                       found_inf.sizes());
  }
  return std::nullopt;
}

MaybeFault scale_fault(const at::Tensor& scale) {
  if (!scale.defined()) return value_fault("scale is an undefined tensor");
  if (scale.layout() != at::kStrided) return type_fault("scale must be a dense tensor, got ", scale.layout());
  if (scale.dim() != 0) return value_fault("scale must be a 0-dim tensor, got shape ", scale.sizes());
  if (scale.scalar_type() != at::kFloat && scale.scalar_type() != at::kDouble) {
    return type_fault("scale must be float32 or float64, got ", scale.scalar_type());
  }
  return std::nullopt;
}

MaybeFault placement_fault(const at::Tensor& scale, const at::Tensor& found_inf, c10::Device device) {
  if (found_inf.device() != device) {
    return value_fault("found_inf is on ", found_inf.device(), " but the tensors are on ", device);
  }
  if (scale.device() != device && !scale.device().is_cpu()) {
    return value_fault("scale is on ", scale.device(), " but must be on ", device, " or be a CPU scalar");
  }
  return std::nullopt;
}

void Extents::add_pair(const at::Tensor& acc, const at::Tensor& grad, size_t i) {
  if (acc.numel() == 0) return;
  extents_.push_back(extent_of(acc, Extent::kAccumulators, static_cast<int64_t>(i)));
  extents_.push_back(extent_of(grad, Extent::kGrads, static_cast<int64_t>(i)));
}

void Extents::add_scalars(const at::Tensor& scale, const at::Tensor& found_inf) {
  extents_.push_back(extent_of(found_inf, Extent::kFoundInf, 0));
  if (scale.device() == found_inf.device()) extents_.push_back(extent_of(scale, Extent::kScale, 0));
}

// Sorted sweep: any overlap involving a written extent shows up against the extent
// with the largest end seen so far.
std::optional<std::pair<Extent, Extent>> Extents::first_overlap() {
  std::sort(extents_.begin(), extents_.end(), [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
  const Extent* reach = nullptr;  // the extent seen so far that ends last
  for (const Extent& e : extents_) {
    if (reach != nullptr && e.begin < reach->end && (e.written() || reach->written())) {
      return std::make_pair(*reach, e);
    }
    if (reach == nullptr || e.end > reach->end) reach = &e;
  }
  return std::nullopt;
}

Fault Extents::fault(const std::pair<Extent, Extent>& overlap) {
  return value_fault(name_of(overlap.first), " and ", name_of(overlap.second),
                     " may share memory; accumulators and found_inf must not overlap any other argument");
}

c10::Device check_scale_accumulate_args(at::TensorList accumulators, at::TensorList grads,
                                        const at::Tensor& scale, const at::Tensor& found_inf,
                                        c10::DeviceType kernel_device) {
  raise(lengths_fault(accumulators.size(), grads.size()));  // before any element is indexed
  raise(found_inf_fault(found_inf));
  raise(scale_fault(scale));
  if (!accumulators.empty() && !accumulators[0].defined()) {
    raise(pair_fault(accumulators[0], grads[0], 0, found_inf.device(), false));
  }
  const c10::Device device = accumulators.empty() ? found_inf.device() : accumulators[0].device();
  TORCH_CHECK_VALUE(device.type() == kernel_device, "scale_accumulate_: the ", c10::DeviceTypeName(kernel_device),
                    " kernel was called with tensors on ", device,
                    "; every tensor argument must be on one device (scale may also be a CPU scalar)");
  // Below the autograd layer: whether a tensor requires grad is not the kernel's concern.
  for (size_t i = 0; i < accumulators.size(); ++i) raise(pair_fault(accumulators[i], grads[i], i, device, false));
  raise(placement_fault(scale, found_inf, device));
  Extents extents(accumulators.size());
  for (size_t i = 0; i < accumulators.size(); ++i) extents.add_pair(accumulators[i], grads[i], i);
  extents.add_scalars(scale, found_inf);
  if (const auto overlap = extents.first_overlap()) raise(Extents::fault(*overlap));
  return device;
}

}  // namespace mbs
