// The one check layer of mbs_ext::scale_accumulate_: every fact the op requires of its
// arguments, written once, for three callers that see more or less of a call:
//
//   the kernels (cpu/, cuda/)   check_scale_accumulate_args: real tensors, raised as c10 errors
//   the Python face (bindings)  first_fault on the lists Python passed: may hold non-tensors,
//                               found_inf may be missing and scale a number; returned, not raised
//   the fake kernel (bindings)  first_fault without data: fake tensors have no addresses, so
//                               alignment and overlap are left to the kernels
//
// A fault names the argument ("grads[3] ...") and is built only for a refused argument: the
// accepted path allocates nothing.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

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

// The first element of a Python list that is no tensor (an undefined tensor in its place).
struct NotTensor {
  size_t index = SIZE_MAX;
  const char* type_name = nullptr;
};

// One call as the checks see it.
struct Arguments {
  at::TensorList accumulators;
  at::TensorList grads;
  const at::Tensor* scale = nullptr;      // null: a Python number, read by value
  const at::Tensor* found_inf = nullptr;  // null: not given (the Python face creates it)
  const at::Tensor* sq_norm = nullptr;    // null: not given (no sum of squares)
  NotTensor accumulators_not_tensor{};    // from Python lists only
  NotTensor grads_not_tensor{};
  const char* found_inf_not_tensor = nullptr;  // found_inf's type when it is neither a tensor nor None
  const char* sq_norm_not_tensor = nullptr;    // sq_norm's type when it is neither a tensor nor None
};

// What the caller can check.
struct Sight {
  bool grad_mode = false;  // refuse tensors that require grad (the public call in grad mode)
  bool data = true;        // real tensors: alignment and memory overlap (not fake or meta ones)
  std::optional<c10::DeviceType> kernel;  // the kernel the dispatcher picked
};

// The device the tensors live on: accumulators[0]'s, else found_inf's, else sq_norm's, else
// scale's, else the CPU.
c10::Device device_of(const Arguments& args);

// The first refused argument, checked in this order: list lengths; found_inf, sq_norm and scale
// on their own; the device (the kernel's, or one the op runs on); every pair (defined dense float
// tensors on that device, of one shape, aligned to their element size, the accumulator writable
// in place; in grad mode, neither tracked by autograd); found_inf, sq_norm and scale on that
// device (scale may be a CPU scalar); no written tensor (an accumulator, found_inf, sq_norm)
// sharing memory with another argument.
MaybeFault first_fault(const Arguments& args, const Sight& sight);

// first_fault for a kernel of `kernel_device`, raised as the matching c10 error prefixed with
// the op's name. The dispatcher picks the kernel from the highest-priority device among all
// tensor arguments, so the tensors are checked against it. sq_norm may be null (not given).
// Returns the tensors' device.
c10::Device check_scale_accumulate_args(at::TensorList accumulators, at::TensorList grads,
                                        const at::Tensor& scale, const at::Tensor& found_inf,
                                        const at::Tensor* sq_norm, c10::DeviceType kernel_device);

}  // namespace mbs
