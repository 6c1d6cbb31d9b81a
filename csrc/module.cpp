// The mbs_ext._C Python module: build facts, the op's checked entry point and the StreamRing
// class. The op itself is registered with the dispatcher (TORCH_LIBRARY) in csrc/ops/.
//
// One compile unit with the two bindings files: both read tensors through torch's pybind11
// header, which takes most of a unit's 15-20 s to parse; included here it is parsed once
// (setup.py leaves */bindings.cpp out of the sources). Each file still answers its own question.
#include "ops/bindings.cpp"   // NOLINT(bugprone-suspicious-include): compiled in this unit
#include "ring/bindings.cpp"  // NOLINT(bugprone-suspicious-include)

#include <pybind11/pybind11.h>

#include <string>

#include "build_info/build_info.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "mbs_ext: the op's checked entry point, the streaming ring and build facts";
  const mbs::BuildInfo info = mbs::build_info();
  m.attr("cuda_compiled") = info.cuda_compiled;
  m.attr("cuda_archs") = info.cuda_archs;
  m.attr("openmp") = info.openmp;
  mbs::bind_scale_accumulate(m);
  mbs::bind_stream_ring(m);
}
