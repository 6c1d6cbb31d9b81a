// Python bindings of the op's argument checks, added to mbs_ext._C.
#pragma once

#include <torch/extension.h>

namespace mbs {
void bind_scale_accumulate_checks(pybind11::module_& m);
}  // namespace mbs
