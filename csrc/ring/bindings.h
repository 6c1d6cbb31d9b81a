// Python bindings of the streaming ring (StreamRing), added to mbs_ext._C.
#pragma once

// pybind11 is only named here: the module (csrc/module.cpp) compiles without torch's headers.
namespace pybind11 {
class module_;
}  // namespace pybind11

namespace mbs {
void bind_stream_ring(pybind11::module_& m);
}  // namespace mbs
