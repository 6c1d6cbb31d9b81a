// The mbs_ext._C Python module: build facts, the op's checked entry point and the StreamRing
// class. The op itself is registered with the dispatcher (TORCH_LIBRARY) in csrc/ops/. Only
// pybind11 here: torch's headers cost each unit that includes them most of a minute to compile.
#include <pybind11/pybind11.h>

#include "build_info/build_info.h"
#include "ops/bindings.h"
#include "ring/bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "mbs_ext: the op's checked entry point, the streaming ring and build facts";
  mbs::bind_build_info(m);
  mbs::bind_scale_accumulate(m);
  mbs::bind_stream_ring(m);
}
