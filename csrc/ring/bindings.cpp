#include "ring/bindings.h"

namespace mbs {
void bind_stream_ring(pybind11::module_& m) { (void)m; }
}  // namespace mbs
