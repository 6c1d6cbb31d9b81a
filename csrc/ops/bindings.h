// mbs_ext._C._scale_accumulate, the Python face's entry into the op (bindings.cpp).
#pragma once

// pybind11 is only named here: the module (csrc/module.cpp) compiles without torch's headers.
namespace pybind11 {
class module_;
}  // namespace pybind11

namespace mbs {
void bind_scale_accumulate(pybind11::module_& m);
}  // namespace mbs
