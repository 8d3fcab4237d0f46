// merge_states: cascade / shared-prefix merge of two partial attentions over the same queries
// (merge_attention_states).  One specialization: dtype and head dim are run-time, each dtype has
// its own entry point.
#include "common.cuh"

using cp::inf;

// out_x [tokens, H, D] (contiguous, dtype X); lse_x [num_seqs, H, seqlen] float32 with
// tokens = num_seqs * seqlen (varlen: [H, tokens], one sequence; decode: [B, H, Sq]).  One thread per element;
// a side whose LSE is -inf contributes nothing (its output is never read).
template <typename X>
__device__ __forceinline__ void merge_states_impl(const X* a, const float* lse_a, const X* b, const float* lse_b,
                                                  X* out, float* lse_out, long long tokens, int seqlen,
                                                  int heads, int dim) {
  const long long index = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (index >= tokens * heads * dim) return;
  const long long t = index / ((long long)heads * dim);
  const int h = (index / dim) % heads, d = index % dim;
  // LSE of token t = (sequence, position) in [num_seqs, H, seqlen]; varlen is one sequence of all tokens.
  const long long at = ((t / seqlen) * heads + h) * seqlen + t % seqlen;
  const float la = lse_a[at], lb = lse_b[at];
  const float mx = fmaxf(la, lb);
  float value = 0.f, merged = -inf();
  if (mx != -inf()) {
    const float wa = __expf(la - mx), wb = __expf(lb - mx);
    float sum = 0.f;
    if (wa > 0.f) sum = fmaf(wa, static_cast<float>(a[index]), sum);
    if (wb > 0.f) sum = fmaf(wb, static_cast<float>(b[index]), sum);
    value = sum / (wa + wb);
    merged = mx + __logf(wa + wb);
  }
  out[index] = static_cast<X>(value);
  if (lse_out && d == 0) lse_out[at] = merged;
}

#define DEFINE_MERGE(NAME, X)                                                                        \
  extern "C" __global__ void NAME(const X* a, const float* lse_a, const X* b, const float* lse_b,   \
                                  X* out, float* lse_out, long long tokens, int seqlen, int heads,  \
                                  int dim) {                                                         \
    merge_states_impl<X>(a, lse_a, b, lse_b, out, lse_out, tokens, seqlen, heads, dim);              \
  }
DEFINE_MERGE(merge_states_float32, float)
DEFINE_MERGE(merge_states_float16, __half)
DEFINE_MERGE(merge_states_bfloat16, __nv_bfloat16)
