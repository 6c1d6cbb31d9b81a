// mbs_ext._C._scale_accumulate: the Python face's one crossing into C++ per call.
//
// It reads the Python arguments (lists or tuples of tensors, a number or tensor scale,
// found_inf or None, sq_norm or None) through torch's pybind11 caster for tensors, checks them with the op's
// one check layer (ops/arguments.h), and for a plain eager call runs the kernel of the
// tensors' device (ops/kernels.h) with the GIL released. It never raises for bad arguments: it returns the
// fault, and mbs_ext/ops.py raises it. What it leaves to Python it says by returning None.
// Compiled inside csrc/module.cpp.
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/record_function.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
// Not torch/csrc/autograd/python_variable.h: it brings in autograd's headers, 18 s of a
// 26 s compile; the caster's load and cast are torch's own exported functions.
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "ops/arguments.h"
#include "ops/kernels.h"
#include "ops/noise_tap.h"

namespace mbs {
namespace {

namespace py = pybind11;

// Tensors whose data a kernel cannot take as it is: subclasses with __torch_dispatch__ (fake
// tensors, DTensors), functionalized, batched (vmap) and lazily negated or conjugated ones.
constexpr c10::DispatchKeySet kNotPlain({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                         c10::DispatchKey::Functionalize, c10::DispatchKey::FuncTorchBatched,
                                         c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::BatchedNestedTensor,
                                         c10::DispatchKey::Conjugate, c10::DispatchKey::Negative,
                                         c10::DispatchKey::ZeroTensor});

// What the scan of the Python arguments found out about their tensors.
struct Seen {
  bool plain = true;  // no tensor in kNotPlain: a kernel may run on them directly
  bool data = true;   // every tensor has memory of its own on the cpu or a cuda device

  void add(const at::Tensor& t) {
    plain = plain && !t.key_set().has_any(kNotPlain);
    data = data && !t.key_set().has_any(kNotPlain) && (t.is_cpu() || t.is_cuda());
  }
};

// The tensor of a torch.Tensor (or subclass) object, a reference of its own; nullopt for
// anything else.
std::optional<at::Tensor> as_tensor(PyObject* obj) {
  py::detail::make_caster<at::Tensor> caster;
  if (!caster.load(obj, false)) return std::nullopt;
  return py::detail::cast_op<at::Tensor&&>(std::move(caster));
}

// The elements of a list or tuple as tensors, each a reference of its own (an atomic count,
// no Python object), so the kernel may run without the GIL while the list changes. A
// non-tensor becomes an undefined tensor, the first one named.
class Tensors {
 public:
  Tensors(PyObject* seq, NotTensor& not_tensor, Seen& seen) {
    // A tuple of the items: a subclass's isinstance check may run Python code that changes the list.
    const auto items = py::reinterpret_steal<py::tuple>(PySequence_Tuple(seq));
    if (!items) throw py::error_already_set();
    const Py_ssize_t n = PyTuple_GET_SIZE(items.ptr());
    tensors_.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = PyTuple_GET_ITEM(items.ptr(), i);
      std::optional<at::Tensor> t = as_tensor(item);
      if (t) {
        seen.add(*t);
        tensors_.push_back(std::move(*t));
      } else {
        if (not_tensor.type_name == nullptr) not_tensor = {static_cast<size_t>(i), Py_TYPE(item)->tp_name};
        tensors_.emplace_back();
      }
    }
  }

  at::TensorList list() const { return tensors_; }

 private:
  std::vector<at::Tensor> tensors_;
};

// A finite float or int (not a bool) as a double; nullopt for anything else.
std::optional<double> finite_number(PyObject* obj) {
  double value = 0.0;
  if (PyFloat_Check(obj)) {
    value = PyFloat_AS_DOUBLE(obj);
  } else if (PyLong_Check(obj) && !PyBool_Check(obj)) {
    value = PyLong_AsDouble(obj);
    if (value == -1.0 && PyErr_Occurred()) {  // too large for a float: ops.py says so
      PyErr_Clear();
      return std::nullopt;
    }
  } else {
    return std::nullopt;
  }
  return std::isfinite(value) ? std::optional<double>(value) : std::nullopt;
}

// Whether anything besides the kernel would take part in a dispatched call: dispatch or
// torch-function modes, functorch or functionalization layers, profilers (record functions).
bool dispatcher_needed() {
  return c10::impl::tls_local_dispatch_key_set().included_ != c10::default_included_set ||
         c10::impl::TorchDispatchModeTLS::any_modes_set() || at::impl::torch_function_mode_enabled() ||
         at::hasCallbacks();
}

py::object as_python(const Fault& fault) {
  return py::make_tuple(fault.kind == Fault::Kind::Type ? "type" : "value", fault.message);
}

// As every in-place op does through the dispatcher (its ADInplaceOrView kernel): what a call
// writes gets a new version, so that autograd refuses a backward through a tensor it saved and
// this call changed. Inference tensors have no version to bump.
void bump_versions(at::TensorList tensors) {
  for (const at::Tensor& t : tensors) {
    if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
  }
}

// run=true: the public call. Returns found_inf (given or created) after running the kernel,
// a fault, or None where Python has a share: sequences other than lists and tuples, scales
// other than a finite float/int or a float32/float64 tensor, tensors that are not plain, and
// calls the dispatcher must see. run=false: the checks alone (for calls Python dispatches, and
// for the fake kernel): a fault or None. Requires grad counts where grad mode is on.
// sq_norm: None, or the 0-dim tensor the kernel adds the grads' sum of squares to.
py::object scale_accumulate(py::handle accumulators, py::handle grads, py::handle scale, py::handle found_inf,
                            bool run, py::handle sq_norm) {
  const bool sequences = (PyList_Check(accumulators.ptr()) || PyTuple_Check(accumulators.ptr())) &&
                         (PyList_Check(grads.ptr()) || PyTuple_Check(grads.ptr()));
  if (!sequences || (run && dispatcher_needed())) return py::none();
  Seen seen;
  Arguments args;
  const Tensors accs(accumulators.ptr(), args.accumulators_not_tensor, seen);
  const Tensors grad_list(grads.ptr(), args.grads_not_tensor, seen);
  args.accumulators = accs.list();
  args.grads = grad_list.list();

  const std::optional<at::Tensor> scale_tensor = as_tensor(scale.ptr());
  Scale scale_arg{scale_tensor ? &*scale_tensor : nullptr, 0.0};
  if (scale_arg.tensor != nullptr) {
    seen.add(*scale_arg.tensor);
    const at::ScalarType dtype = scale_arg.tensor->scalar_type();
    if (run && (dtype == at::kHalf || dtype == at::kBFloat16)) return py::none();  // ops.py converts it
    args.scale = scale_arg.tensor;
  } else if (const std::optional<double> value = finite_number(scale.ptr())) {
    scale_arg.value = *value;
  } else {
    return py::none();  // other numbers and types: ops.py converts or refuses them
  }
  const std::optional<at::Tensor> found_inf_tensor = as_tensor(found_inf.ptr());
  if (found_inf_tensor) {
    seen.add(*found_inf_tensor);
    args.found_inf = &*found_inf_tensor;
  } else if (!found_inf.is_none()) {
    args.found_inf_not_tensor = Py_TYPE(found_inf.ptr())->tp_name;
  }
  const std::optional<at::Tensor> sq_norm_tensor = as_tensor(sq_norm.ptr());
  if (sq_norm_tensor) {
    seen.add(*sq_norm_tensor);
    args.sq_norm = &*sq_norm_tensor;
  } else if (!sq_norm.is_none()) {
    args.sq_norm_not_tensor = Py_TYPE(sq_norm.ptr())->tp_name;
  }
  if (run && !seen.plain) return py::none();  // DTensors are refused by ops.py before any check

  const Sight sight{at::GradMode::is_enabled(), seen.data, std::nullopt};
  if (const MaybeFault fault = first_fault(args, sight)) return as_python(*fault);
  if (!run) return py::none();
  const c10::Device device = device_of(args);
  const Kernel kernel = kernel_for(device.type());
  if (kernel == nullptr || !seen.data) return py::none();  // the dispatcher says what is missing
  bump_versions(args.accumulators);
  if (args.sq_norm != nullptr) bump_versions(*args.sq_norm);
  if (args.found_inf != nullptr) {
    bump_versions(*args.found_inf);
    const py::gil_scoped_release no_gil;  // accs and grad_list hold the lists' tensors
    kernel(args.accumulators, args.grads, scale_arg, *args.found_inf, args.sq_norm, device);
    return py::reinterpret_borrow<py::object>(found_inf);
  }
  at::Tensor flag = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
  {
    const py::gil_scoped_release no_gil;
    kernel(args.accumulators, args.grads, scale_arg, flag, args.sq_norm, device);
  }
  return py::cast(std::move(flag));
}

// The CPU helpers of mbs_ext/model/grads.py behind their checks, which raise (private helpers,
// not the op's face: no fault returned).
[[noreturn]] void refuse(const char* helper, const std::string& name) {
  throw py::value_error(std::string(helper) +
                        " takes dense CPU float tensors, 0-dim float64 or float32 sums and a 0-dim float32 "
                        "found_inf, all on the CPU: not so for " + name);
}

// Dense and non-overlapping (contiguous, channels_last, ...): its elements fill numel slots from data_ptr.
void check_dense(const char* helper, const std::vector<at::Tensor>& tensors, const char* name) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (!t.is_cpu() || !float_dtype(t.scalar_type()) || !t.is_non_overlapping_and_dense() ||
        t.key_set().has_any(kNotPlain)) {
      refuse(helper, std::string(name) + "[" + std::to_string(i) + "]");
    }
  }
}

void check_scalar(const char* helper, const at::Tensor& t, bool double_ok, const char* name) {
  if (!t.is_cpu() || t.dim() != 0 || t.key_set().has_any(kNotPlain) ||
      !(t.scalar_type() == at::kFloat || (double_ok && t.scalar_type() == at::kDouble))) {
    refuse(helper, name);
  }
}

// _sum_squares(tensors, sq_norm, found_inf): sum_squares_cpu (ops/kernels.h).
void sum_squares(const std::vector<at::Tensor>& tensors, const at::Tensor& sq_norm, const at::Tensor& found_inf) {
  check_dense("_sum_squares", tensors, "tensors");
  check_scalar("_sum_squares", sq_norm, true, "sq_norm");
  check_scalar("_sum_squares", found_inf, false, "found_inf");
  bump_versions(sq_norm);
  bump_versions(found_inf);
  const py::gil_scoped_release no_gil;
  sum_squares_cpu(tensors, sq_norm, found_inf);
}

// _add_squares(accumulators, grads, sq_norm, acc_sq_norm or None, found_inf): add_squares_cpu
// (ops/kernels.h); each accumulator laid out as its grad.
void add_squares(const std::vector<at::Tensor>& accumulators, const std::vector<at::Tensor>& grads,
                 const at::Tensor& sq_norm, const std::optional<at::Tensor>& acc_sq_norm,
                 const at::Tensor& found_inf) {
  if (accumulators.size() != grads.size()) refuse("_add_squares", "grads (not one per accumulator)");
  check_dense("_add_squares", accumulators, "accumulators");
  check_dense("_add_squares", grads, "grads");
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].sizes() != accumulators[i].sizes() || grads[i].strides() != accumulators[i].strides()) {
      refuse("_add_squares", "grads[" + std::to_string(i) + "] (not laid out as its accumulator)");
    }
  }
  check_scalar("_add_squares", sq_norm, true, "sq_norm");
  if (acc_sq_norm) check_scalar("_add_squares", *acc_sq_norm, true, "acc_sq_norm");
  check_scalar("_add_squares", found_inf, false, "found_inf");
  bump_versions(accumulators);
  bump_versions(sq_norm);
  if (acc_sq_norm) bump_versions(*acc_sq_norm);
  bump_versions(found_inf);
  const py::gil_scoped_release no_gil;
  add_squares_cpu(accumulators, grads, sq_norm, acc_sq_norm ? &*acc_sq_norm : nullptr, found_inf);
}

// _NoiseTap(params, found_inf): NoiseTap (ops/noise_tap.h) over dense CPU float parameters.
std::unique_ptr<NoiseTap> make_tap(const std::vector<at::Tensor>& params, const at::Tensor& found_inf) {
  check_dense("_NoiseTap", params, "params");
  check_scalar("_NoiseTap", found_inf, false, "found_inf");
  return std::make_unique<NoiseTap>(params, found_inf);
}

}  // namespace

void bind_scale_accumulate(py::module_& m) {
  m.def("_scale_accumulate", &scale_accumulate, py::arg("accumulators"), py::arg("grads"), py::arg("scale"),
        py::arg("found_inf"), py::arg("run"), py::arg("sq_norm") = py::none(),
        "run=True: checks and runs a plain eager call and returns found_inf; else returns a fault "
        "(\"type\"|\"value\", message), or None where mbs_ext/ops.py has a share. run=False: the checks "
        "alone, a fault or None. sq_norm: None, or the 0-dim tensor the call adds sum(g^2) to.");
  m.def("_sum_squares", &sum_squares, py::arg("tensors"), py::arg("sq_norm"), py::arg("found_inf"),
        "sq_norm += sum of the squares of every element of the CPU tensors (in one read), found_inf = 1.0 "
        "where one is inf or NaN.");
  m.def("_add_squares", &add_squares, py::arg("accumulators"), py::arg("grads"), py::arg("sq_norm"),
        py::arg("acc_sq_norm"), py::arg("found_inf"),
        "accumulators[i] += grads[i] with the squares of the grads into sq_norm and (acc_sq_norm not None) of "
        "the accumulators as read into acc_sq_norm (in one pass), found_inf = 1.0 where one is inf or NaN.");
  py::class_<NoiseTap>(m, "_NoiseTap",
                       "Each parameter's gradient into its .grad with its squares as autograd accumulates it "
                       "(ops/noise_tap.h), hooks on from a step's second weigh() to its end() or finish().")
      .def(py::init(&make_tap), py::arg("params"), py::arg("found_inf"))
      .def("begin", &NoiseTap::begin, "A step begins (every .grad empty): squares and found_inf cleared.")
      .def("end", &NoiseTap::end, "The step is over (or failed): the hooks come off.")
      .def("weigh", py::overload_cast<const at::Tensor&, double>(&NoiseTap::weigh), py::arg("loss"),
           py::arg("weight"), "loss * weight, and the next micro-batch begun (its squares add up apart).")
      .def("weigh", py::overload_cast<const at::Tensor&, const at::Tensor&>(&NoiseTap::weigh), py::arg("loss"),
           py::arg("weight"), "loss * weight (a 0-dim tensor, cast to the loss's dtype), the next micro-batch begun.")
      .def("squares", &NoiseTap::squares, "Each micro-batch's sum of squares (floats), the running one's last.")
      .def("read_pending", &NoiseTap::read_pending, py::call_guard<py::gil_scoped_release>(),
           "The squares of the sums still one gradient as taken, into their micro-batches' slots.")
      .def("finish", &NoiseTap::finish,
           "The squared norm of the final sums with their non-finite check (after read_pending()), the hooks "
           "off, and whether a gradient came in parts within a micro-batch: (|G_B|^2, split).")
      .def("detach", &NoiseTap::detach, "Remove the hooks.");
}

}  // namespace mbs
