// Types and helpers shared by every kernel of cupy_paged.
//
// Each specialization is compiled with -DSCALAR_T=__half or -DSCALAR_T=__nv_bfloat16
// (see cupy_paged/_compiler.py); kernels are extern "C" so CuPy finds them by name.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>


namespace cp {

// NVRTC has no <stdint.h>; these are the fixed-width types the kernels use.
using u32 = unsigned int;
using u64 = unsigned long long;
static_assert(sizeof(u32) == 4 && sizeof(u64) == 8, "unexpected integer widths");

// One 16-byte vector: eight 2-byte elements, the unit of every global load and store.
struct alignas(16) Vec8 {
  uint4 raw;
};
constexpr int kVecElems = 8;

// Softmax constants: exp2/log2 take the place of exp/log; +infinity (NVRTC has no <cmath> INFINITY).
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
__device__ __forceinline__ float inf() { return __int_as_float(0x7f800000); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Two floats -> two packed 2-byte values.
__device__ __forceinline__ u32 from_float2(float a, float b, __half) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<u32*>(&h);
}
__device__ __forceinline__ u32 from_float2(float a, float b, __nv_bfloat16) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<u32*>(&h);
}

// The GPU's global nanosecond clock and the SM a thread runs on (for timing traces).
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned sm_id() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}
// The same over the four lanes of a quad (lane ^ 1, lane ^ 2), which hold one row of an mma
// accumulator fragment (mma.cuh).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace cp
