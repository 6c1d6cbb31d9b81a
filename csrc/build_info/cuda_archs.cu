// A CUDA translation unit of its own: nvcc defines __CUDA_ARCH_LIST__ (the archs of
// this compilation) for .cu files only.
#include <string>

#include "build_info/build_info.h"

namespace mbs {

std::string compiled_cuda_archs() {
#ifdef __CUDA_ARCH_LIST__
#define MBS_STR2(...) #__VA_ARGS__
#define MBS_STR(...) MBS_STR2(__VA_ARGS__)
  return MBS_STR(__CUDA_ARCH_LIST__);
#else
  return "";
#endif
}

}  // namespace mbs
