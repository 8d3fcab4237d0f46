// The products of a decode step: C[M, N] = A[M, K] @ W[K, N] for at most 16 * M_TILES rows of A
// (one row per sequence), in SCALAR_T (bf16 or fp16) with float sums; C in OUT_T (SCALAR_T or float).
//
// At such M a product reads its weight once and A (a few hundred KB, from the L2) once per column
// tile, so it is bound by the weight's read.  A CTA takes BN columns and a share of K: the SPLITS
// CTAs of one column tile form a thread block cluster (along y), each streams its K range of the
// weight through a STAGES-deep cp.async pipeline into mma.sync, and they add their partial sums
// through distributed shared memory, each CTA the rows of its rank, in rank order (so the result
// does not depend on timing).  Needs sm_90 for the cluster; launched with grid (N / BN, SPLITS).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef SCALAR_T scalar_t;
typedef OUT_T out_t;

constexpr int kBK = 64;                      // K of a pipeline stage
constexpr int kThreads = 128;                // 4 warps, each BN / 4 columns of every row
constexpr int kRows = 16 * M_TILES;          // rows of A in shared memory
constexpr int kWarpN = BN / 4;
constexpr int kNB = kWarpN / 8;              // n8 blocks of a warp
constexpr int kAStage = kRows * kBK;         // elements of A in a stage
constexpr int kWStage = kBK * BN;            // elements of W in a stage
static_assert(BN == 64 || BN == 128, "BN is 64 or 128");
static_assert(SPLITS == 1 || SPLITS == 2 || SPLITS == 4 || SPLITS == 8, "SPLITS is 1, 2, 4 or 8");
static_assert(kRows % SPLITS == 0, "every rank reduces whole rows");
static_assert(STAGES * (kAStage + kWStage) * 2 >= kRows * BN * 4, "the partial tile fits the stages");

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes from global to shared memory, or 16 zero bytes when !valid (src then unread).
__device__ __forceinline__ void copy16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

__device__ __forceinline__ void mma(float* d, const unsigned* a, const unsigned* b) {
#if defined(SCALAR_IS_BF16)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
#endif
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void store2(float* p, float x, float y) { *reinterpret_cast<float2*>(p) = make_float2(x, y); }
__device__ __forceinline__ void store2(__nv_bfloat16* p, float x, float y) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
}
__device__ __forceinline__ void store2(__half* p, float x, float y) {
    *reinterpret_cast<__half2*>(p) = __floats2half2_rn(x, y);
}

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// The address of `p` (this CTA's shared memory) in the shared memory of cluster rank `rank`.
__device__ __forceinline__ unsigned remote_addr(const void* p, unsigned rank) {
    unsigned out;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(smem_addr(p)), "r"(rank));
    return out;
}

__device__ __forceinline__ float4 remote_load4(unsigned addr) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr));
    return v;
}

#if SPLITS > 1
#define CLUSTER __cluster_dims__(1, SPLITS, 1)
#else
#define CLUSTER
#endif

extern "C" __global__ void CLUSTER __launch_bounds__(kThreads)
decode_product(const scalar_t* __restrict__ a, const scalar_t* __restrict__ w, out_t* __restrict__ c, int m,
               int n, int k) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    scalar_t* smem = reinterpret_cast<scalar_t*>(smem_raw);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int n0 = blockIdx.x * BN;
    const int rank = SPLITS == 1 ? 0 : (int)cluster_rank();
    const int chunks = k / kBK;
    const int first = rank * chunks / SPLITS, last = (rank + 1) * chunks / SPLITS;

    // Stage s: A rows of 64 elements (8 chunks of 16 bytes, chunk j at j ^ (row & 7)), then W rows
    // of BN elements (chunk j at j ^ (row & 7)): ldmatrix reads 8 rows at one chunk conflict-free.
    auto load = [&](int chunk, int stage) {
        scalar_t* as = smem + stage * (kAStage + kWStage);
        scalar_t* ws = as + kAStage;
        const int k0 = chunk * kBK;
#pragma unroll
        for (int i = 0; i < kRows * 8 / kThreads; ++i) {
            const int idx = tid + i * kThreads, row = idx >> 3, j = idx & 7;
            const bool valid = row < m;
            copy16(as + row * kBK + ((j ^ (row & 7)) << 3), valid ? a + (long long)row * k + k0 + (j << 3) : a, valid);
        }
        constexpr int kChunksPerRow = BN / 8;
#pragma unroll
        for (int i = 0; i < kBK * kChunksPerRow / kThreads; ++i) {
            const int idx = tid + i * kThreads, row = idx / kChunksPerRow, j = idx % kChunksPerRow;
            copy16(ws + row * BN + ((j ^ (row & 7)) << 3), w + (long long)(k0 + row) * n + n0 + (j << 3), true);
        }
    };

    float acc[M_TILES][kNB][4];
#pragma unroll
    for (int t = 0; t < M_TILES; ++t)
#pragma unroll
        for (int b = 0; b < kNB; ++b)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[t][b][e] = 0.0f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (first + s < last) load(first + s, s);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    for (int chunk = first; chunk < last; ++chunk) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
        __syncthreads();  // the chunk is in, and every warp is done with the stage the next load refills
        const int ahead = chunk + STAGES - 1;
        if (ahead < last) load(ahead, (ahead - first) % STAGES);
        asm volatile("cp.async.commit_group;\n" ::);
        const scalar_t* as = smem + ((chunk - first) % STAGES) * (kAStage + kWStage);
        const scalar_t* ws = as + kAStage;
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
            unsigned af[M_TILES][4], bf[kNB][2];
#pragma unroll
            for (int t = 0; t < M_TILES; ++t) {
                const int row = t * 16 + (lane & 15), j = kk * 2 + (lane >> 4);
                ldmatrix_x4(af[t], as + row * kBK + ((j ^ (row & 7)) << 3));
            }
#pragma unroll
            for (int p = 0; p < kNB / 2; ++p) {
                const int row = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                const int j = (warp * kWarpN + p * 16 + (lane >> 4) * 8) >> 3;
                unsigned r[4];
                ldmatrix_x4_trans(r, ws + row * BN + ((j ^ (row & 7)) << 3));
                bf[2 * p][0] = r[0]; bf[2 * p][1] = r[1]; bf[2 * p + 1][0] = r[2]; bf[2 * p + 1][1] = r[3];
            }
#pragma unroll
            for (int t = 0; t < M_TILES; ++t)
#pragma unroll
                for (int b = 0; b < kNB; ++b) mma(acc[t][b], af[t], bf[b]);
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::);

    const int g = lane >> 2, q = lane & 3;
    if constexpr (SPLITS == 1) {
#pragma unroll
        for (int t = 0; t < M_TILES; ++t)
#pragma unroll
            for (int b = 0; b < kNB; ++b) {
                const int col = n0 + warp * kWarpN + b * 8 + 2 * q;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = t * 16 + g + 8 * h;
                    if (row < m) store2(c + (long long)row * n + col, acc[t][b][2 * h], acc[t][b][2 * h + 1]);
                }
            }
    } else {
        // This CTA's partial tile [kRows][BN] as floats over the stages (all loads have landed and
        // no warp reads the stages any more after the barrier), then the cluster's sum.
        __syncthreads();
        float* part = reinterpret_cast<float*>(smem_raw);
#pragma unroll
        for (int t = 0; t < M_TILES; ++t)
#pragma unroll
            for (int b = 0; b < kNB; ++b) {
                const int col = warp * kWarpN + b * 8 + 2 * q;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = t * 16 + g + 8 * h;
                    *reinterpret_cast<float2*>(part + row * BN + col) = make_float2(acc[t][b][2 * h], acc[t][b][2 * h + 1]);
                }
            }
        cluster_sync();  // every rank's partial is written
        constexpr int kMine = kRows / SPLITS;    // rows this rank adds up and stores
        constexpr int kVectors = kMine * BN / 4; // float4s of them
        const int row0 = rank * kMine;
        for (int v = tid; v < kVectors; v += kThreads) {
            const int row = row0 + v / (BN / 4), col = (v % (BN / 4)) * 4;
            if (row >= m) continue;
            float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (int r = 0; r < SPLITS; ++r) {
                const float4 x = remote_load4(remote_addr(part + row * BN + col, r));
                sum.x += x.x; sum.y += x.y; sum.z += x.z; sum.w += x.w;
            }
            out_t* dst = c + (long long)row * n + n0 + col;
            store2(dst, sum.x, sum.y);
            store2(dst + 2, sum.z, sum.w);
        }
        cluster_sync();  // no rank leaves while another still reads its shared memory
    }
}
