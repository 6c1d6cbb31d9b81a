// The op's argument checks (ops/arguments.h) over Python lists, for mbs_ext/ops.py.
//
// With thousands of small tensors a per-element loop in Python costs more than the
// fused op it guards (about 1 us per pair), so the scan runs here. It never raises for
// bad arguments: it returns the fault, and ops.py raises it (see there for why).
// Borrowed references only: no tensor is copied or counted.
#include "ops/bindings.h"

#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <utility>

#include "ops/arguments.h"

namespace mbs {
namespace {

namespace py = pybind11;

const at::Tensor* as_tensor(PyObject* obj) { return THPVariable_Check(obj) ? &THPVariable_Unpack(obj) : nullptr; }

// Element i of `list` (named `name`), or the fault that it is no tensor.
std::pair<const at::Tensor*, MaybeFault> element(const py::list& list, const char* name, int64_t i) {
  PyObject* obj = PyList_GET_ITEM(list.ptr(), i);
  if (const at::Tensor* t = as_tensor(obj)) return {t, std::nullopt};
  return {nullptr, Fault{Fault::Kind::Type, c10::str(name, "[", i, "] must be a torch.Tensor, got ", Py_TYPE(obj)->tp_name)}};
}

// The first refused pair at or after `start` and its fault; (-1, none) when every pair
// passes. Lengths and accumulators[0]'s device count as pair 0's.
std::pair<int64_t, MaybeFault> first_pair_fault(const py::list& accumulators, const py::list& grads, bool grad_mode,
                                                int64_t start) {
  const auto n = static_cast<int64_t>(PyList_GET_SIZE(accumulators.ptr()));
  if (auto fault = lengths_fault(static_cast<size_t>(n), PyList_GET_SIZE(grads.ptr()))) return {0, fault};
  if (n == 0) return {-1, std::nullopt};
  const auto [first, not_tensor] = element(accumulators, "accumulators", 0);
  if (not_tensor) return {0, not_tensor};
  const c10::Device device = first->device();
  if (auto fault = device_fault(device, "accumulators[0]")) return {0, fault};
  for (int64_t i = start; i < n; ++i) {
    auto [acc, acc_fault] = element(accumulators, "accumulators", i);
    if (acc_fault) return {i, acc_fault};
    auto [grad, grad_fault] = element(grads, "grads", i);
    if (grad_fault) return {i, grad_fault};
    if (auto fault = pair_fault(*acc, *grad, static_cast<size_t>(i), device, grad_mode)) return {i, fault};
  }
  return {-1, std::nullopt};
}

// The first two arguments that share memory (see Extents), for pairs that passed.
std::optional<std::pair<Extent, Extent>> first_overlap(const py::list& accumulators, const py::list& grads,
                                                       const at::Tensor& scale, const at::Tensor& found_inf) {
  const auto n = static_cast<size_t>(PyList_GET_SIZE(accumulators.ptr()));
  Extents extents(n);
  for (size_t i = 0; i < n && i < static_cast<size_t>(PyList_GET_SIZE(grads.ptr())); ++i) {
    const at::Tensor* acc = as_tensor(PyList_GET_ITEM(accumulators.ptr(), i));
    const at::Tensor* grad = as_tensor(PyList_GET_ITEM(grads.ptr(), i));
    if (acc != nullptr && grad != nullptr && acc->defined() && grad->defined()) extents.add_pair(*acc, *grad, i);
  }
  extents.add_scalars(scale, found_inf);
  return extents.first_overlap();
}

py::object as_python(const MaybeFault& fault) {
  if (!fault) return py::none();
  return py::make_tuple(fault->kind == Fault::Kind::Type ? "type" : "value", fault->message);
}

// The older form of the two scans in one call: (first refused pair from `start` on, [])
// or (-1, [list, index, list, index] of the first overlap, or []); lists: 0
// accumulators, 1 grads, 2 found_inf, 3 scale.
py::tuple scan_arguments(const py::list& accumulators, const py::list& grads, const at::Tensor& scale,
                         const at::Tensor& found_inf, bool grad_mode, int64_t start) {
  const int64_t suspect = first_pair_fault(accumulators, grads, grad_mode, start).first;
  py::list hit;
  if (suspect >= 0) return py::make_tuple(suspect, hit);
  if (const auto overlap = first_overlap(accumulators, grads, scale, found_inf)) {
    for (const Extent* e : {&overlap->first, &overlap->second}) {
      hit.append(e->list);
      hit.append(e->index);
    }
  }
  return py::make_tuple(-1, hit);
}

}  // namespace

void bind_scale_accumulate_checks(py::module_& m) {
  m.def(
      "_pair_fault",
      [](const py::list& accumulators, const py::list& grads, bool grad_mode) {
        return as_python(first_pair_fault(accumulators, grads, grad_mode, 0).second);
      },
      py::arg("accumulators"), py::arg("grads"), py::arg("grad_mode"),
      "None, or (\"type\"|\"value\", message) for the first refused pair (lengths and devices included)");
  m.def(
      "_overlap_fault",
      [](const py::list& accumulators, const py::list& grads, const at::Tensor& scale, const at::Tensor& found_inf) {
        const auto overlap = first_overlap(accumulators, grads, scale, found_inf);
        return as_python(overlap ? MaybeFault(Extents::fault(*overlap)) : std::nullopt);
      },
      py::arg("accumulators"), py::arg("grads"), py::arg("scale"), py::arg("found_inf"),
      "None, or (\"value\", message) naming the first two arguments that share memory");
  m.def("_scan_arguments", &scan_arguments, py::arg("accumulators"), py::arg("grads"), py::arg("scale"),
        py::arg("found_inf"), py::arg("grad_mode"), py::arg("start"),
        "(first suspect pair from `start` on, []) or (-1, the first two arguments that share memory or [])");
}

}  // namespace mbs
