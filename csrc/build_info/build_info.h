// What this build of mbs_ext._C contains: CUDA kernels (and for which GPU archs), OpenMP.
// Free of torch and pybind11 headers so that cuda_archs.cu stays a light nvcc unit.
#pragma once

#include <string>

namespace pybind11 {
class module_;
}  // namespace pybind11

namespace mbs {

// The archs nvcc compiled the kernels for, e.g. "800,900" (cuda_archs.cu; CUDA builds only).
std::string compiled_cuda_archs();

// m.cuda_compiled, m.cuda_archs, m.openmp.
void bind_build_info(pybind11::module_& m);

}  // namespace mbs
