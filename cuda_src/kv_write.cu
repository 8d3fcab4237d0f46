// write_kv_cache: scatter new K/V tokens into the paged caches through a slot mapping.
//
// Launch: grid.x = num_tokens, one CTA of kThreads threads per token; the CTA copies the
// token's num_kv_heads * HEAD_DIM elements of K and of V as 16-byte vectors, all loads of
// a thread issued before its stores.  Index arithmetic is 32-bit with a compile-time row
// length, so the kernel is bound by memory, not by 64-bit integer division.  A negative
// slot (padding) is skipped; a slot at or past the cache's capacity is skipped too, so no
// slot mapping can make this kernel write outside the caches, and reported to the device
// error word (kErrSlot: where = the token, detail = the slot), once per token.
#include "common.cuh"
#include "paged.cuh"

constexpr int kThreads = 128;
constexpr int kUnroll = 4;                          // vectors of K and of V in flight per thread
constexpr int kRowVecs = HEAD_DIM / cp::kVecElems;  // 16-byte vectors per (token, head) row

extern "C" __global__ void __launch_bounds__(kThreads) write_kv_cache(
    const uint4* __restrict__ k, const uint4* __restrict__ v,  // [num_tokens, Hkv, D], rows dense
    uint4* __restrict__ k_cache, uint4* __restrict__ v_cache,  // [num_blocks * block_size, Hkv, D]
    const int* __restrict__ slot_mapping,                      // [num_tokens]
    int num_kv_heads, long long num_slots,
    long long k_token_stride, int k_head_stride,               // in 16-byte vectors
    long long v_token_stride, int v_head_stride,
    int* errors) {                                             // the device error word, or null
  const long long token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0) return;  // padding
  if (!paged::is_slot(slot, num_slots)) {
    if (threadIdx.x == 0) cp::report_error(errors, cp::kErrSlot, token, slot);
    return;
  }
  const int row_vecs = num_kv_heads * kRowVecs;
  const uint4* k_src = k + token * k_token_stride;
  const uint4* v_src = v + token * v_token_stride;
  uint4* k_dst = k_cache + slot * row_vecs;
  uint4* v_dst = v_cache + slot * row_vecs;
  for (int base = threadIdx.x; base < row_vecs; base += kThreads * kUnroll) {
    uint4 k_vec[kUnroll], v_vec[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kThreads;
      if (i < row_vecs) {
        const int head = i / kRowVecs, vec = i % kRowVecs;
        k_vec[u] = __ldg(k_src + head * k_head_stride + vec);
        v_vec[u] = __ldg(v_src + head * v_head_stride + vec);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kThreads;
      if (i < row_vecs) {
        k_dst[i] = k_vec[u];
        v_dst[i] = v_vec[u];
      }
    }
  }
}
