// write_kv_cache: scatter new K/V tokens into the paged caches through a slot mapping.
//
// Launch: one thread per 16-byte vector of one (token, kv head) row of K and of V;
// grid.x covers num_tokens * num_kv_heads * (HEAD_DIM / 8) vectors.  A negative slot
// (padding) is skipped; a slot at or past the cache's capacity is skipped too, so no
// slot mapping can make this kernel write outside the caches.
#include "common.cuh"

extern "C" __global__ void write_kv_cache(
    const cp::Vec8* __restrict__ k, const cp::Vec8* __restrict__ v,  // [num_tokens, Hkv, D], rows dense
    cp::Vec8* __restrict__ k_cache, cp::Vec8* __restrict__ v_cache,  // [num_blocks * block_size, Hkv, D]
    const int* __restrict__ slot_mapping,                            // [num_tokens]
    int num_tokens, int num_kv_heads, long long num_slots,
    long long k_token_stride, long long k_head_stride,               // in 16-byte vectors
    long long v_token_stride, long long v_head_stride) {
  constexpr int kRowVecs = HEAD_DIM / cp::kVecElems;
  const long long index = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (index >= (long long)num_tokens * num_kv_heads * kRowVecs) return;
  const int vec = index % kRowVecs;
  const int head = (index / kRowVecs) % num_kv_heads;
  const int token = index / ((long long)kRowVecs * num_kv_heads);
  const long long slot = slot_mapping[token];
  if (slot < 0 || slot >= num_slots) return;
  const long long dst = (slot * num_kv_heads + head) * kRowVecs + vec;
  k_cache[dst] = k[token * k_token_stride + head * k_head_stride + vec];
  v_cache[dst] = v[token * v_token_stride + head * v_head_stride + vec];
}
