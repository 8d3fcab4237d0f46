// Hand-written sm_90a helpers of the wgmma kernels (varlen_wgmma.cu): the wgmma fences, operand
// pinning, the async-proxy fence, wgmma's 128-byte-swizzle tile layout and its shared-memory
// matrix descriptors.  The wgmma.mma_async wrappers themselves (cp::Wgmma<N>) are generated into
// wgmma.cuh by tools/gen_wgmma.py, which includes this header.
#pragma once
#include "common.cuh"

namespace cp {

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Pins a register's value at this point of the program, so that the compiler neither reads an
// accumulator before the wait that completes it nor reuses an operand register before that wait.
__device__ __forceinline__ void fence_operand(float& x) { asm volatile("" : "+f"(x)::"memory"); }
__device__ __forceinline__ void fence_operand(u32& x) { asm volatile("" : "+r"(x)::"memory"); }
// Orders this thread's earlier generic-proxy writes to shared memory (st.shared, cp.async) before
// later async-proxy reads (wgmma operands); a barrier after it publishes them to the warpgroup.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// A tile of kRows rows of kChunks 16-byte chunks, in wgmma's 128-byte-swizzle layout: the tile is
// kChunks / 8 column blocks of kRows x 128 bytes (64 two-byte elements a row); in each block, chunk
// c of row r sits at r * 128 + 16 * (c ^ (r % 8)).  Every 8 rows (1024 bytes) are one swizzle atom,
// so the tile must start on a multiple of 1024 bytes.
template <int kChunks, int kRows>
struct Sw128Tile {
  static_assert(kChunks % 8 == 0 && kRows % 8 == 0, "whole 64-element column blocks and swizzle atoms");
  static constexpr int kBytes = kRows * kChunks * 16;
  static constexpr int kColumnBytes = kRows * 128;  // one 64-element column block
  __device__ static __forceinline__ u32 offset(int row, int chunk) {
    return static_cast<u32>((chunk >> 3) * kColumnBytes + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
  }
};

// Matrix descriptor of a 128-byte-swizzled operand starting at shared address `address`.
// K-major (A, or B with trans-b = 0): `stride` = bytes between 8-row groups (1024 in Sw128Tile);
// `leading` is unused.  N-major (B with trans-b = 1, rows = k): `leading` = bytes between 64-element
// column blocks of N (Sw128Tile::kColumnBytes), `stride` = bytes between 8-row groups of k (1024).
// Adding b bytes (a multiple of 16) to the address field is adding b >> 4 to the descriptor.
__device__ __forceinline__ u64 smem_descriptor(u32 address, u32 leading, u32 stride) {
  return static_cast<u64>((address & 0x3FFFFu) >> 4) | (static_cast<u64>((leading >> 4) & 0x3FFFu) << 16) |
         (static_cast<u64>((stride >> 4) & 0x3FFFu) << 32) | (1ull << 62);  // 1 << 62: 128-byte swizzle
}

// ---- the warp-specialized kernel's synchronisation (varlen_wgmma.cu, PRODUCER = 1)

// An mbarrier (8 bytes of shared memory at `bar`) expecting `count` arrivals per phase; one thread
// initialises it before a barrier that publishes it.
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// One arrival (release: this thread's earlier shared-memory writes are seen by whoever waits).
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
// One arrival when every cp.async this thread issued so far has landed; counted in the barrier's
// expected arrivals (noinc).
__device__ __forceinline__ void cp_async_mbar_arrive(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Wait (acquire) until the phase of parity `parity` has completed.  A fresh barrier is in phase 0,
// and the phase before it (parity 1) counts as completed, so a producer's first wait on a free
// slot returns at once.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(bar), "r"(parity)
      : "memory");
}
// One arrival that also expects `bytes` more of asynchronous copies (TMA) in this phase: the
// phase completes once every expected arrival has come and those bytes have landed.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// ---- the tensor-memory accelerator (TMA)

// A CUtensorMap (cuda.h): 128 opaque bytes, encoded on the host (cupy_paged/_core/tma.py) and
// passed by value as a __grid_constant__ kernel parameter, whose address the copies take.
struct alignas(64) TensorMap {
  u64 opaque[16];
};
// The K and V maps of a launch (varlen_ws.cuh with TMA = 1): the first kernel parameter.
struct TmaMaps {
  TensorMap k, v;
};

// The box at coordinates (c0, c1, c2) of the 3-d tensor map at generic address `map` -> shared
// memory at `dst`, completing `bytes` of the transaction count of the mbarrier at `bar`.  Elements
// outside the tensor are filled with zeros (and counted).
__device__ __forceinline__ void tma_load_3d(u32 dst, u64 map, int c0, int c1, int c2, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// Named barriers 1..15 among `threads` threads (a multiple of 32): sync waits, arrive does not.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The registers of every thread of this warpgroup from here on (setmaxnreg: the producer gives
// some back, the consumers take them).
template <int kRegisters>
__device__ __forceinline__ void registers_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void registers_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

}  // namespace cp
