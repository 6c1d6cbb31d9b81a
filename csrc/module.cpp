// The mbs_ext._C Python module: build facts, the op's checked entry point and the StreamRing
// class. The op itself is registered with the dispatcher (TORCH_LIBRARY) in csrc/ops/. Only
// pybind11 here: torch's headers add seconds to every unit that includes them.
#include <pybind11/pybind11.h>

#include <string>

#include "build_info/build_info.h"
#include "ops/bindings.h"
#include "ring/bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "mbs_ext: the op's checked entry point, the streaming ring and build facts";
  const mbs::BuildInfo info = mbs::build_info();
  m.attr("cuda_compiled") = info.cuda_compiled;
  m.attr("cuda_archs") = info.cuda_archs;
  m.attr("openmp") = info.openmp;
  mbs::bind_scale_accumulate(m);
  mbs::bind_stream_ring(m);
}
