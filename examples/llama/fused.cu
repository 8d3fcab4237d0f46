// The Llama model's per-token work between its matrix products, one kernel per step of it, so a
// layer is four cuBLAS products, three of these kernels and the attention launch.  SCALAR_T is the
// weights' dtype (__nv_bfloat16 or __half); sums and the residual stream are float.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef SCALAR_T scalar_t;

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }

// Sum of v over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int warps = blockDim.x >> 5;
    v = lane < warps ? partial[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    __syncthreads();  // partial may be reused by a later call
    return v;
}

// One row per block: x_out = x + delta (delta may be null: x_out = x), and
// h = x_out / sqrt(mean(x_out^2) + eps) * weight in scalar_t.  x_out may be x.  A thread keeps its
// (up to ROW_CACHE, fused.py's, given at compile time) values of the row in registers, their loads
// issued together, so a row costs one round trip to memory, the block's sum, and the stores; the
// host gives a block enough threads for the whole row (fused.py), and a longer row runs the loop
// below it, which reads x_out back.
extern "C" __global__ void add_rms_norm(const float* x, const scalar_t* __restrict__ delta,
                                        const float* __restrict__ weight, float* x_out,
                                        scalar_t* __restrict__ h, int hidden, float eps) {
    const long long row = (long long)blockIdx.x * hidden;
    float squares = 0.0f;
    if (hidden <= ROW_CACHE * (int)blockDim.x) {
        float v[ROW_CACHE];
#pragma unroll
        for (int k = 0; k < ROW_CACHE; ++k) {
            const int c = threadIdx.x + k * blockDim.x;
            v[k] = c < hidden ? x[row + c] : 0.0f;
            if (delta != nullptr && c < hidden) v[k] += to_float(delta[row + c]);
        }
#pragma unroll
        for (int k = 0; k < ROW_CACHE; ++k) {
            const int c = threadIdx.x + k * blockDim.x;
            if (c < hidden) x_out[row + c] = v[k];
            squares += v[k] * v[k];
        }
        const float scale = rsqrtf(block_sum(squares) / hidden + eps);
#pragma unroll
        for (int k = 0; k < ROW_CACHE; ++k) {
            const int c = threadIdx.x + k * blockDim.x;
            if (c < hidden) store(h + row + c, v[k] * scale * weight[c]);
        }
        return;
    }
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
        float v = x[row + c];
        if (delta != nullptr) v += to_float(delta[row + c]);
        x_out[row + c] = v;
        squares += v * v;
    }
    const float scale = rsqrtf(block_sum(squares) / hidden + eps);
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
        store(h + row + c, x_out[row + c] * scale * weight[c]);
    }
}

// One (token, head) per block, blockIdx.x the token and blockIdx.y the head of qkv
// [tokens, (hq + 2 hkv) * D]: a q head (y < hq) into q [tokens, hq, D], a k head into k and a v
// head into v [tokens, hkv, D], q and k rotated by the angles of the token's position (GPT-NeoX
// layout: dimension i pairs with i + D/2; cos / sin [positions, D/2]).  A thread handles pairs i,
// so a decode step's few tokens still spread over every SM.
extern "C" __global__ void rotary_split(const scalar_t* __restrict__ qkv, const int* __restrict__ positions,
                                        const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                                        scalar_t* __restrict__ q, scalar_t* __restrict__ k,
                                        scalar_t* __restrict__ v, int hq, int hkv, int head_dim) {
    const int t = blockIdx.x, head = blockIdx.y, half = head_dim / 2;
    const scalar_t* src = qkv + ((long long)t * (hq + 2 * hkv) + head) * head_dim;
    if (head >= hq + hkv) {
        scalar_t* dst = v + ((long long)t * hkv + head - hq - hkv) * head_dim;
        for (int i = threadIdx.x; i < head_dim; i += blockDim.x) dst[i] = src[i];
        return;
    }
    const float* cos_row = cos_table + (long long)positions[t] * half;
    const float* sin_row = sin_table + (long long)positions[t] * half;
    scalar_t* dst = head < hq ? q + ((long long)t * hq + head) * head_dim
                              : k + ((long long)t * hkv + head - hq) * head_dim;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float x1 = to_float(src[i]), x2 = to_float(src[i + half]);
        const float c = cos_row[i], s = sin_row[i];
        // Each product and sum rounded on its own, as the decode kernel's fused rotary does
        // (cuda_src/rotary.cuh): a decode step rotates there, the other steps here, bit for bit alike.
        store(dst + i, __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
        store(dst + i + half, __fadd_rn(__fmul_rn(x1, s), __fmul_rn(x2, c)));
    }
}

// SwiGLU: out [rows, size] = silu(gate) * up of gate_up [rows, 2 * size] (gate first); blockIdx.y is
// the row.
extern "C" __global__ void swiglu(const scalar_t* __restrict__ gate_up, scalar_t* __restrict__ out, int size) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= size) return;
    const long long r = blockIdx.y;
    const float gate = to_float(gate_up[r * 2 * size + c]), up = to_float(gate_up[r * 2 * size + size + c]);
    store(out + r * size + c, gate / (1.0f + expf(-gate)) * up);
}

// out [tokens, hidden] float = table[ids[t]] (the embedding rows of the step's tokens).
extern "C" __global__ void embed_rows(const scalar_t* __restrict__ table, const int* __restrict__ ids,
                                      float* __restrict__ out, int hidden) {
    const scalar_t* row = table + (long long)ids[blockIdx.x] * hidden;
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) out[(long long)blockIdx.x * hidden + c] = to_float(row[c]);
}

// (value, index) a beats b: NaN above every number, then the larger value, then the lower index
// (NumPy's argmax).
__device__ __forceinline__ bool beats(float a, int ia, float b, int ib) {
    const bool na = isnan(a), nb = isnan(b);
    if (na != nb) return na;
    if (!na && a != b) return a > b;
    return ia < ib;
}

// One row per block: out[row] = the index of the row's largest logit (the order in which a thread
// meets its elements does not matter: beats() breaks ties by index).
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, long long* __restrict__ out, int vocab) {
    __shared__ float best_value[32];
    __shared__ int best_index[32];
    const float* row = logits + (long long)blockIdx.x * vocab;
    float value = -__int_as_float(0x7f800000);
    int index = vocab;
    // ARGMAX_BATCH loads a thread issues together before comparing them, so a row of tens of
    // thousands of logits costs a few round trips to memory, not one per element.
    constexpr int ARGMAX_BATCH = 8;
    for (int base = threadIdx.x; base < vocab; base += ARGMAX_BATCH * blockDim.x) {
        float v[ARGMAX_BATCH];
#pragma unroll
        for (int k = 0; k < ARGMAX_BATCH; ++k) {
            const int c = base + k * blockDim.x;
            v[k] = c < vocab ? row[c] : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < ARGMAX_BATCH; ++k) {
            const int c = base + k * blockDim.x;
            if (c < vocab && (index == vocab || beats(v[k], c, value, index))) value = v[k], index = c;
        }
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float v = __shfl_xor_sync(0xffffffffu, value, offset);
        const int i = __shfl_xor_sync(0xffffffffu, index, offset);
        if (i != vocab && (index == vocab || beats(v, i, value, index))) value = v, index = i;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) best_value[warp] = value, best_index[warp] = index;
    __syncthreads();
    if (warp == 0) {
        const int warps = blockDim.x >> 5;
        value = lane < warps ? best_value[lane] : -__int_as_float(0x7f800000);
        index = lane < warps ? best_index[lane] : vocab;
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float v = __shfl_xor_sync(0xffffffffu, value, offset);
            const int i = __shfl_xor_sync(0xffffffffu, index, offset);
            if (i != vocab && (index == vocab || beats(v, i, value, index))) value = v, index = i;
        }
        if (lane == 0) out[blockIdx.x] = index;
    }
}
