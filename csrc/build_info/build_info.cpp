#include "build_info/build_info.h"

#include <pybind11/pybind11.h>

#include <string>

namespace mbs {

void bind_build_info(pybind11::module_& m) {
#ifdef MBS_EXT_WITH_CUDA
  m.attr("cuda_compiled") = true;
  m.attr("cuda_archs") = compiled_cuda_archs();
#else
  m.attr("cuda_compiled") = false;
  m.attr("cuda_archs") = std::string();
#endif
  m.attr("openmp") = static_cast<bool>(MBS_EXT_OPENMP);
}

}  // namespace mbs
