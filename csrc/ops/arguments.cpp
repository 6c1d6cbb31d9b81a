#include "ops/arguments.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace mbs {
namespace {

template <typename... Args> Fault type_fault(const Args&... args) { return {Fault::Kind::Type, c10::str(args...)}; }
template <typename... Args> Fault value_fault(const Args&... args) { return {Fault::Kind::Value, c10::str(args...)}; }

bool aligned(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % t.element_size() == 0;
}

// An element that is no tensor: a Python object of another type, or (from C++) undefined.
Fault missing_fault(const char* list, size_t i, const NotTensor& not_tensor) {
  if (not_tensor.index == i) return type_fault(list, "[", i, "] must be a torch.Tensor, got ", not_tensor.type_name);
  return value_fault(list, "[", i, "] is an undefined tensor");
}

// One list element; `list` is "accumulators" or "grads".
MaybeFault tensor_fault(const at::Tensor& t, const char* list, size_t i, const NotTensor& not_tensor,
                        c10::Device device, const Sight& sight) {
  if (!t.defined()) return missing_fault(list, i, not_tensor);
  if (t.layout() != at::kStrided) {
    return type_fault(list, "[", i, "] must be a dense (strided) tensor, got layout ", t.layout());
  }
  if (!float_dtype(t.scalar_type())) {
    return type_fault(list, "[", i, "] must be float32, float64, bfloat16 or float16, got ", t.scalar_type());
  }
  if (t.device() != device) return value_fault(list, "[", i, "] is on ", t.device(), " but accumulators[0] is on ", device);
  if (sight.grad_mode && t.requires_grad()) {
    // The op is not differentiable and writes in place outside autograd.
    return value_fault(list, "[", i, "] requires grad; scale_accumulate_ is not differentiable: pass .grad tensors ",
                       "or detached buffers, or call it under torch.no_grad()");
  }
  if (sight.data && !aligned(t)) return value_fault(list, "[", i, "] data is not aligned to its element size");
  return std::nullopt;
}

MaybeFault pair_fault(const Arguments& args, size_t i, c10::Device device, const Sight& sight) {
  const at::Tensor& acc = args.accumulators[i];
  const at::Tensor& grad = args.grads[i];
  if (auto fault = tensor_fault(acc, "accumulators", i, args.accumulators_not_tensor, device, sight)) return fault;
  if (auto fault = tensor_fault(grad, "grads", i, args.grads_not_tensor, device, sight)) return fault;
  // sym_sizes: fake tensors may have symbolic shapes (the comparison becomes a guard).
  if (acc.sym_sizes() != grad.sym_sizes()) {
    return value_fault("accumulators[", i, "] has shape ", acc.sym_sizes(), " but grads[", i, "] has shape ",
                       grad.sym_sizes());
  }
  if (at::has_internal_overlap(acc) == at::MemOverlap::Yes) {
    return value_fault("accumulators[", i, "] has elements that share memory (an expanded tensor) and cannot be ",
                       "written in place");
  }
  return std::nullopt;
}

MaybeFault found_inf_fault(const Arguments& args, const Sight& sight) {
  if (args.found_inf_not_tensor != nullptr) {
    return type_fault("found_inf must be a 0-dim float32 tensor or None, got ", args.found_inf_not_tensor);
  }
  if (args.found_inf == nullptr) return std::nullopt;
  const at::Tensor& found_inf = *args.found_inf;
  if (!found_inf.defined()) return value_fault("found_inf is an undefined tensor");
  if (found_inf.layout() != at::kStrided) return type_fault("found_inf must be a dense tensor, got ", found_inf.layout());
  if (found_inf.dim() != 0 || found_inf.scalar_type() != at::kFloat) {
    return value_fault("found_inf must be a 0-dim float32 tensor, got ", found_inf.scalar_type(), " of shape ",
                       found_inf.sym_sizes());
  }
  if (sight.grad_mode && found_inf.requires_grad()) {
    return value_fault("found_inf requires grad; it is written in place: pass a plain float32 tensor");
  }
  return std::nullopt;
}

// sq_norm: where the op adds the sum of the squares of the grads, so a 0-dim float tensor
// wide enough to hold it (float32 or float64, no 16-bit type).
MaybeFault sq_norm_fault(const Arguments& args, const Sight& sight) {
  if (args.sq_norm_not_tensor != nullptr) {
    return type_fault("sq_norm must be a 0-dim float32 or float64 tensor or None, got ", args.sq_norm_not_tensor);
  }
  if (args.sq_norm == nullptr) return std::nullopt;
  const at::Tensor& sq_norm = *args.sq_norm;
  if (!sq_norm.defined()) return value_fault("sq_norm is an undefined tensor");
  if (sq_norm.layout() != at::kStrided) return type_fault("sq_norm must be a dense tensor, got ", sq_norm.layout());
  if (sq_norm.scalar_type() != at::kFloat && sq_norm.scalar_type() != at::kDouble) {
    return type_fault("sq_norm must be a float32 or float64 tensor, got ", sq_norm.scalar_type());
  }
  if (sq_norm.dim() != 0) return value_fault("sq_norm must be a 0-dim tensor, got shape ", sq_norm.sym_sizes());
  if (sight.grad_mode && sq_norm.requires_grad()) {
    return value_fault("sq_norm requires grad; the op adds to it in place: pass a plain float32 or float64 tensor");
  }
  return std::nullopt;
}

MaybeFault scale_fault(const Arguments& args) {
  if (args.scale == nullptr) return std::nullopt;  // a number, checked by the Python face
  const at::Tensor& scale = *args.scale;
  if (!scale.defined()) return value_fault("scale is an undefined tensor");
  if (scale.layout() != at::kStrided) return type_fault("scale must be a dense tensor, got ", scale.layout());
  if (scale.dim() != 0) return value_fault("scale must be a 0-dim tensor, got shape ", scale.sym_sizes());
  if (scale.scalar_type() != at::kFloat && scale.scalar_type() != at::kDouble) {
    return type_fault("scale must be float32 or float64, got ", scale.scalar_type());
  }
  return std::nullopt;
}

// The tensors are on the kernel's device type, or on one the op runs on.
MaybeFault device_fault(const Arguments& args, c10::Device device, const Sight& sight) {
  if (sight.kernel) {
    if (device.type() == *sight.kernel) return std::nullopt;
    return value_fault("the ", c10::DeviceTypeName(*sight.kernel), " kernel was called with tensors on ", device,
                       "; every tensor argument must be on one device (scale may also be a CPU scalar)");
  }
  if (device.is_cpu() || device.is_cuda()) return std::nullopt;
  const char* owner = !args.accumulators.empty() ? "accumulators[0]"
                      : args.found_inf != nullptr ? "found_inf"
                      : args.sq_norm != nullptr   ? "sq_norm"
                      : args.scale != nullptr     ? "scale"
                                                  : "the tensors";
  return value_fault(owner, " is on ", device, "; scale_accumulate_ runs on cpu and cuda tensors");
}

MaybeFault placement_fault(const Arguments& args, c10::Device device) {
  if (args.found_inf != nullptr && args.found_inf->device() != device) {
    return value_fault("found_inf is on ", args.found_inf->device(), " but the tensors are on ", device);
  }
  if (args.sq_norm != nullptr && args.sq_norm->device() != device) {
    return value_fault("sq_norm is on ", args.sq_norm->device(), " but the tensors are on ", device);
  }
  if (args.scale != nullptr && args.scale->device() != device && !args.scale->device().is_cpu()) {
    return value_fault("scale is on ", args.scale->device(), " but must be on ", device, " or be a CPU scalar");
  }
  return std::nullopt;
}

// The bytes a tensor can touch, [begin, end), with the argument that owns them.
struct Extent {
  enum List : int64_t { kAccumulators = 0, kGrads = 1, kFoundInf = 2, kScale = 3, kSqNorm = 4 };
  uintptr_t begin;
  uintptr_t end;
  int64_t list;
  int64_t index;  // position in the list (0 for found_inf, scale and sq_norm)
  bool written() const { return list == kAccumulators || list == kFoundInf || list == kSqNorm; }
};

Extent extent_of(const at::Tensor& t, int64_t list, int64_t index) {
  // Torch strides are never negative: the element farthest from data_ptr is at
  // sum((size - 1) * stride).
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const auto begin = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  const auto bytes = static_cast<uintptr_t>((last + 1) * static_cast<int64_t>(t.element_size()));
  return {begin, begin + bytes, list, index};
}

std::string name_of(const Extent& e) {
  static const char* const names[] = {"accumulators", "grads", "found_inf", "scale", "sq_norm"};
  return e.list <= Extent::kGrads ? c10::str(names[e.list], "[", e.index, "]") : names[e.list];
}

// No written tensor (an accumulator, found_inf, sq_norm) may share memory with another
// argument: the kernels update all pairs in parallel, so an overlap is a data race (and a
// sum of squares read from a grad it writes would change what it sums). Address ranges are
// compared, so interleaved views of one buffer are refused too. Empty pairs own no bytes; a
// CPU scale beside device tensors is read by value. A sorted sweep: any overlap involving a
// written extent shows up against the extent with the largest end seen so far.
MaybeFault overlap_fault(const Arguments& args, c10::Device device) {
  std::vector<Extent> extents;
  extents.reserve(2 * args.accumulators.size() + 2);
  for (size_t i = 0; i < args.accumulators.size(); ++i) {
    if (args.accumulators[i].numel() == 0) continue;
    extents.push_back(extent_of(args.accumulators[i], Extent::kAccumulators, static_cast<int64_t>(i)));
    extents.push_back(extent_of(args.grads[i], Extent::kGrads, static_cast<int64_t>(i)));
  }
  if (args.found_inf != nullptr) extents.push_back(extent_of(*args.found_inf, Extent::kFoundInf, 0));
  if (args.sq_norm != nullptr) extents.push_back(extent_of(*args.sq_norm, Extent::kSqNorm, 0));
  if (args.scale != nullptr && args.scale->device() == device) {
    extents.push_back(extent_of(*args.scale, Extent::kScale, 0));
  }
  std::sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
  const Extent* reach = nullptr;  // the extent seen so far that ends last
  for (const Extent& e : extents) {
    if (reach != nullptr && e.begin < reach->end && (e.written() || reach->written())) {
      return value_fault(name_of(*reach), " and ", name_of(e),
                         " may share memory; accumulators, found_inf and sq_norm must not overlap any other "
                         "argument");
    }
    if (reach == nullptr || e.end > reach->end) reach = &e;
  }
  return std::nullopt;
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

c10::Device device_of(const Arguments& args) {
  if (!args.accumulators.empty() && args.accumulators[0].defined()) return args.accumulators[0].device();
  if (args.found_inf != nullptr && args.found_inf->defined()) return args.found_inf->device();
  if (args.sq_norm != nullptr && args.sq_norm->defined()) return args.sq_norm->device();
  if (args.scale != nullptr && args.scale->defined()) return args.scale->device();
  return c10::Device(c10::kCPU);
}

MaybeFault first_fault(const Arguments& args, const Sight& sight) {
  const size_t n = args.accumulators.size();
  if (n != args.grads.size()) {  // before any element is indexed
    return value_fault("accumulators and grads must have the same length, got ", n, " accumulators and ",
                       args.grads.size(), " grads");
  }
  if (auto fault = found_inf_fault(args, sight)) return fault;
  if (auto fault = sq_norm_fault(args, sight)) return fault;
  if (auto fault = scale_fault(args)) return fault;
  if (n > 0 && !args.accumulators[0].defined()) return missing_fault("accumulators", 0, args.accumulators_not_tensor);
  const c10::Device device = device_of(args);
  if (auto fault = device_fault(args, device, sight)) return fault;
  for (size_t i = 0; i < n; ++i) {
    if (auto fault = pair_fault(args, i, device, sight)) return fault;
  }
  if (auto fault = placement_fault(args, device)) return fault;
  return sight.data ? overlap_fault(args, device) : std::nullopt;
}

c10::Device check_scale_accumulate_args(at::TensorList accumulators, at::TensorList grads,
                                        const at::Tensor& scale, const at::Tensor& found_inf,
                                        const at::Tensor* sq_norm, c10::DeviceType kernel_device) {
  Arguments args{accumulators, grads, &scale, &found_inf};
  args.sq_norm = sq_norm;
  // Below the autograd layer: whether a tensor requires grad is not the kernel's concern.
  const Sight sight{/*grad_mode=*/false, /*data=*/true, kernel_device};
  if (const MaybeFault fault = first_fault(args, sight)) {
    TORCH_CHECK_TYPE(fault->kind != Fault::Kind::Type, "scale_accumulate_: ", fault->message);
    TORCH_CHECK_VALUE(false, "scale_accumulate_: ", fault->message);
  }
  return device_of(args);
}

}  // namespace mbs
