// The hot half of mbs_ext.scale_accumulate_'s argument checks, for Python.
//
// mbs_ext/ops.py names every bad argument itself; what it needs from C++ is speed: with
// thousands of small tensors, a per-element loop in Python costs more than the fused op
// it guards (about 1 us per pair). The scan here only answers questions ("which pair
// looks wrong first?", "which arguments overlap?"); it never raises for bad tensors,
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
// `out` points at the tensor whenever the element is one.
bool plausible(PyObject* obj, const c10::Device& device, bool grad_mode, const at::Tensor** out) {
  if (!THPVariable_Check(obj)) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  *out = &t;
  if (!t.defined() || t.layout() != at::kStrided || !is_supported_float(t.scalar_type()) || t.device() != device) {
    return false;
  }
  return !(grad_mode && t.requires_grad());
}

bool expanded(const at::Tensor& t) {
  if (t.is_contiguous()) return false;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.stride(d) == 0 && t.size(d) > 1) return true;
  }
  return false;
}

// One pass over the two lists, which ops.py has already found equal in length, with a
// tensor accumulators[0] and with scale and found_inf checked. Returns (i, []) for the
// first pair at or after `start` that some check may refuse; else (-1, hit) with hit = []
// when no written argument shares memory with another, or [list, index, list, index]
// (lists: 0 accumulators, 1 grads, 2 found_inf, 3 scale). Pairs before `start` have been
// checked already. Borrowed references only: no tensor is copied or counted.
py::tuple scan(const py::list& accumulators, const py::list& grads, const at::Tensor& scale,
               const at::Tensor& found_inf, bool grad_mode, int64_t start) {
  const auto n = static_cast<int64_t>(PyList_GET_SIZE(accumulators.ptr()));
  if (static_cast<int64_t>(PyList_GET_SIZE(grads.ptr())) != n) return py::make_tuple(0, py::list());
  if (n > 0 && !THPVariable_Check(PyList_GET_ITEM(accumulators.ptr(), 0))) return py::make_tuple(0, py::list());
  const c10::Device device =
      n > 0 ? THPVariable_Unpack(PyList_GET_ITEM(accumulators.ptr(), 0)).device() : found_inf.device();
  std::vector<Extent> extents;
  extents.reserve(static_cast<size_t>(2 * n + 2));
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor* acc = nullptr;
    const at::Tensor* grad = nullptr;
    const bool acc_ok = plausible(PyList_GET_ITEM(accumulators.ptr(), i), device, grad_mode, &acc);
    const bool grad_ok = plausible(PyList_GET_ITEM(grads.ptr(), i), device, grad_mode, &grad);
    const bool fine = acc_ok && grad_ok && acc->sizes() == grad->sizes() && !expanded(*acc);
    if (!fine && i >= start) return py::make_tuple(i, py::list());
    // A pair before `start` that looked suspect here passed ops.py's checks: it still owns memory.
    if (acc != nullptr && grad != nullptr && acc->defined() && grad->defined() && acc->numel() > 0) {
      extents.push_back(extent_of(*acc, 0, i));
      extents.push_back(extent_of(*grad, 1, i));
    }
  }
  extents.push_back(extent_of(found_inf, 2, 0));
  if (scale.device() == found_inf.device()) extents.push_back(extent_of(scale, 3, 0));
  const auto hit = first_overlap(extents);
  py::list out;
  if (hit) {
    for (const Extent* e : {&hit->first, &hit->second}) {
      out.append(e->list);
      out.append(e->index);
    }
  }
  return py::make_tuple(-1, out);
}

}  // namespace

void bind_scale_accumulate_checks(py::module_& m) {
  m.def("_scan_arguments", &scan, py::arg("accumulators"), py::arg("grads"), py::arg("scale"),
        py::arg("found_inf"), py::arg("grad_mode"), py::arg("start"),
        "(first suspect pair from `start` on, []) or (-1, the first two arguments that share memory or [])");
}

}  // namespace mbs
