// varlen_fwd_wgmma: the varlen forward pass of varlen.cu on Hopper's warpgroup tensor-core
// instructions (wgmma, sm_90a only).  Same semantics, arguments, grid and task per CTA (see
// varlen_common.cuh; a PERSISTENT specialization has a grid of SMs and a list of tasks per CTA);
// only the matrix products and the shared-memory layout differ.
//
// One CTA of WARPGROUPS warpgroups (1 or 2) computes 64 x WARPGROUPS query rows; warpgroup g owns
// rows 64 g .. 64 g + 63, its warp w % 4 the 16 rows 16 (w % 4) .. + 15 of those, exactly the rows a
// warp of varlen.cu owns, in the same accumulator layout, so the softmax, masking and output code
// is shared.  Per key tile of BLOCK_N keys, each warpgroup:
//   S = Q K^T    HEAD_DIM / 16 wgmma m64n{BLOCK_N}k16, Q and K read by the tensor cores straight
//                from shared memory (descriptors), issued asynchronously; while they run, all
//                threads issue the cp.async of the next tile
//   softmax      per warp, on the accumulators (varlen_common.cuh)
//   O += P V     BLOCK_N / 16 wgmma m64n{HEAD_DIM}k16, P from registers (the S accumulators
//                re-packed as A fragments), V from shared memory read N-major (trans-b)
// K, V and Q tiles are stored in wgmma's 128-byte-swizzle layout (cp::Sw128Tile, sm90.cuh).
// Shared memory written by cp.async (generic proxy) is read by wgmma (async proxy): every thread
// fences the proxies after its copies land and before the barrier that publishes them.
//
// With PRODUCER = 1 the CTA is warp-specialized instead: one more warpgroup (the producer, threads
// 0 .. 127) issues every cp.async, and the WARPGROUPS = 2 consumer warpgroups only compute: that
// kernel is in varlen_ws.cuh, included at the end of this file.
//
// Compile-time parameters: SCALAR_T, HEAD_DIM (64, 128, 256), WARPGROUPS (1 or 2), BLOCK_N (keys
// per tile), NUM_STAGES (K/V pipeline depth), PRODUCER (0 or 1), PERSISTENT (0 or 1: with a
// producer, a grid of at most one CTA per SM, each working through a list of tasks), SMEM_BYTES
// (the host's dynamic shared memory for the shape, checked by WgTraits); optional, with a
// producer: STAGED_STORE (1: the output through shared memory), PV_OVERLAP (1: a warpgroup's
// softmax of tile t while its P V of tile t - 1 runs) and TRACE (1: a trace buffer argument, a row
// of stamps per CTA; one CTA per query tile only), all in varlen_ws.cuh.  Compiled for sm_90a
// only (kernels/varlen.py picks this kernel on compute capability 9.0 and falls back to varlen.cu
// elsewhere).  Without a producer, a warpgroup runs the steps of a tile in order, each waited for.
#include "common.cuh"
#include "mma.cuh"
#include "sm90.cuh"
#include "wgmma.cuh"

namespace varlen {

using cp::u32;
using cp::u64;
using T = SCALAR_T;

template <int D, int GROUPS, int BN, int STAGES, int WITH_PRODUCER, int IS_PERSISTENT>
struct WgTraits {
  static constexpr int kHeadDim = D, kBlockM = 64 * GROUPS, kBlockN = BN, kStages = STAGES;
  static constexpr bool kProducer = WITH_PRODUCER != 0, kPersistent = IS_PERSISTENT != 0;
  // A persistent CTA stages the prefix sum of each sequence's tasks for at most kMaxSeqs.
  static constexpr int kMaxSeqs = kPersistent ? 512 : 0;  // PERSISTENT_MAX_SEQS in kernels/varlen_wgmma.py
  static constexpr int kGroups = GROUPS, kGroupRows = 64;
  // The threads that load (all, or the producer warpgroup) and all of the CTA's.
  static constexpr int kThreads = kProducer ? 128 : 128 * GROUPS;
  static constexpr int kCtaThreads = 128 * (GROUPS + WITH_PRODUCER);
  // CTAs per SM the registers must allow: one warpgroup per CTA leaves room for two CTAs (at up to
  // 255 registers a thread), whose independent schedules overlap one's softmax with the other's
  // matrix products.
  static constexpr int kMinBlocks = GROUPS == 1 ? 2 : 1;
  static constexpr int kAhead = STAGES - 1;       // key tiles in flight ahead of the one computed
  static constexpr int kWarpRows = 16;
  static constexpr int kMTiles = 1;
  static constexpr int kNTiles = BN / 8;           // n8 column groups of S (a warp's accumulators)
  static constexpr int kDTiles = D / 8;            // n8 column groups of O
  static constexpr int kChunks = D / 8;            // 16-byte chunks per row of Q, K, V
  static constexpr int kKSteps = D / 16;           // k16 steps of Q K^T
  using QTile = cp::Sw128Tile<kChunks, kBlockM>;
  using KVTile = cp::Sw128Tile<kChunks, kBlockN>;
  static constexpr int kQBytes = QTile::kBytes;
  static constexpr int kKVBytes = KVTile::kBytes;
  // 1024 bytes of slack to align the tiles to the swizzle atom, Q, the K and V stages, one
  // "key is loadable" byte per key per stage, the paged loader's block-id ring (one int per key
  // per stage: varlen_common.cuh, id_ring).
  // With a producer: the same tiles, then its barriers (8 bytes each: Q full (and, persistent, Q
  // free), and per stage K full, V full, K free, V free; persistent, then the task of the Q in 16
  // bytes), a hole byte per producer warp and stage, the loadable bytes, then (persistent) the
  // prefix sum of the sequences' tasks (kMaxSeqs + 1 ints); no id ring.
  static constexpr int kBarrierBytes = 8 * (1 + IS_PERSISTENT + 4 * STAGES) + 16 * IS_PERSISTENT;
  static constexpr int kSmemBytes =
      kProducer ? 1024 + kQBytes + 2 * STAGES * kKVBytes + kBarrierBytes + 4 * STAGES + STAGES * BN +
                      (kPersistent ? 4 * (kMaxSeqs + 1) : 0)
                : 1024 + kQBytes + 2 * STAGES * kKVBytes + STAGES * BN + 4 * STAGES * BN;
  static_assert(D == 64 || D == 128 || D == 256, "wgmma N of P V: 64, 128 or 256");
  static_assert(BN == 64 || BN == 128 || BN == 256, "wgmma N of Q K^T: 64, 128 or 256");
  static_assert(STAGES >= 2, "at least double buffering");
  static_assert(GROUPS == 1 || GROUPS == 2, "one or two warpgroups per CTA");
  static_assert(!kProducer || GROUPS == 2, "the producer serves two consumer warpgroups");
  static_assert(!kPersistent || kProducer, "persistent CTAs are warp-specialized");
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an sm_90 CTA may have");
};

using Tr = WgTraits<HEAD_DIM, WARPGROUPS, BLOCK_N, NUM_STAGES, PRODUCER, PERSISTENT>;
// The host launches with SMEM_BYTES of dynamic shared memory (WgmmaTiles.smem_bytes in
// kernels/varlen_wgmma.py): it must be this layout's size.
static_assert(Tr::kSmemBytes == SMEM_BYTES, "WgmmaTiles.smem_bytes differs from WgTraits::kSmemBytes");

}  // namespace varlen

// A lean producer (fewer registers: its copy loops rolled) where the consumers need more:
// the overlap of softmax and P V at D >= 128 (varlen_ws.cuh).
#if PRODUCER && defined(PV_OVERLAP) && PV_OVERLAP && HEAD_DIM >= 128
#define WS_LEAN_PRODUCER 1
#endif
#include "varlen_common.cuh"

namespace varlen {

using PFragsWg = u32[Tr::kBlockN / 16][4];

// The wgmma instructions of S = Q K^T for this warpgroup's 64 rows (no fence, no commit).
__device__ __forceinline__ void qk_products(float (&s)[Tr::kNTiles][4], u64 desc_q, u64 desc_k) {
#pragma unroll
  for (int kk = 0; kk < Tr::kKSteps; ++kk) {
    // k16 step kk: column block kk / 4, 32 bytes per step inside the block's 128-byte rows.
    const u64 q_step = ((kk >> 2) * Tr::QTile::kColumnBytes + (kk & 3) * 32) >> 4;
    const u64 k_step = ((kk >> 2) * Tr::KVTile::kColumnBytes + (kk & 3) * 32) >> 4;
    cp::Wgmma<Tr::kBlockN>::ss(s, desc_q + q_step, desc_k + k_step, kk > 0, T());
  }
}


// S = Q K^T for this warpgroup's 64 rows: issued, not waited for.
__device__ __forceinline__ void qk_issue(float (&s)[Tr::kNTiles][4], u64 desc_q, u64 desc_k) {
  cp::wgmma_fence();
  qk_products(s, desc_q, desc_k);
  cp::wgmma_commit();
}

// Pins every register of a fragment array (cp::fence_operand: float or u32) at this point.
template <typename X, int N>
__device__ __forceinline__ void fence_operands(X (&x)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) cp::fence_operand(x[i][e]);
}

// The wgmma instructions of O += P V for this warpgroup (no fence, no commit).
__device__ __forceinline__ void pv_products(float (&o)[Tr::kDTiles][4], PFragsWg& p, u64 desc_v) {
#pragma unroll
  for (int kk = 0; kk < Tr::kBlockN / 16; ++kk)  // keys 16 kk .. + 15: two 8-row groups of V
    cp::Wgmma<Tr::kHeadDim>::rs(o, p[kk], desc_v + ((kk * 16 * 128) >> 4), T());
}

// O += P V for this warpgroup, waited for: the next iteration rescales O and reuses the stage.
// Neither O nor P may be touched while it runs, hence the fences on both sides of it.
__device__ __forceinline__ void pv_run(float (&o)[Tr::kDTiles][4], PFragsWg& p, u64 desc_v) {
  fence_operands(o);
  fence_operands(p);
  cp::wgmma_fence();
  pv_products(o, p, desc_v);
  cp::wgmma_commit();
  cp::wgmma_wait<0>();
  fence_operands(o);
  fence_operands(p);
}

// The warp's scores of one key tile -> P (in place), the row statistics updated; returns each
// row's rescale factor for O in `alphas` (the caller applies it once O may be touched).
__device__ __forceinline__ void scores_to_p(float (&s)[1][Tr::kNTiles][4], WarpState& st, RowFactors& alphas,
                                            const Task& t, int n0, bool hole, const unsigned char* loadable,
                                            int row0, int row_last, int lane, float softmax_scale, float softcap,
                                            int window_left, int window_right) {
  // Does the tile straddle one of this warp's row bounds?
  const bool needs_mask = hole || n0 + Tr::kBlockN > t.length_k ||
                          (window_right >= 0 && n0 + Tr::kBlockN - 1 > row0 + t.offset + window_right) ||
                          (window_left >= 0 && n0 < row_last + t.offset - window_left);
  if (t.mods) apply_score_mods(s, softmax_scale, softcap, t.slope, row0, t.offset, n0, lane);
  if (needs_mask)
    apply_mask(s, row0, t.offset, n0, t.length_k, window_left, window_right, hole, loadable, lane);
  softmax_scores(s, st, t.scale_log2, alphas);
}

}  // namespace varlen

#if !PRODUCER
extern "C" __global__ void __launch_bounds__(varlen::Tr::kThreads, varlen::Tr::kMinBlocks) varlen_fwd_wgmma(VARLEN_FWD_PARAMS) {
  using namespace varlen;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // wgmma's 128-byte swizzle repeats every 1024 bytes: the tiles start on such a boundary.
  const u32 raw = cp::smem_address(smem_raw);
  const u32 s_q = (raw + 1023u) & ~1023u;
  const u32 s_kv = s_q + Tr::kQBytes;
  unsigned char* s_loadable = smem_raw + (s_q - raw) + Tr::kQBytes + 2 * Tr::kStages * Tr::kKVBytes;

  Task t;
  if (make_task(t, VARLEN_FWD_ARGS)) {  // the CTA's work; then its one exit (check_sequence says why)
    const int m0 = t.m0, length_q = t.length_q, offset = t.offset;
    const int tile_first = t.tile_first, num_tiles = t.num_tiles;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, group = warp >> 2;
    const int row0 = m0 + warp * Tr::kWarpRows;  // this warp's first row, within the sequence
    const int row_last = min(row0 + Tr::kWarpRows, length_q) - 1;
    const int group_row0 = m0 + group * Tr::kGroupRows;
    const int group_last = min(group_row0 + Tr::kGroupRows, length_q) - 1;
    const bool group_active = group_row0 < length_q;  // a warpgroup past the sequence's end only loads

    WarpState st;
    init_state(st);

    // Descriptors of k16 step 0: Q at this warpgroup's rows; K and V of stage 0 (a stage's offset
    // and a step's are added in units of 16 bytes).
    const u64 desc_q = cp::smem_descriptor(s_q + group * Tr::kGroupRows * 128, 16, 1024);
    const u64 desc_k = cp::smem_descriptor(s_kv, 16, 1024);
    const u64 desc_v = cp::smem_descriptor(s_kv + Tr::kKVBytes, Tr::KVTile::kColumnBytes, 1024);

    int hole_bits = load_prologue(s_q, s_kv, s_loadable, t, q_row, total_q);  // bit s: a hole in stage s

    // Does this warpgroup see any key of the tile at n0?  (wgmma is issued by the whole warpgroup.)
    auto sees = [&](int n0) {
      return group_active && (window_right < 0 || n0 <= group_last + offset + window_right) &&
             (window_left < 0 || n0 + Tr::kBlockN - 1 >= group_row0 + offset - window_left);
    };
    auto stage_step = [](int stage) { return static_cast<u64>((2 * stage * Tr::kKVBytes) >> 4); };
    // Prefetch key tile `ahead` into its stage, which the barrier just freed; every thread takes part.
    auto prefetch = [&](int ahead) {
      const int ps = ahead % Tr::kStages;
      hole_bits &= ~(1 << ps);
      if (ahead < num_tiles) hole_bits |= load_stage<true>(s_kv, s_loadable, t, ahead);
      cp::cp_async_commit();
    };
    PFrags p;
    RowFactors alphas;

    // Per tile: S = Q K^T (the prefetch overlaps it), softmax, O += P V, each waited for.
    for (int it = 0; it < num_tiles; ++it) {
      const int stage = it % Tr::kStages;
      const int n0 = (tile_first - it) * Tr::kBlockN;
      // Wait for this tile (and Q), hand it to the async proxy, publish it; the barrier also
      // frees the stage that no warpgroup reads any more.
      cp::cp_async_wait<Tr::kAhead - 1>();
      cp::fence_proxy_async();
      const bool hole = __syncthreads_or((hole_bits >> stage) & 1);
      const bool visible = sees(n0);
      float s[1][Tr::kNTiles][4];
      if (visible) qk_issue(s[0], desc_q, desc_k + stage_step(stage));          // S = Q K^T
      prefetch(it + Tr::kAhead);
      if (!visible) continue;
      cp::wgmma_wait<0>();
      fence_operands(s[0]);
      scores_to_p(s, st, alphas, t, n0, hole, s_loadable + stage * Tr::kBlockN, row0, row_last, lane,
                  softmax_scale, softcap, window_left, window_right);           // P = softmax(S)
      rescale_o(st, alphas);
      pack_p(s, p);
      pv_run(st.o[0], p[0], desc_v + stage_step(stage));                        // O += P V
    }
    cp::cp_async_wait<0>();  // no copy may still target shared memory when the CTA exits

    if (row0 < length_q)
      store_output(st, t.out_head, t.out_row, lse, t.lse_base, t.q_start, row0, length_q, total_q, t.scale_log2, lane);
  }
  check_inputs(VARLEN_FWD_ARGS);
}
#else
#include "varlen_ws.cuh"
#endif
