// Pieces of the varlen forward pass shared by its two kernels (varlen.cu: mma.sync, sm_80+;
// varlen_wgmma.cu: wgmma, sm_90a).  The including file defines, in namespace varlen, the element
// type T and the traits Tr (kHeadDim, kBlockM, kBlockN, kThreads (the threads that load, numbered
// from 0), kCtaThreads (all of the CTA's), kChunks, kMTiles, kNTiles,
// kDTiles; the K/V pipeline's kStages, kAhead (tiles in flight ahead of the one computed) and
// kKVBytes (bytes of one K or V tile); and QTile / KVTile, the shared-memory layouts of the Q and
// K/V tiles, each with a static offset(row, chunk)); these functions are written against those
// names only.  Paged K/V is addressed through paged.cuh.
#pragma once
#include "paged.cuh"

namespace varlen {

using cp::inf;
using cp::kLn2;
using cp::kLog2e;

// Where the keys of one (sequence, kv head) live: rows of a contiguous k/v, or slots
// (block * block_size + offset) of a paged cache whose blocks are block_size rows apart.
struct KvSource {
  const T* k;  // already offset to the kv head
  const T* v;
  const int* table;         // block_table row of the sequence, or nullptr (contiguous)
  int k_row, v_row;         // element stride between consecutive rows (slots)
  int first_row;            // contiguous: row of key 0
  int num_rows;             // contiguous: rows in k/v; paged: num_blocks
  int length;               // keys of the sequence
  int loadable;             // contiguous: keys [0, loadable) lie inside k/v (all, unless
                            // cu_seqlens_k disagrees with k's size)
  int table_width, block_shift;
  // Contiguous, when every thread copies the same chunk of rows kRowsPerPass apart in each pass
  // (TilePasses::kLaneFixed): element offset of this thread's first row and chunk, and the
  // element step from one pass to the next.
  long long k_lane, v_lane, k_pass, v_pass;
};

// Per-warp softmax state and output accumulator (registers).
struct WarpState {
  float o[Tr::kMTiles][Tr::kDTiles][4];
  float row_max[Tr::kMTiles][2];  // raw (pre-scale) units, -inf until a key is seen
  float row_sum[Tr::kMTiles][2];  // this thread's partial sum; the quad is reduced at the end
};

// ---------------------------------------------------------------------------- loads

// A tile of kRows rows is loaded in passes of kThreads 16-byte chunks; the registered shapes
// (TILES in kernels/varlen.py, WGMMA_TILES in kernels/varlen_wgmma.py) divide evenly, so every
// pass is full and the loops unroll without bounds checks.
template <int kRows>
struct TilePasses {
  static constexpr int kTotal = kRows * Tr::kChunks;
  static constexpr int kCount = kTotal / Tr::kThreads;
  static_assert(kTotal % Tr::kThreads == 0, "tile chunks must divide evenly among the threads");
  __device__ static __forceinline__ int row(int pass) { return (threadIdx.x + pass * Tr::kThreads) / Tr::kChunks; }
  __device__ static __forceinline__ int chunk(int pass) { return (threadIdx.x + pass * Tr::kThreads) % Tr::kChunks; }
  // Every pass, the thread copies chunk threadIdx.x % kChunks of a row kRowsPerPass below the
  // last one (all head dims but 96, whose 12 chunks do not divide the threads).
  static constexpr bool kLaneFixed = Tr::kThreads % Tr::kChunks == 0;
  static constexpr int kRowsPerPass = Tr::kThreads / Tr::kChunks;
};

// The copy loops of Q and K/V, unrolled in full except in a lean producer (varlen_ws.cuh,
// WS_LEAN_PRODUCER: its registers go to the consumers), where they stay loops: unrolled, their
// addresses would not fit its 72 registers.
#ifndef WS_LEAN_PRODUCER
#define WS_LEAN_PRODUCER 0
#endif
#if WS_LEAN_PRODUCER
#define LOAD_PASSES_UNROLL _Pragma("unroll 1")
#else
#define LOAD_PASSES_UNROLL _Pragma("unroll")
#endif

// Q tile -> shared memory (rows past the sequence or outside q are zero-filled).
__device__ __forceinline__ void load_q_tile(u32 s_q, const T* q, long long q_row, long long first_row,
                                            int rows, int total_q) {
  using P = TilePasses<Tr::kBlockM>;
LOAD_PASSES_UNROLL
  for (int pass = 0; pass < P::kCount; ++pass) {
    const int r = P::row(pass), c = P::chunk(pass);
    const long long row = first_row + r;
    const bool ok = r < rows && row >= 0 && row < total_q;
    cp::cp_async_16(s_q + Tr::QTile::offset(r, c), q + (ok ? row * q_row + c * 8 : 0), ok);
  }
}

// Paged K/V, a full tile: inside the sequence and inside the block table (every tile but a
// sequence's last, and those of a table too short for the sequence).  Every key of such a tile
// has a column, so its block ids can be read without a bounds check, and its ids can be staged.
__device__ __forceinline__ bool paged_full_tile(const KvSource& src, int n0) {
  return TilePasses<Tr::kBlockN>::kLaneFixed && n0 + Tr::kBlockN <= src.length &&
         paged::Blocks(src.block_shift).column(n0 + Tr::kBlockN - 1) < src.table_width;
}

// The block-id ring (paged K/V): slot s (kBlockN ints) holds, for the full tile whose K/V stage
// is s, the block id of each of its keys (row r of the tile at n0: table[(n0 + r) >> shift]),
// copied there by stage_ids in the cp.async group of the tile kAhead before it (load_stage), so
// that the loop's cp.async wait and barrier, which publish that tile, publish the ids too and
// no cp.async of a tile waits on a dependent block-table load (under the loop's memory load such
// a load waits about as long as the data; decode.cu stages its ids the same way).  It follows the
// loadable bytes in shared memory.
__device__ __forceinline__ int* id_ring(unsigned char* s_loadable) {
  return reinterpret_cast<int*>(s_loadable + Tr::kStages * Tr::kBlockN);
}

// The block ids of the tile at n0 -> the id slot at shared address s_slot: one 4-byte cp.async
// per key, by threads 0 .. kBlockN - 1; commits nothing.  Called for full tiles only
// (paged_full_tile; load_kv_tile reads the ids of no other), so every column read lies inside
// the table row.
__device__ __forceinline__ void stage_ids(u32 s_slot, const KvSource& src, int n0) {
  constexpr int kCopies = (Tr::kBlockN + Tr::kThreads - 1) / Tr::kThreads;
#pragma unroll
  for (int i = 0; i < kCopies; ++i) {
    const int r = threadIdx.x + i * Tr::kThreads;
    if (Tr::kBlockN % Tr::kThreads == 0 || r < Tr::kBlockN)
      cp::cp_async_4(s_slot + 4 * r, src.table + paged::Blocks(src.block_shift).column(n0 + r), true);
  }
}

// K and V tile of keys [n0, n0 + BLOCK_N) -> one pipeline stage.  Also records which keys are
// loadable, and returns whether this thread met a hole (an in-range key it could not load).
// This runs for every tile, so the per-row work is kept to a few integer instructions: the
// paged/contiguous choice is made once per tile, contiguous rows are consecutive, and a
// paged row of a full tile costs one shared-memory load of its block id from `ids` (the tile's
// id slot, staged by stage_ids and published by a barrier before this call) when kStaged, else
// one block-table load (the prologue's tiles, and every partial tile).  Paged, with
// `stage_next`, it then stages the block ids of the tile kAhead below, n0 - kAhead * kBlockN,
// into the id slot at shared address s_next_ids (load_stage).  (Both are derived here, inside the
// paged branch, which keeps them out of the contiguous path's code.)  kParts says which tiles are
// copied: kLoadK, kLoadV or both (the warp-specialized kernel loads K and V behind separate
// barriers); the loadable bytes are written with K.
constexpr int kLoadK = 1, kLoadV = 2, kLoadKV = 3;
template <bool kStaged, int kParts = kLoadKV>
__device__ __forceinline__ int load_kv_tile(u32 s_k, u32 s_v, unsigned char* s_loadable, const int* ids,
                                            bool stage_next, u32 s_next_ids, const KvSource& src, int n0) {
  using P = TilePasses<Tr::kBlockN>;
  int hole = 0;
  if (src.table != nullptr) {
    const paged::Blocks layout(src.block_shift);
    // A slot (< 2^31, checked by the host) times the slot stride in bytes (positive, checked by
    // the host) is one 32 x 32 -> 64-bit multiply-add per row, where signed 64-bit index arithmetic
    // would cost ~7 instructions per copy, the largest part of the paged loader.
    const unsigned k_slot_bytes = static_cast<unsigned>(src.k_row) * sizeof(T);
    const unsigned v_slot_bytes = static_cast<unsigned>(src.v_row) * sizeof(T);
    if (paged_full_tile(src, n0)) {
      // Every row is listed, so the id loads are unconditional and all issued first (the
      // copies' asm statements would otherwise keep each behind the previous row's copies);
      // only a block id outside [0, num_blocks) can still make a hole.
      const int c = threadIdx.x % Tr::kChunks;  // P::chunk(pass) for every pass
      const char* k_chunk = reinterpret_cast<const char*>(src.k + c * 8);
      const char* v_chunk = reinterpret_cast<const char*>(src.v + c * 8);
      const int* row_ids = ids + threadIdx.x / Tr::kChunks;  // P::row(pass) = this + pass * kRowsPerPass
      int blocks[P::kCount];
#pragma unroll
      for (int pass = 0; pass < P::kCount; ++pass)
        blocks[pass] = kStaged ? row_ids[pass * P::kRowsPerPass]
                               : __ldg(src.table + layout.column(n0 + P::row(pass)));
#pragma unroll
      for (int pass = 0; pass < P::kCount; ++pass) {
        const int r = P::row(pass), j = n0 + r;
        const bool ok = paged::is_block(blocks[pass], src.num_rows);
        const unsigned slot = ok ? layout.slot(blocks[pass], j) : 0u;
        if (kParts & kLoadK)
          cp::cp_async_16(s_k + Tr::KVTile::offset(r, c), k_chunk + static_cast<cp::u64>(slot) * k_slot_bytes, ok);
        if (kParts & kLoadV)
          cp::cp_async_16(s_v + Tr::KVTile::offset(r, c), v_chunk + static_cast<cp::u64>(slot) * v_slot_bytes, ok);
        if ((kParts & kLoadK) && c == 0) s_loadable[r] = ok;
        hole |= !ok;
      }
      // The tile kAhead below a full tile is full too (tiles are visited downwards): no check.
      if (stage_next) stage_ids(s_next_ids, src, n0 - Tr::kAhead * Tr::kBlockN);
      return hole;
    }
LOAD_PASSES_UNROLL
    for (int pass = 0; pass < P::kCount; ++pass) {
      const int r = P::row(pass), c = P::chunk(pass), j = n0 + r;
      const int column = layout.column(j);
      const bool listed = j < src.length && column < src.table_width;
      const int block = listed ? __ldg(src.table + column) : -1;
      const bool ok = paged::is_block(block, src.num_rows) && listed;
      const unsigned slot = ok ? layout.slot(block, j) : 0u;
      if (kParts & kLoadK)
        cp::cp_async_16(s_k + Tr::KVTile::offset(r, c),
                        reinterpret_cast<const char*>(src.k + c * 8) + static_cast<cp::u64>(slot) * k_slot_bytes, ok);
      if (kParts & kLoadV)
        cp::cp_async_16(s_v + Tr::KVTile::offset(r, c),
                        reinterpret_cast<const char*>(src.v + c * 8) + static_cast<cp::u64>(slot) * v_slot_bytes, ok);
      if ((kParts & kLoadK) && c == 0) s_loadable[r] = ok;
      hole |= !ok && j < src.length;
    }
    const int next_n0 = n0 - Tr::kAhead * Tr::kBlockN;
    if (stage_next && paged_full_tile(src, next_n0)) stage_ids(s_next_ids, src, next_n0);
  } else if (P::kLaneFixed && n0 + Tr::kBlockN <= src.loadable) {
    // A full tile (every key but those of a sequence's last, partial tile): no predicate, no
    // select, one 64-bit pointer step per pass.  s_loadable is left stale: it is read only when
    // some thread met a hole in this tile, and a full tile has none.
    const T* kp = src.k + ((long long)(src.first_row + n0) * src.k_row + src.k_lane);
    const T* vp = src.v + ((long long)(src.first_row + n0) * src.v_row + src.v_lane);
LOAD_PASSES_UNROLL
    for (int pass = 0; pass < P::kCount; ++pass) {
      const int r = P::row(pass), c = P::chunk(pass);
      if (kParts & kLoadK) cp::cp_async_16(s_k + Tr::KVTile::offset(r, c), kp, true);
      if (kParts & kLoadV) cp::cp_async_16(s_v + Tr::KVTile::offset(r, c), vp, true);
      kp += src.k_pass;
      vp += src.v_pass;
    }
  } else {
    const long long k_tile = (long long)(src.first_row + n0) * src.k_row;
    const long long v_tile = (long long)(src.first_row + n0) * src.v_row;
LOAD_PASSES_UNROLL
    for (int pass = 0; pass < P::kCount; ++pass) {
      const int r = P::row(pass), c = P::chunk(pass);
      const bool ok = n0 + r < src.loadable;
      if (kParts & kLoadK)
        cp::cp_async_16(s_k + Tr::KVTile::offset(r, c), src.k + (ok ? k_tile + r * src.k_row + c * 8 : 0ll), ok);
      if (kParts & kLoadV)
        cp::cp_async_16(s_v + Tr::KVTile::offset(r, c), src.v + (ok ? v_tile + r * src.v_row + c * 8 : 0ll), ok);
      if ((kParts & kLoadK) && c == 0) s_loadable[r] = ok;
      hole |= !ok && n0 + r < src.length;
    }
  }
  return hole;
}

// ---------------------------------------------------------------------------- softmax and output

// Score modifications on the scaled score (natural units): softcap c * tanh(s / c), then ALiBi
// -slope * |i + Lk - Lq - j|.  Only called when one of them is on; the caller then uses
// log2(e) as the exp2 scale, since the scores already carry softmax_scale.
__device__ __forceinline__ void apply_score_mods(float (&s)[Tr::kMTiles][Tr::kNTiles][4], float scale,
                                                 float softcap, float slope, int row0, int offset,
                                                 int n0, int lane) {
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < Tr::kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = row0 + mt * 16 + (lane >> 2) + (e >> 1) * 8;
        const int j = n0 + nt * 8 + 2 * (lane & 3) + (e & 1);
        float x = s[mt][nt][e] * scale;
        if (softcap > 0.f) x = softcap * tanhf(x / softcap);
        x -= slope * fabsf(static_cast<float>(i + offset - j));
        s[mt][nt][e] = x;
      }
}

// Mask: key j is kept for query row i iff i + off - left <= j <= i + off + right (a bound is off
// when negative), j < Lk and the key was loadable.  Only called on tiles that straddle a bound.
// The bounds are a select per score, no branch: a row's bounds become tile columns once, and the
// loadable bytes (a shared-memory read) are looked at only in a tile with a hole, in a loop of
// their own, so the usual diagonal tile pays a compare and a select a score.
__device__ __forceinline__ void apply_mask(float (&s)[Tr::kMTiles][Tr::kNTiles][4], int row0, int offset,
                                           int n0, int length_k, int left, int right, bool hole,
                                           const unsigned char* s_loadable, int lane) {
  const int c0 = 2 * (lane & 3);  // this thread's first column in each n8 tile
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = row0 + mt * 16 + (lane >> 2) + half * 8;
      const int lo = left >= 0 ? i + offset - left : -1;
      const int hi = right >= 0 ? min(i + offset + right, length_k - 1) : length_k - 1;
#pragma unroll
      for (int nt = 0; nt < Tr::kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = n0 + c0 + nt * 8 + e;
          float& x = s[mt][nt][2 * half + e];
          x = (j < lo || j > hi) ? -inf() : x;
        }
    }
  if (!hole) return;
#pragma unroll
  for (int nt = 0; nt < Tr::kNTiles; ++nt) {
    // The thread's two columns of the n8 tile: one 2-byte read of their loadable bytes.
    const unsigned pair = *reinterpret_cast<const unsigned short*>(s_loadable + c0 + nt * 8);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const bool gone = ((pair >> (8 * e)) & 0xffu) == 0u;
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float& x = s[mt][nt][2 * half + e];
          x = gone ? -inf() : x;
        }
    }
  }
}

// Online softmax: new row max, rescale O and the running sum by exp2((m_old - m_new) * scale),
// S -> P = exp2(S * scale - m_new * scale).  A row that has seen no key keeps max -inf; its
// base is taken as 0 so that exp2(-inf - 0) = 0 and nothing becomes NaN.
// Split in two (softmax_scores returns each row's factor alpha, rescale_o applies it): the wgmma
// kernel calls the halves itself, which keeps its register allocation as it was timed (through
// online_softmax, the same arithmetic compiles to other machine code).
using RowFactors = float[Tr::kMTiles][2];

__device__ __forceinline__ void softmax_scores(float (&s)[Tr::kMTiles][Tr::kNTiles][4], WarpState& st,
                                               float scale_log2, RowFactors& alphas) {
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // Pairwise tree over the row's values (depth log2 instead of a chain of kNTiles).
      float m[Tr::kNTiles];
#pragma unroll
      for (int nt = 0; nt < Tr::kNTiles; ++nt) m[nt] = fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]);
#pragma unroll
      for (int width = 1; width < Tr::kNTiles; width *= 2)
#pragma unroll
        for (int nt = 0; nt + width < Tr::kNTiles; nt += 2 * width) m[nt] = fmaxf(m[nt], m[nt + width]);
      const float tile_max = cp::quad_max(m[0]);  // the four threads of a quad hold the same two rows
      const float old_max = st.row_max[mt][half];
      const float new_max = fmaxf(old_max, tile_max);
      const float base = new_max == -inf() ? 0.f : new_max * scale_log2;
      const float alpha = exp2f(old_max * scale_log2 - base);
      st.row_max[mt][half] = new_max;
      float sums[Tr::kNTiles];
#pragma unroll
      for (int nt = 0; nt < Tr::kNTiles; ++nt) {
        const float p0 = exp2f(fmaf(s[mt][nt][2 * half], scale_log2, -base));
        const float p1 = exp2f(fmaf(s[mt][nt][2 * half + 1], scale_log2, -base));
        s[mt][nt][2 * half] = p0;
        s[mt][nt][2 * half + 1] = p1;
        sums[nt] = p0 + p1;
      }
#pragma unroll
      for (int width = 1; width < Tr::kNTiles; width *= 2)
#pragma unroll
        for (int nt = 0; nt + width < Tr::kNTiles; nt += 2 * width) sums[nt] += sums[nt + width];
      st.row_sum[mt][half] = fmaf(st.row_sum[mt][half], alpha, sums[0]);
      alphas[mt][half] = alpha;
    }
}

__device__ __forceinline__ void rescale_o(WarpState& st, const RowFactors& alphas) {
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
    for (int dt = 0; dt < Tr::kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) st.o[mt][dt][e] *= alphas[mt][e >> 1];
}

__device__ __forceinline__ void online_softmax(float (&s)[Tr::kMTiles][Tr::kNTiles][4], WarpState& st,
                                               float scale_log2) {
  RowFactors alphas;
  softmax_scores(s, st, scale_log2, alphas);
  rescale_o(st, alphas);
}

// P as the A operand of P V: the S accumulators of two n8 tiles are exactly an m16k16 A
// fragment once packed.  [m16 tile][k16 step of the keys][4]
using PFrags = u32[Tr::kMTiles][Tr::kBlockN / 16][4];

__device__ __forceinline__ void pack_p(const float (&p)[Tr::kMTiles][Tr::kNTiles][4], PFrags& a) {
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) cp::pack_a(a[mt][kk], p[mt][2 * kk], p[mt][2 * kk + 1], T());
}

// O / rowsum of this thread's rows of the sequence, a pair of elements at a time, to
// put(i, row, dt, pair) (i: the row in the sequence, row: in q; dt: the n8 column group), and the
// natural-log LSE -> lse.  A row that saw no key gives zeros and -inf; rows past the sequence or
// outside q give nothing.
template <class Put>
__device__ __forceinline__ void finish_rows(WarpState& st, float* lse, long long lse_base, int q_start, int row0,
                                            int length_q, int total_q, float scale_log2, int lane, Put put) {
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float sum = cp::quad_sum(st.row_sum[mt][half]);
      const int i = row0 + mt * 16 + (lane >> 2) + half * 8;
      const long long row = (long long)q_start + i;
      if (i >= length_q || row < 0 || row >= total_q) continue;
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
      for (int dt = 0; dt < Tr::kDTiles; ++dt)
        put(i, row, dt, cp::from_float2(st.o[mt][dt][2 * half] * inv, st.o[mt][dt][2 * half + 1] * inv, T()));
      if (lse != nullptr && (lane & 3) == 0)
        lse[lse_base + row] = sum > 0.f ? (st.row_max[mt][half] * scale_log2 + log2f(sum)) * kLn2 : -inf();
    }
}

// O / rowsum -> out, natural-log LSE -> lse.  A row that saw no key writes zeros and -inf.
__device__ __forceinline__ void store_output(WarpState& st, T* out, long long out_row, float* lse,
                                             long long lse_base, int q_start, int row0, int length_q,
                                             int total_q, float scale_log2, int lane) {
  finish_rows(st, lse, lse_base, q_start, row0, length_q, total_q, scale_log2, lane,
              [&](int, long long row, int dt, u32 pair) {
                (reinterpret_cast<u32*>(out + row * out_row) + (lane & 3))[dt * 4] = pair;
              });
}

// Rows [first, last) of a tile that sees no key at all: zeros and LSE -inf.
// `thread` of `threads` (default: the CTA's).
__device__ __forceinline__ void store_empty_rows(T* out, long long out_row, float* lse, long long lse_base,
                                                 int q_start, int first, int last, int total_q,
                                                 int thread = threadIdx.x, int threads = Tr::kCtaThreads) {
  for (int index = thread; index < (last - first) * Tr::kChunks; index += threads) {
    const long long row = (long long)q_start + first + index / Tr::kChunks;
    if (row < 0 || row >= total_q) continue;
    reinterpret_cast<uint4*>(out + row * out_row)[index % Tr::kChunks] = make_uint4(0, 0, 0, 0);
    if (lse != nullptr && index % Tr::kChunks == 0) lse[lse_base + row] = -inf();
  }
}

// ---------------------------------------------------------------------------- the CTA's task

// The kernel parameters (both kernels take the same; kernels/varlen.py passes them in this order).
// The wgmma kernel's TRACE specialization takes one more, its trace buffer (varlen_ws.cuh).
#ifndef TRACE
#define TRACE 0
#endif
#if TRACE
#define VARLEN_TRACE_PARAM , unsigned long long* __restrict__ trace
#define VARLEN_TRACE_ARG , trace
#else
#define VARLEN_TRACE_PARAM
#define VARLEN_TRACE_ARG
#endif
#define VARLEN_FWD_PARAMS                                                                          \
  const varlen::T *__restrict__ q, const varlen::T *__restrict__ k, const varlen::T *__restrict__ v, \
      varlen::T *__restrict__ out,  /* [total_q, H, D] */                                            \
      float *__restrict__ lse,      /* [H, total_q] or null */                                       \
      const int *__restrict__ cu_seqlens_q, const int *__restrict__ cu_seqlens_k,                    \
      const int *__restrict__ block_table,  /* [B, table_width] or null */                           \
      const float *__restrict__ alibi_slopes, /* [H] or [B, H] (see alibi_batch_stride), or null */  \
      long long q_row, long long q_head,      /* strides in elements */                              \
      int k_row, long long k_head, int v_row, long long v_head, /* paged: per slot */                \
      int total_q, int kv_rows,               /* total_k, or num_blocks when paged */                \
      int num_heads, int group_size, int table_width, int block_shift, float softmax_scale,          \
      float softcap, int window_left, int window_right,                                              \
      int max_seqlen_q,                       /* rows the grid covers (only checked against) */      \
      int alibi_batch_stride,                 /* 0 for [H] slopes, H for [B, H] */                   \
      int *errors,                            /* the device error word (common.cuh), or null */ \
      int batch                               /* sequences (cu_seqlens hold batch + 1) */  \
      VARLEN_TRACE_PARAM
#define VARLEN_FWD_ARGS                                                                            \
  q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, q_row, q_head, k_row,   \
      k_head, v_row, v_head, total_q, kv_rows, num_heads, group_size, table_width, block_shift,     \
      softmax_scale, softcap, window_left, window_right, max_seqlen_q, alibi_batch_stride, errors, batch     \
      VARLEN_TRACE_ARG

// The index values of this CTA's sequence that the host cannot check without a copy, checked
// and reported to the error word (cp::report_error) once per sequence, by warp 0 of the CTA of
// head 0 and query tile 0; the kernel treats whatever they find as holes anyway (rows it never
// reads or writes, keys loaded as zeros and masked), so nothing waits for them.
//   cu_seqlens_q: starts at 0, never decreases, stays within q's total_q rows, no length above
//     max_seqlen_q (the grid's rows: a longer sequence's tail is not computed) -> kErrCuSeqlensQ;
//   cu_seqlens_k: never decreases, and a contiguous k/v holds its rows -> kErrCuSeqlensK;
//   block table: every key has a column (kErrTableShort, detail = keys) and every column that
//     holds a key has a block id in [0, num_blocks) (kErrBlockId, detail = the first bad column).
// Not inlined, called at the kernel's one exit, and reloading what it needs: so it keeps nothing
// alive across the K/V loop and leaves the loop's register allocation and schedule alone (inlined,
// or called before the loop or from two exits, it would not).
// A persistent CTA's `kSeqArg` version takes the sequence as `seq`; the others' read blockIdx.z.
template <bool kSeqArg = false>
__device__ __noinline__ void check_sequence(const int* cu_seqlens_q, const int* cu_seqlens_k, const int* block_table,
                                            int table_width, int block_shift, int total_q, int kv_rows,
                                            int max_seqlen_q, int* errors, int seq_arg = 0) {
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x, seq = kSeqArg ? seq_arg : static_cast<int>(blockIdx.z);
  const int q_start = cu_seqlens_q[seq], q_end = cu_seqlens_q[seq + 1];
  const int k_start = cu_seqlens_k[seq], k_end = cu_seqlens_k[seq + 1];
  const long long length_q = (long long)q_end - q_start, length_k = (long long)k_end - k_start;
  if (lane == 0) {
    if ((seq == 0 && q_start != 0) || length_q < 0 || q_end > total_q || length_q > max_seqlen_q)
      cp::report_error(errors, cp::kErrCuSeqlensQ, seq, length_q);
    if (length_k < 0 || (block_table == nullptr && (k_start < 0 || k_end > kv_rows)))
      cp::report_error(errors, cp::kErrCuSeqlensK, seq, length_k);
  }
  if (block_table == nullptr || length_k <= 0) return;
  const int* table = block_table + (long long)seq * table_width;
  const long long columns = paged::Blocks(block_shift).columns(length_k);  // holding keys [0, length_k)
  if (columns > table_width && lane == 0) cp::report_error(errors, cp::kErrTableShort, seq, length_k);
  const int listed = static_cast<int>(min(columns, static_cast<long long>(table_width)));
  // 32 columns at a time, one per lane; the warp stops at the first group with a bad id.
  for (int base = 0; base < listed; base += 32) {
    const int column = base + lane;
    const bool bad = column < listed && !paged::is_block(__ldg(table + column), kv_rows);
    const unsigned found = __ballot_sync(0xffffffffu, bad);
    if (found != 0u) {
      if (lane == 0) cp::report_error(errors, cp::kErrBlockId, seq, base + __ffs(found) - 1);
      break;
    }
  }
}

// Called by every thread at the kernel's end: the CTA of head 0 and query tile 0 (m_block 0 in
// make_task, the last blockIdx.x) checks its sequence.
__device__ __forceinline__ void check_inputs(VARLEN_FWD_PARAMS) {
  if (blockIdx.y == 0 && blockIdx.x == gridDim.x - 1 && errors != nullptr)
    check_sequence(cu_seqlens_q, cu_seqlens_k, block_table, table_width, block_shift, total_q, kv_rows,
                   max_seqlen_q, errors);
}

// What one CTA computes: query rows [m0, m_end) of one head of one sequence against the key tiles
// tile_first, tile_first - 1, ... (num_tiles of them) that hold every key one of its rows may see.
struct Task {
  int q_start, length_q, length_k, m0, m_end;
  int offset;  // length_k - length_q: the bottom-right alignment of causal / window bounds
  int tile_first, num_tiles;
  const T* q_head;  // q at this head
  T* out_head;      // out at this head
  long long out_row, lse_base;
  KvSource src;
  bool mods;  // softcap or ALiBi: the scores then carry softmax_scale before the exp2
  float slope, scale_log2;
};

// Which task: query tile m_block of (head, seq).  A CTA of a grid (query tiles, heads, sequences)
// takes its own, the longest-running query tiles (the last ones, under causal masking) first.
struct GridTask {
  __device__ __forceinline__ int m_block() const { return gridDim.x - 1 - blockIdx.x; }
  __device__ __forceinline__ int head() const { return blockIdx.y; }
  __device__ __forceinline__ int seq() const { return blockIdx.z; }
  // The thread whose lane offsets the task holds (kOwnThread: threadIdx.x, read where they are
  // computed), and which of how many threads write empty rows.
  static constexpr bool kOwnThread = true;
  __device__ __forceinline__ int lane_thread() const { return threadIdx.x; }
  __device__ __forceinline__ int thread() const { return threadIdx.x; }
  __device__ __forceinline__ int threads() const { return Tr::kCtaThreads; }
};

// Fills `t` for the task `where` names.  Returns false when there is nothing to compute: the query
// tile starts past the sequence's end, or none of its rows sees a key (their zeros and LSE -inf
// are then written, by where.thread() of where.threads(); none when that is 0).
template <class Where>
__device__ __forceinline__ bool task_at(Task& t, const Where& where, VARLEN_FWD_PARAMS) {
  const int m_block = where.m_block();
  const int head = where.head(), seq = where.seq();
  // Lengths wrap instead of overflowing: one that does not fit an int (only a bad cu_seqlens has
  // one) reads as negative, and a negative length is an empty sequence.
  const int q_start = cu_seqlens_q[seq], k_start = cu_seqlens_k[seq];
  t.q_start = q_start;
  t.length_q = static_cast<int>(static_cast<unsigned>(cu_seqlens_q[seq + 1]) - static_cast<unsigned>(q_start));
  t.length_k = static_cast<int>(static_cast<unsigned>(cu_seqlens_k[seq + 1]) - static_cast<unsigned>(k_start));
  t.m0 = m_block * Tr::kBlockM;
  if (t.m0 >= t.length_q) return false;
  t.m_end = min(t.m0 + Tr::kBlockM, t.length_q);
  t.offset = t.length_k - t.length_q;
  t.q_head = q + (long long)head * q_head;
  t.out_row = (long long)num_heads * Tr::kHeadDim;
  t.out_head = out + (long long)head * Tr::kHeadDim;
  t.lse_base = (long long)head * total_q;

  // Key range [n_lo, n_hi) that any row of this tile may see; tiles outside it are skipped.
  int n_hi = t.length_k, n_lo = 0;
  if (window_right >= 0) n_hi = min(n_hi, t.m_end - 1 + t.offset + window_right + 1);
  if (window_left >= 0) n_lo = max(n_lo, t.m0 + t.offset - window_left);
  if (n_hi <= n_lo) {
    if (where.threads() > 0)
      store_empty_rows(t.out_head, t.out_row, lse, t.lse_base, t.q_start, t.m0, t.m_end, total_q, where.thread(),
                       where.threads());
    return false;
  }
  t.tile_first = (n_hi + Tr::kBlockN - 1) / Tr::kBlockN - 1;  // visited high to low
  t.num_tiles = t.tile_first - n_lo / Tr::kBlockN + 1;

  const int kv_head = head / group_size;
  KvSource& src = t.src;
  src.k = k + kv_head * k_head;
  src.v = v + kv_head * v_head;
  src.table = block_table == nullptr ? nullptr : block_table + (long long)seq * table_width;
  src.k_row = k_row; src.v_row = v_row;
  src.first_row = k_start; src.num_rows = kv_rows; src.length = t.length_k;
  src.loadable = k_start < 0 ? 0 : max(0, min(t.length_k, kv_rows - k_start));
  src.table_width = table_width; src.block_shift = block_shift;
  using P = TilePasses<Tr::kBlockN>;
  // This thread's row and chunk in a tile's passes (used when P::kLaneFixed).
  const int r = Where::kOwnThread ? threadIdx.x / Tr::kChunks : where.lane_thread() / Tr::kChunks;
  const int c = Where::kOwnThread ? threadIdx.x % Tr::kChunks : where.lane_thread() % Tr::kChunks;
  src.k_lane = (long long)r * k_row + c * 8;
  src.v_lane = (long long)r * v_row + c * 8;
  src.k_pass = (long long)P::kRowsPerPass * k_row;
  src.v_pass = (long long)P::kRowsPerPass * v_row;

  t.mods = softcap > 0.f || alibi_slopes != nullptr;
  t.slope = alibi_slopes != nullptr ? alibi_slopes[(long long)seq * alibi_batch_stride + head] : 0.f;
  // With mods the scores already carry softmax_scale; otherwise it is folded into exp2.
  t.scale_log2 = t.mods ? kLog2e : softmax_scale * kLog2e;
  return true;
}

// The task of this CTA (grid = (query tiles, heads, sequences)).
__device__ __forceinline__ bool make_task(Task& t, VARLEN_FWD_PARAMS) {
  return task_at(t, GridTask(), VARLEN_FWD_ARGS);
}

__device__ __forceinline__ void init_state(WarpState& st) {
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) { st.row_max[mt][half] = -inf(); st.row_sum[mt][half] = 0.f; }
#pragma unroll
    for (int dt = 0; dt < Tr::kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) st.o[mt][dt][e] = 0.f;
  }
}

// Key tile `it` of the task (counted from tile_first down) -> stage it % kStages of the K/V ring
// (K then V per stage, kKVBytes each, from s_kv); returns this thread's hole bit, shifted to the
// stage.  Paged, the block ids of tile it + kAhead go to its id slot ((it + kAhead) % kStages,
// the slot of the stage that tile will fill) in the same group.  Commits nothing.
//
// The id ring's order (G_i: the cp.async group of tile i's K/V; the prologue commits Q, then
// G_0 .. G_{kAhead-1}; iteration i of the loop waits until G_i has landed, passes a barrier B_i,
// then issues tile i + kAhead's K/V and commits G_{i+kAhead}):
//   - the ids of tile t ride in G_{t-kAhead} (for t >= kAhead; tiles 0 .. kAhead - 1, loaded by
//     the prologue before any id could land, read the table directly: kStaged = false);
//   - they are read by load_stage(t) (kStaged = true), in iteration t - kAhead after B_{t-kAhead},
//     whose wait completed G_{t-kAhead}: landed, and published to every thread by that barrier;
//   - their slot t % kStages is next written by the ids of tile t + kStages, issued by
//     load_stage(t + kStages - kAhead) = load_stage(t + 1), in iteration t + 1 - kAhead after
//     B_{t+1-kAhead}, which every thread reaches only after its reads of iteration t - kAhead;
//   - within one load_stage, the slot written ((t + kAhead) % kStages) is not the one read
//     (t % kStages): kAhead = kStages - 1 is not a multiple of kStages.
// So kStages slots suffice, and a slot is never overwritten while a thread may still read it.
template <bool kStaged>
__device__ __forceinline__ int load_stage(u32 s_kv, unsigned char* s_loadable, const Task& t, int it) {
  const int stage = it % Tr::kStages;
  const int next_stage = stage == 0 ? Tr::kStages - 1 : stage - 1;  // (it + kAhead) % kStages
  int* ids = id_ring(s_loadable);
  return load_kv_tile<kStaged>(s_kv + 2 * stage * Tr::kKVBytes, s_kv + (2 * stage + 1) * Tr::kKVBytes,
                               s_loadable + stage * Tr::kBlockN, ids + stage * Tr::kBlockN,
                               it + Tr::kAhead < t.num_tiles, cp::smem_address(ids + next_stage * Tr::kBlockN),
                               t.src, (t.tile_first - it) * Tr::kBlockN)
         << stage;
}

// Prologue: Q, then the first kAhead key tiles, one cp.async group each (with the block ids of
// tiles kAhead .. 2 kAhead - 1, see load_stage).  Returns the hole bits (bit s: this thread met a
// hole in the tile now in stage s).
__device__ __forceinline__ int load_prologue(u32 s_q, u32 s_kv, unsigned char* s_loadable, const Task& t,
                                             long long q_row, int total_q) {
  load_q_tile(s_q, t.q_head, q_row, (long long)t.q_start + t.m0, t.m_end - t.m0, total_q);
  cp::cp_async_commit();
  int hole_bits = 0;
#pragma unroll
  for (int s = 0; s < Tr::kAhead; ++s) {
    if (s < t.num_tiles) hole_bits |= load_stage<false>(s_kv, s_loadable, t, s);
    cp::cp_async_commit();
  }
  return hole_bits;
}

}  // namespace varlen
