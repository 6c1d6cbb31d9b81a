// CUDA kernel of mbs_ext::scale_accumulate_: acc[i] += scale * grad[i] over many
// tensors per launch (multi_tensor.cuh), one launch set per (accumulator dtype, grad
// dtype) pair present. Metadata travels as kernel arguments, scale, found_inf and sq_norm
// stay on the device: no host synchronization, no host staging memory, capturable in a
// CUDA graph (sq_norm is one atomic add per block). Runs on the current stream. The per-thread work is
// accumulate/scale_accumulate_block.h, shared with its host emulation test.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <vector>

#include "accumulate/scale_accumulate_block.h"
#include "accumulate/dtype.h"
#include "ops/arguments.h"
#include "ops/cuda/multi_tensor.cuh"
#include "ops/dense_pairs.h"
#include "ops/kernels.h"

namespace mbs::accumulate {

// The device's 16-bit floats compute in float: widened exactly, narrowed with
// round-to-nearest-even.
template <> struct Convert<__nv_bfloat16, float> {
  MBS_HOST_DEVICE static float to(__nv_bfloat16 v) { return __bfloat162float(v); }
  MBS_HOST_DEVICE static __nv_bfloat16 from(float v) { return __float2bfloat16_rn(v); }
};
template <> struct Convert<__half, float> {
  MBS_HOST_DEVICE static float to(__half v) { return __half2float(v); }
  MBS_HOST_DEVICE static __half from(float v) { return __float2half_rn(v); }
};
// Grads into a float64 accumulator (never the other way: a 16-bit accumulator
// computes in float).
template <> struct Convert<__nv_bfloat16, double> {
  MBS_HOST_DEVICE static double to(__nv_bfloat16 v) { return static_cast<double>(__bfloat162float(v)); }
};
template <> struct Convert<__half, double> {
  MBS_HOST_DEVICE static double to(__half v) { return static_cast<double>(__half2float(v)); }
};

}  // namespace mbs::accumulate

namespace mbs {
namespace {

using accumulate::DType;
using cuda::PairListMeta;

// The device's element type for each dtype.
template <DType D> struct DeviceType;
template <> struct DeviceType<DType::f32> { using type = float; };
template <> struct DeviceType<DType::f64> { using type = double; };
template <> struct DeviceType<DType::bf16> { using type = __nv_bfloat16; };
template <> struct DeviceType<DType::f16> { using type = __half; };

struct ScaleArg {
  const void* ptr;  // device scale, or null
  double value;     // CPU scale
  bool is_double;
};

// Where the sum of squares goes: null (not asked for), or a float/double on the device.
struct SquaresArg {
  void* ptr;
  bool is_double;
};

template <typename Op>
void launch_op(const DensePairs& dense, const std::vector<size_t>& members, const ScaleArg& scale, float* found_inf,
               const SquaresArg& squares, cudaStream_t stream) {
  std::vector<std::array<void*, 2>> addresses;
  std::vector<int64_t> numels;
  addresses.reserve(members.size());
  numels.reserve(members.size());
  for (const size_t i : members) {
    addresses.push_back({dense.acc(i).data_ptr(), const_cast<void*>(dense.grad(i).const_data_ptr())});
    numels.push_back(dense.acc(i).numel());
  }
  Op op{};
  op.scale_ptr = scale.ptr;
  op.scale_value = static_cast<typename Op::C>(scale.value);
  op.found_inf = found_inf;
  op.sq_norm = squares.ptr;
  op.scale_is_double = scale.is_double;
  op.sq_norm_is_double = squares.is_double;
  using A = typename Op::Acc;
  using G = typename Op::Grad;
  cuda::multi_tensor_apply<PairListMeta>(addresses, numels, {int64_t{sizeof(A)}, int64_t{sizeof(G)}}, op, stream);
}

// One launch set for the pairs of one (accumulator, grad) dtype pair: the kernel that sums
// squares only when asked, so a call without sq_norm runs the kernel it ran before.
template <typename DA, typename DG>
void launch_group(const DensePairs& dense, const std::vector<size_t>& members, const ScaleArg& scale,
                  float* found_inf, const SquaresArg& squares, cudaStream_t stream) {
  if (squares.ptr == nullptr) {
    launch_op<accumulate::ScaleAccumulateBlock<DA, DG>>(dense, members, scale, found_inf, squares, stream);
  } else {
    launch_op<accumulate::ScaleAccumulateBlock<DA, DG, true>>(dense, members, scale, found_inf, squares, stream);
  }
}

void run_cuda(at::TensorList accumulators, at::TensorList grads, const Scale& scale, const at::Tensor& found_inf,
              const at::Tensor* sq_norm, c10::Device device) {
  if (accumulators.empty()) return;
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();

  ScaleArg scale_arg{nullptr, scale.value, false};
  if (scale.tensor != nullptr) {
    const at::Tensor& t = *scale.tensor;
    if (t.is_cpu()) {  // host memory: no device sync
      scale_arg.value = t.scalar_type() == at::kDouble ? *t.const_data_ptr<double>() : *t.const_data_ptr<float>();
    } else {
      scale_arg.ptr = t.const_data_ptr();
      scale_arg.is_double = t.scalar_type() == at::kDouble;
    }
  }
  float* found_inf_ptr = found_inf.data_ptr<float>();
  const SquaresArg squares{sq_norm != nullptr ? sq_norm->data_ptr() : nullptr,
                           sq_norm != nullptr && sq_norm->scalar_type() == at::kDouble};

  DensePairs dense(accumulators, grads);
  constexpr int kTypes = accumulate::kNumDTypes;
  std::vector<size_t> groups[kTypes][kTypes];  // [acc dtype][grad dtype] -> pair indices
  for (size_t i = 0; i < dense.size(); ++i) {
    const auto a = static_cast<int>(*float_dtype(dense.acc(i).scalar_type()));
    const auto g = static_cast<int>(*float_dtype(dense.grad(i).scalar_type()));
    groups[a][g].push_back(i);
  }
  for (int a = 0; a < kTypes; ++a) {
    for (int g = 0; g < kTypes; ++g) {
      const std::vector<size_t>& members = groups[a][g];
      if (members.empty()) continue;
      accumulate::dispatch_pair(static_cast<DType>(a), static_cast<DType>(g), [&](auto acc_type, auto grad_type) {
        using DA = typename DeviceType<decltype(acc_type)::value>::type;
        using DG = typename DeviceType<decltype(grad_type)::value>::type;
        launch_group<DA, DG>(dense, members, scale_arg, found_inf_ptr, squares, stream);
      });
    }
  }
  dense.write_back();
}

void scale_accumulate_cuda(at::TensorList accumulators, at::TensorList grads, const at::Tensor& scale,
                           const at::Tensor& found_inf, const std::optional<at::Tensor>& sq_norm) {
  // All checks (including that every tensor is a CUDA tensor on one device) run
  // before any pointer is taken.
  const at::Tensor* sq = sq_norm.has_value() ? &*sq_norm : nullptr;
  const c10::Device device =
      check_scale_accumulate_args(accumulators, grads, scale, found_inf, sq, c10::DeviceType::CUDA);
  run_cuda(accumulators, grads, Scale{&scale, 0.0}, found_inf, sq, device);
}

[[maybe_unused]] const bool registered = register_kernel(c10::DeviceType::CUDA, &run_cuda);

}  // namespace
}  // namespace mbs

TORCH_LIBRARY_IMPL(mbs_ext, CUDA, m) { m.impl("scale_accumulate_", &mbs::scale_accumulate_cuda); }
