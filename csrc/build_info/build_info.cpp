#include "build_info/build_info.h"

namespace mbs {

BuildInfo build_info() {
#ifdef MBS_EXT_WITH_CUDA
  return {true, compiled_cuda_archs(), static_cast<bool>(MBS_EXT_OPENMP)};
#else
  return {false, std::string(), static_cast<bool>(MBS_EXT_OPENMP)};
#endif
}

}  // namespace mbs
