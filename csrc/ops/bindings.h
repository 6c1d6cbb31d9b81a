// mbs_ext._C._scale_accumulate, the Python face's entry into the op (bindings.cpp).
#pragma once

// pybind11 is only named here; csrc/module.cpp compiles the .cpp in its own unit.
namespace pybind11 {
class module_;
}  // namespace pybind11

namespace mbs {
void bind_scale_accumulate(pybind11::module_& m);
}  // namespace mbs
