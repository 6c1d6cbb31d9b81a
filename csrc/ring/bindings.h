// Python bindings of the streaming ring (StreamRing), added to mbs_ext._C.
#pragma once

// pybind11 is only named here; csrc/module.cpp compiles the .cpp in its own unit.
namespace pybind11 {
class module_;
}  // namespace pybind11

namespace mbs {
void bind_stream_ring(pybind11::module_& m);
}  // namespace mbs
