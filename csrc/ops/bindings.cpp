// The hot half of mbs_ext.scale_accumulate_'s argument checks, for Python.
//
// mbs_ext/ops.py names every bad argument itself; what it needs from C++ is speed: with
// thousands of small tensors, a per-element loop in Python costs more than the fused op
// it guards (about 1 us per pair). These functions only answer questions ("which pair
// looks wrong first?", "which arguments overlap?"); they never raise for bad tensors,
// so every error the user sees is raised, and worded, in Python.
#include "ops/bindings.h"

#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <vector>

#include "ops/scale_accumulate.h"

namespace mbs {
namespace {

namespace py = pybind11;

// True when a list element is a dense float tensor on `device` that may be handed to the
// op (and, for an accumulator, written in place). Mirrors ops.py's per-pair checks.
bool plausible(PyObject* obj, const c10::Device& device, bool grad_mode, const at::Tensor** out) {
  if (!THPVariable_Check(obj)) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || t.layout() != at::kStrided || !is_supported_float(t.scalar_type()) || t.device() != device) {
    return false;
  }
  if (grad_mode && t.requires_grad()) return false;
  *out = &t;
  return true;
}

bool expanded(const at::Tensor& t) {
  if (t.is_contiguous()) return false;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.stride(d) == 0 && t.size(d) > 1) return true;
  }
  return false;
}

// Index of the first pair at or after `start` that some check may refuse, or -1. The two
// lists have equal lengths and accumulators[0] is a tensor (ops.py checks both first).
int64_t first_suspect_pair(const py::list& accumulators, const py::list& grads, int64_t start, bool grad_mode) {
  const auto n = static_cast<int64_t>(PyList_GET_SIZE(accumulators.ptr()));
  if (n == 0 || static_cast<int64_t>(PyList_GET_SIZE(grads.ptr())) != n) return n == 0 ? -1 : 0;
  PyObject* first = PyList_GET_ITEM(accumulators.ptr(), 0);
  if (!THPVariable_Check(first)) return 0;
  const c10::Device device = THPVariable_Unpack(first).device();
  for (int64_t i = std::max<int64_t>(start, 0); i < n; ++i) {
    const at::Tensor* acc = nullptr;
    const at::Tensor* grad = nullptr;
    if (!plausible(PyList_GET_ITEM(accumulators.ptr(), i), device, grad_mode, &acc) ||
        !plausible(PyList_GET_ITEM(grads.ptr(), i), device, grad_mode, &grad) || acc->sizes() != grad->sizes() ||
        expanded(*acc)) {
      return i;
    }
  }
  return -1;
}

// [] when no written argument shares memory with another, else [list, index, list, index]
// (lists: 0 accumulators, 1 grads, 2 found_inf, 3 scale). Arguments already checked.
std::vector<int64_t> overlap(const std::vector<at::Tensor>& accumulators, const std::vector<at::Tensor>& grads,
                             const at::Tensor& scale, const at::Tensor& found_inf) {
  if (accumulators.size() != grads.size() || !scale.defined() || !found_inf.defined()) return {};
  const auto hit = find_overlap(accumulators, grads, scale, found_inf);
  if (!hit) return {};
  return {hit->first.list, hit->first.index, hit->second.list, hit->second.index};
}

}  // namespace

void bind_scale_accumulate_checks(py::module_& m) {
  m.def("_first_suspect_pair", &first_suspect_pair, py::arg("accumulators"), py::arg("grads"), py::arg("start"),
        py::arg("grad_mode"),
        "Index of the first (accumulator, grad) pair from `start` on that a check may refuse, or -1");
  m.def("_find_overlap", &overlap, py::arg("accumulators"), py::arg("grads"), py::arg("scale"),
        py::arg("found_inf"), "[] or [list, index, list, index] of the first two arguments that share memory");
}

}  // namespace mbs
