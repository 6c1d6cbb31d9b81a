// The facts mbs_ext::scale_accumulate_ requires of its arguments, each written once.
//
// Two callers: the kernels (check_scale_accumulate_args, before any data is touched)
// and the Python-side scan (ops/bindings.cpp), which asks the same questions without
// raising so that mbs_ext/ops.py can raise the error itself. A fault names the argument
// ("grads[3] ...") and is built only for a refused argument: the accepted path
// allocates nothing.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "accumulate/dtype.h"

namespace mbs {

struct Fault {
  enum class Kind { Type, Value };  // TypeError / ValueError
  Kind kind;
  std::string message;
};
using MaybeFault = std::optional<Fault>;

// The op's element types; nullopt for every other dtype. The one map from torch dtypes.
std::optional<accumulate::DType> float_dtype(at::ScalarType t);

MaybeFault lengths_fault(size_t accumulators, size_t grads);
// The tensors' device (accumulators[0]'s, or found_inf's for empty lists) is one the op runs on.
MaybeFault device_fault(c10::Device device, const char* owner);
// Pair i: defined dense float tensors on `device`, of one shape, aligned to their element
// size, the accumulator writable in place; with grad_mode on, neither tracked by autograd.
MaybeFault pair_fault(const at::Tensor& acc, const at::Tensor& grad, size_t i, c10::Device device, bool grad_mode);
// A 0-dim float32 found_inf; a 0-dim float32/float64 scale.
MaybeFault found_inf_fault(const at::Tensor& found_inf);
MaybeFault scale_fault(const at::Tensor& scale);
// found_inf on `device`; scale there too or a CPU scalar (read by value).
MaybeFault placement_fault(const at::Tensor& scale, const at::Tensor& found_inf, c10::Device device);

// The bytes a tensor can touch, [begin, end), with the argument that owns them.
struct Extent {
  enum List : int64_t { kAccumulators = 0, kGrads = 1, kFoundInf = 2, kScale = 3 };
  uintptr_t begin;
  uintptr_t end;
  int64_t list;
  int64_t index;  // position in the list (0 for found_inf and scale)
  bool written() const { return list == kAccumulators || list == kFoundInf; }
};

// The extents of one call: non-empty pairs (empty ones own no bytes), found_inf, and scale
// unless it is a CPU scalar beside device tensors (read by value).
class Extents {
 public:
  explicit Extents(size_t pairs) { extents_.reserve(2 * pairs + 2); }
  void add_pair(const at::Tensor& acc, const at::Tensor& grad, size_t i);
  void add_scalars(const at::Tensor& scale, const at::Tensor& found_inf);
  // No written tensor (an accumulator, found_inf) may share memory with another argument:
  // the kernels update all pairs in parallel, so an overlap is a data race. Address ranges
  // are compared, so interleaved views of one buffer are refused too. The first offending
  // pair of extents, if any (sorts the extents).
  std::optional<std::pair<Extent, Extent>> first_overlap();
  static Fault fault(const std::pair<Extent, Extent>& overlap);

 private:
  std::vector<Extent> extents_;
};

// Every check above, raised as the matching c10 error prefixed with the op's name.
// `kernel_device` is the device type of the calling kernel: the dispatcher picks it from
// the highest-priority device among all tensor arguments, so the tensors must be checked
// against it. Returns the device the tensors live on.
c10::Device check_scale_accumulate_args(at::TensorList accumulators, at::TensorList grads,
                                        const at::Tensor& scale, const at::Tensor& found_inf,
                                        c10::DeviceType kernel_device);

}  // namespace mbs
