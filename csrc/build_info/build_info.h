// What this build of mbs_ext._C contains: CUDA kernels (and for which GPU archs), OpenMP.
// Free of torch and pybind11 headers: cuda_archs.cu stays a light nvcc unit and build_info.cpp
// compiles in a second; csrc/module.cpp hands the facts to Python.
#pragma once

#include <string>

namespace mbs {

// The archs nvcc compiled the kernels for, e.g. "800,900" (cuda_archs.cu; CUDA builds only).
std::string compiled_cuda_archs();

struct BuildInfo {
  bool cuda_compiled;
  std::string cuda_archs;  // empty without CUDA kernels
  bool openmp;
};

BuildInfo build_info();

}  // namespace mbs
