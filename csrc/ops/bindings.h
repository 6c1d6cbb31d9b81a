// mbs_ext._C._scale_accumulate, the Python face's entry into the op (bindings.cpp).
#pragma once

#include <torch/extension.h>

namespace mbs {
void bind_scale_accumulate(pybind11::module_& m);
}  // namespace mbs
