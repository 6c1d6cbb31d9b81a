// A CPU-only build (MBS_EXT_CUDA=0): a CUDA ring is refused when it is created.
#include <c10/util/Exception.h>

#include "ring/device_transfer.h"

namespace mbs {

std::unique_ptr<DeviceTransfer> make_cuda_transfer(c10::Device device, int /*slots*/) {
  TORCH_CHECK(false, "StreamRing: device ", device, " needs CUDA, but mbs_ext was built without CUDA");
}

}  // namespace mbs
