// The schema of mbs_ext::scale_accumulate_. The kernels register themselves
// (cpu/, cuda/); the Python face, with its fake implementation, is mbs_ext/ops.py.
#include <torch/library.h>

TORCH_LIBRARY(mbs_ext, m) {
  m.def(
      "scale_accumulate_(Tensor(a!)[] accumulators, Tensor[] grads, Tensor scale, "
      "Tensor(b!) found_inf) -> ()");
}
