// Types and helpers shared by every kernel of cupy_paged.
//
// Each specialization is compiled with -DSCALAR_T=__half or -DSCALAR_T=__nv_bfloat16
// (see cupy_paged/_core/compiler.py); kernels are extern "C" so CuPy finds them by name.
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

// The device error word: int[4] = {code, sequence (or token), detail, count}, one per device
// (cupy_paged/_core/errors.py allocates it, passes it to every launch and reads it in check_errors()).
// A kernel that meets a bad index value -- something the host could not check without a copy --
// treats it as a hole and records it here; the first report wins the code, every report counts.
// The codes are _errors.CODES, in this order.
enum ErrorCode : int {
  kErrNone = 0,
  kErrBlockId = 1,      // block_table entry outside [0, num_blocks) where a block is needed (detail: column)
  kErrTableShort = 2,   // cache_seqlens (+ new tokens) past the block table / cache (detail: keys needed)
  kErrSeqlen = 3,       // cache_seqlens negative (detail: the value)
  kErrCuSeqlensQ = 4,   // cu_seqlens_q decreasing, past q, or longer than max_seqlen_q (detail: length)
  kErrCuSeqlensK = 5,   // cu_seqlens_k decreasing or past k (detail: length)
  kErrSlot = 6,         // slot_mapping entry past the cache (sequence: token index; detail: slot, clipped)
  kErrBatchIdx = 7,     // cache_batch_idx outside [0, cache batch) (detail: the value)
  kErrLeftpad = 8,      // cache_leftpad negative or past cache_seqlens (detail: the value)
  kErrRotary = 9,       // a rotary position past rotary_cos's rows (detail: the position)
};

__device__ __forceinline__ void report_error(int* errors, int code, long long where, long long detail) {
  if (errors == nullptr) return;
  if (atomicCAS(errors, 0, code) == 0) {
    errors[1] = static_cast<int>(where);
    errors[2] = static_cast<int>(detail < -2147483647ll ? -2147483647ll : detail > 2147483647ll ? 2147483647ll : detail);
  }
  atomicAdd(errors + 3, 1);
}

}  // namespace cp
