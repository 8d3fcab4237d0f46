// Tensor-core and async-copy building blocks (sm_80+ PTX) for the attention kernels.
//
// Fragment layouts of mma.sync.m16n8k16 (g = lane / 4, t = lane % 4), which the callers
// rely on when they turn an accumulator into an A operand:
//   A 16x16 (row-major): a0 = (g, 2t..2t+1)  a1 = (g+8, 2t..)  a2 = (g, 2t+8..)  a3 = (g+8, 2t+8..)
//   B 16x8  (k-major):   b0 = (k 2t..2t+1, n g)  b1 = (k 2t+8.., n g)
//   C 16x8  (fp32):      c0,c1 = (g, 2t..2t+1)   c2,c3 = (g+8, 2t..2t+1)
#pragma once
#include "common.cuh"

namespace cp {

__device__ __forceinline__ u32 smem_address(const void* pointer) {
  return static_cast<u32>(__cvta_generic_to_shared(pointer));
}

// 16-byte global -> shared copy that bypasses L1; with fill == false it reads nothing and
// writes zeros, which is how rows past a sequence's end or in a hole are loaded.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool fill) {
  const int src_bytes = fill ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Wait until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// 4-byte global -> shared copy (through L1: cp.async takes only 16 bytes with .cg); with
// fill == false it reads nothing and writes zeros.
__device__ __forceinline__ void cp_async_4(u32 dst, const void* src, bool fill) {
  const int src_bytes = fill ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}

// Four 8x8 b16 matrices from shared memory; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
// The same, each matrix transposed on the way (for a B operand stored k-major).
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// c += a * b on one 16x8x16 tile, fp32 accumulation.
__device__ __forceinline__ void mma_16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1, __half) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1, __nv_bfloat16) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The C fragments of two n8 tiles, columns 0-7 (lo) and 8-15 (hi) of a 16x16 product, as the
// A fragment of the next mma, converted to X (__half or __nv_bfloat16): by the layouts above,
// c0,c1 / c2,c3 of lo are a0 / a1 and those of hi are a2 / a3 (P of P V, packed from S).
template <typename X>
__device__ __forceinline__ void pack_a(u32 (&a)[4], const float (&lo)[4], const float (&hi)[4], X) {
  a[0] = from_float2(lo[0], lo[1], X());
  a[1] = from_float2(lo[2], lo[3], X());
  a[2] = from_float2(hi[0], hi[1], X());
  a[3] = from_float2(hi[2], hi[3], X());
}

// Shared-memory tile of rows of kChunks 16-byte chunks, laid out so that ldmatrix (8 rows, one
// chunk column) and cp.async (consecutive chunks of a row) hit 8 different bank groups.
// Rows of a multiple of 128 bytes: XOR swizzle of the chunk's low 3 bits with the row's; other
// widths (head dims 32, 96): one chunk of padding per row (an odd stride in chunks).
template <int kChunks>
struct SmemTile {
  static constexpr bool kSwizzle = kChunks % 8 == 0;
  static constexpr int kRowChunks = kSwizzle ? kChunks : kChunks + 1;
  __host__ __device__ static constexpr int bytes(int rows) { return rows * kRowChunks * 16; }
  // Byte offset of chunk `chunk` of row `row`.
  __device__ static __forceinline__ u32 offset(int row, int chunk) {
    return static_cast<u32>(row * kRowChunks + (kSwizzle ? (chunk ^ (row & 7)) : chunk)) * 16u;
  }
};

}  // namespace cp
