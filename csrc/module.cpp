// The mbs_ext._C Python module: build facts, the op's argument scans and the StreamRing class. The ops
// themselves are registered with the dispatcher (TORCH_LIBRARY) in csrc/ops/.
#include <torch/extension.h>

#include <string>

#include "ops/bindings.h"
#include "ring/bindings.h"

namespace mbs {
#ifdef MBS_EXT_WITH_CUDA
std::string compiled_cuda_archs();
#endif
}  // namespace mbs

PYBIND11_MODULE(_C, m) {
  m.doc() = "mbs_ext native core";
#ifdef MBS_EXT_WITH_CUDA
  m.attr("cuda_compiled") = true;
  m.attr("cuda_archs") = mbs::compiled_cuda_archs();
#else
  m.attr("cuda_compiled") = false;
  m.attr("cuda_archs") = std::string();
#endif
  m.attr("openmp") = static_cast<bool>(MBS_EXT_OPENMP);
  mbs::bind_scale_accumulate_checks(m);
  mbs::bind_stream_ring(m);
}
