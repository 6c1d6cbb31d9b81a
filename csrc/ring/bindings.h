// Python bindings of the streaming ring (StreamRing), added to mbs_ext._C.
#pragma once

#include <torch/extension.h>

namespace mbs {
void bind_stream_ring(pybind11::module_& m);
}  // namespace mbs
