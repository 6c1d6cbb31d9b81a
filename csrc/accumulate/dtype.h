// The element types of the scale-and-accumulate op, and the one dtype-pair dispatch.
//
// Both kernels reach their per-pair code through dispatch_pair: the CPU kernel picks
// a loop (accumulate.h), the CUDA kernel a launch (csrc/ops/cuda/). f receives two
// DTypeTag values, compile-time constants for the accumulator and the grad dtype.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <type_traits>

namespace mbs::accumulate {

enum class DType : int { f32 = 0, f64 = 1, bf16 = 2, f16 = 3 };
constexpr int kNumDTypes = 4;

template <DType D> using DTypeTag = std::integral_constant<DType, D>;

inline int64_t element_size(DType d) { return d == DType::f64 ? 8 : d == DType::f32 ? 4 : 2; }

// f(DTypeTag<d>{}) for a dtype known only at run time.
template <typename F> decltype(auto) dispatch_dtype(DType d, F&& f) {
  switch (d) {
    case DType::f32: return f(DTypeTag<DType::f32>{});
    case DType::f64: return f(DTypeTag<DType::f64>{});
    case DType::bf16: return f(DTypeTag<DType::bf16>{});
    case DType::f16: return f(DTypeTag<DType::f16>{});
  }
  throw std::invalid_argument("accumulate: unknown dtype");
}

// f(DTypeTag<acc>{}, DTypeTag<grad>{}): the 4 x 4 (accumulator, grad) combinations.
template <typename F> decltype(auto) dispatch_pair(DType acc, DType grad, F&& f) {
  return dispatch_dtype(acc, [&](auto a) -> decltype(auto) {
    return dispatch_dtype(grad, [&](auto g) -> decltype(auto) { return f(a, g); });
  });
}

}  // namespace mbs::accumulate
