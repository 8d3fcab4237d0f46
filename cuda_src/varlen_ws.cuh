// The warp-specialized wgmma kernel (varlen_wgmma.cu with PRODUCER = 1; included there, after the
// helpers it shares with the kernel without a producer).  Same task per CTA (one CTA per query
// tile; PERSISTENT = 1: a list of them), same results.
//
// A CTA is three warpgroups.  Warpgroup 0, the producer, gives registers back (setmaxnreg) and
// issues every copy: Q once, then per key tile its K into a K slot and its V into a V slot, each
// behind an mbarrier that the copies themselves complete (cp.async.mbarrier.arrive), so no thread
// waits for a copy it did not need.  Warpgroups 1 and 2, the consumers, take the registers and own
// 64 query rows each; they never issue a load and never meet at a CTA barrier.  Per tile t a
// consumer warpgroup runs
//   [ O += P(t-1) V(t-1);  S = Q K(t)^T ]   both issued at once, then waited for
//   softmax(S) -> P(t), O rescaled
// and the two warpgroups take turns for the bracketed products (two named barriers): while one
// warpgroup's matrix products run on the tensor cores, the other computes its softmax.  With
// PV_OVERLAP (a candidate) S = Q K(t)^T is issued first and waited for alone, and the softmax runs
// while O += P(t-1) V(t-1) still does; O is rescaled and P(t) packed after that wait.  A K slot
// is free again once both warpgroups have computed their softmax of it (the loadable bytes of the
// tile are read there), a V slot once both have waited for its P V.
//
// Memory ordering: cp.async copies are generic-proxy writes and wgmma reads through the async proxy,
// so a consumer fences the proxies after its wait on a full barrier (which acquires the copies) and
// before it issues the products (TMA copies, TMA = 1, are async-proxy writes: the fence is then
// redundant and harmless); the loadable bytes and hole flags are plain shared stores of the producer,
// released by its ordinary arrival on the K barrier.
//
// With PERSISTENT = 1 the grid has at most one CTA per SM and each CTA works through a list of
// tasks (TaskList): the warpgroups go from one task to the next without meeting, the K/V ring
// and its barriers run on across tasks (tiles counted from the CTA's first), and the producer
// loads the next task's Q as soon as both consumers have finished their last Q K^T and its
// softmax (a "Q free" barrier), so that the next task's first tiles load while the consumers
// finish the last P V and store the output of the one before.

namespace varlen {

// The TRACE specialization's row per CTA (kernels/varlen_wgmma.py TRACE_COLUMNS, global ns unless
// said): 0 entry, 1 SM, 2 its task known (0: no task), 3 Q's copies issued, 4 every copy issued, 5 Q landed
// (consumer warpgroup 0), 6 its first S, 7 its last tile's softmax done, 8 its last P V done, 9
// its output stored, 10 warpgroup 1's output stored, 11 the task's key tiles.
#if TRACE
static_assert(!Tr::kPersistent, "the trace is of one CTA per query tile");
__shared__ unsigned long long* s_trace_row;
#define WS_STAMP(column, value) (s_trace_row[column] = (value))
#else
#define WS_STAMP(column, value) ((void)0)
#endif

#ifndef STAGED_STORE
#define STAGED_STORE 0
#endif
#ifndef PV_OVERLAP
#define PV_OVERLAP 0
#endif
#ifndef TMA
#define TMA 0
#endif
constexpr bool WS_LEAN = WS_LEAN_PRODUCER != 0;  // varlen_wgmma.cu: PV_OVERLAP at D >= 128

// A lean producer gives the consumers 24 more registers each: P stays live through the softmax
// when it runs under P V (PV_OVERLAP), which at D = 128 needs 216 a thread to spill nothing.
// (The TMA loader's producer takes the same split: below 72 its cp.async loop for partial tiles
// spills, NOTES_varlen.md v16.)
constexpr int kProducerRegisters = WS_LEAN ? 72 : 112, kConsumerRegisters = WS_LEAN ? 216 : 192;
// setmaxnreg only moves registers inside the CTA's launch allocation: kCtaThreads threads of the
// count ptxas gives the kernel under __launch_bounds__(kCtaThreads, 1), the most that fits 64 Ki
// registers in multiples of 8 (168 for 384 threads; tests/test_compiler.py checks that every
// producer key gets it).  A consumer warp's increase past what the producer released waits
// forever: the first GPU run of the lean producer hung so (80 + 216 needed 65,536 of 64,512).
constexpr int kLaunchRegisters = 65536 / Tr::kCtaThreads / 8 * 8;
static_assert(128 * kProducerRegisters + 256 * kConsumerRegisters <= Tr::kCtaThreads * kLaunchRegisters,
              "the CTA's launch allocation of registers");
static_assert(kProducerRegisters % 8 == 0 && kConsumerRegisters % 8 == 0 && 24 <= kProducerRegisters &&
                  kProducerRegisters <= kLaunchRegisters && kLaunchRegisters <= kConsumerRegisters &&
                  kConsumerRegisters <= 256,
              "setmaxnreg: multiples of 8 in 24 .. 256, the producer's decreased, the consumers' increased");
constexpr int kConsumerThreads = 256;
constexpr int kTurnBarrier = 1;  // named barriers 1 and 2: the turn of consumer warpgroup 0 / 1

// The producer's barriers, after the K/V stages in shared memory.
struct Barriers {
  static constexpr int kQ = Tr::kPersistent ? 2 : 1;  // Q full (and Q free)
  u32 base;
  __device__ __forceinline__ u32 q_full() const { return base; }
  __device__ __forceinline__ u32 q_free() const { return base + 8; }
  __device__ __forceinline__ u32 k_full(int s) const { return base + 8 * (kQ + s); }
  __device__ __forceinline__ u32 v_full(int s) const { return base + 8 * (kQ + Tr::kStages + s); }
  __device__ __forceinline__ u32 k_free(int s) const { return base + 8 * (kQ + 2 * Tr::kStages + s); }
  __device__ __forceinline__ u32 v_free(int s) const { return base + 8 * (kQ + 3 * Tr::kStages + s); }

  // Expected arrivals per phase: a copy arrival by each producer thread (with the TMA loader an
  // ordinary arrival in its place, thread 0's arming the tile's bytes), and for K an ordinary one
  // after its loadable bytes and hole flag; a free slot, one arrival by each consumer thread,
  // after its own reads of the slot.
  __device__ __forceinline__ void init() const {
    cp::mbar_init(q_full(), Tr::kPersistent ? 129 : 128);  // persistent: and the task's arrival
    if (Tr::kPersistent) cp::mbar_init(q_free(), kConsumerThreads);
    for (int s = 0; s < Tr::kStages; ++s) {
      cp::mbar_init(k_full(s), 2 * 128);
      cp::mbar_init(v_full(s), 128);
      cp::mbar_init(k_free(s), kConsumerThreads);
      cp::mbar_init(v_free(s), kConsumerThreads);
    }
  }
};

// Tile `g` of the CTA (its tiles counted over its tasks) is in slot g % kStages in its round
// g / kStages; a slot's barriers complete once per round, so a wait names the round's parity.
__device__ __forceinline__ u32 round_parity(int g) { return static_cast<u32>((g / Tr::kStages) & 1); }

// A paged full tile read by the producer with its block ids already in registers, fetched a tile
// ahead (so that no copy waits on a block-table load).  With 128 producer threads and 16 chunks a
// row (D = 128), a thread's rows are r0 + 8 pass (r0 < 8): passes 2q and 2q + 1 lie in one
// 16-aligned run of keys, so for blocks of 16 keys or more they share ids[q].
using Passes = TilePasses<Tr::kBlockN>;
constexpr bool kIdsAhead = Passes::kLaneFixed && Passes::kRowsPerPass == 8 && Passes::kCount % 2 == 0;
constexpr int kIds = Passes::kCount / 2;

__device__ __forceinline__ bool ids_ahead(const KvSource& src, int n0) {
  return kIdsAhead && src.table != nullptr && src.block_shift >= 4 && paged_full_tile(src, n0);
}

__device__ __forceinline__ void fetch_ids(int (&ids)[kIds], const KvSource& src, int n0) {
  const paged::Blocks layout(src.block_shift);
#pragma unroll
  for (int q = 0; q < kIds; ++q) ids[q] = __ldg(src.table + layout.column(n0 + Passes::row(2 * q)));
}

template <int kParts>
__device__ __forceinline__ int load_full_paged(u32 s_tile, unsigned char* s_loadable, const KvSource& src, int n0,
                                               const int (&ids)[kIds]) {
  const paged::Blocks layout(src.block_shift);
  const int c = threadIdx.x % Tr::kChunks;
  const unsigned slot_bytes = static_cast<unsigned>(kParts == kLoadK ? src.k_row : src.v_row) * sizeof(T);
  const char* chunk = reinterpret_cast<const char*>((kParts == kLoadK ? src.k : src.v) + c * 8);
  int hole = 0;
#pragma unroll
  for (int pass = 0; pass < Passes::kCount; ++pass) {
    const int r = Passes::row(pass), block = ids[pass / 2];
    const bool ok = paged::is_block(block, src.num_rows);
    const unsigned slot = ok ? layout.slot(block, n0 + r) : 0u;
    cp::cp_async_16(s_tile + Tr::KVTile::offset(r, c), chunk + static_cast<cp::u64>(slot) * slot_bytes, ok);
    if (kParts == kLoadK && c == 0) s_loadable[r] = ok;
    hole |= !ok;
  }
  return hole;
}

// Warpgroup 0: every copy of task number `n` of the CTA, whose first tile is the CTA's tile g0.
// `holes`: a byte per producer warp and stage, set when a thread of the warp met a hole in the
// stage's tile.  The copies are not waited for here.
// Persistent, the task's (query tile, head, sequence, 1) goes to `s_task` with its Q.
__device__ __forceinline__ void produce(const Task& t, u32 s_q, u32 s_kv, Barriers bars, unsigned char* holes,
                                        unsigned char* s_loadable, long long q_row, int total_q, int g0, int n,
                                        int* s_task = nullptr, int4 task = int4()) {
  if (Tr::kPersistent) {
    if (n > 0) cp::mbar_wait(bars.q_free(), static_cast<u32>((n - 1) & 1));
    if (threadIdx.x == 0) {
      s_task[0] = task.x;
      s_task[1] = task.y;
      s_task[2] = task.z;
      s_task[3] = task.w;
      cp::mbar_arrive(bars.q_full());
    }
  }
  load_q_tile(s_q, t.q_head, q_row, (long long)t.q_start + t.m0, t.m_end - t.m0, total_q);
  cp::cp_async_mbar_arrive(bars.q_full());
  if (TRACE && threadIdx.x == 0) WS_STAMP(3, cp::global_ns());
  KvSource src = t.src;
  int ids[kIds], next_ids[kIds];
  bool next_ahead = ids_ahead(src, t.tile_first * Tr::kBlockN);
  if (next_ahead) fetch_ids(next_ids, src, t.tile_first * Tr::kBlockN);
  for (int it = 0; it < t.num_tiles; ++it) {
    // The row strides and lane offsets re-read each tile: hoisted out of the loop, their products
    // would outnumber the producer's registers and spill.
    asm volatile("" : "+r"(src.k_row), "+r"(src.v_row), "+l"(src.k_lane), "+l"(src.v_lane));
    const int stage = (g0 + it) % Tr::kStages;
    const u32 free_parity = round_parity(g0 + it) ^ 1u;  // the previous round's release (a fresh slot: at once)
    const int n0 = (t.tile_first - it) * Tr::kBlockN;
    const u32 s_k = s_kv + 2 * stage * Tr::kKVBytes;
    unsigned char* loadable = s_loadable + stage * Tr::kBlockN;
    const bool ahead = next_ahead;
#pragma unroll
    for (int q = 0; q < kIds; ++q) ids[q] = next_ids[q];
    // The next tile's block ids, loaded now and used after this tile's copies.  A lean producer
    // loads them after the copies instead (one set of ids in registers at a time): the wait for
    // the next free slot covers them when the producer is ahead, not in the ramp, whose slots are
    // free at once, nor where the producer is what the consumers wait for.
    next_ahead = it + 1 < t.num_tiles && ids_ahead(src, n0 - Tr::kBlockN);
    if (!WS_LEAN && next_ahead) fetch_ids(next_ids, src, n0 - Tr::kBlockN);
    cp::mbar_wait(bars.k_free(stage), free_parity);
    const int hole = ahead ? load_full_paged<kLoadK>(s_k, loadable, src, n0, ids)
                           : load_kv_tile<false, kLoadK>(s_k, 0u, loadable, nullptr, false, 0u, src, n0);
    cp::cp_async_mbar_arrive(bars.k_full(stage));
    const bool warp_hole = __any_sync(0xffffffffu, hole);
    if ((threadIdx.x & 31) == 0) {
      // The warp's index read again here: kept across the loop, it is what would spill.
      unsigned tid;
      asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
      holes[4 * stage + (tid >> 5)] = warp_hole;
    }
    cp::mbar_arrive(bars.k_full(stage));
    cp::mbar_wait(bars.v_free(stage), free_parity);
    if (ahead)
      load_full_paged<kLoadV>(s_k + Tr::kKVBytes, loadable, src, n0, ids);
    else
      load_kv_tile<false, kLoadV>(0u, s_k + Tr::kKVBytes, loadable, nullptr, false, 0u, src, n0);
    cp::cp_async_mbar_arrive(bars.v_full(stage));
    if (WS_LEAN && next_ahead) fetch_ids(next_ids, src, n0 - Tr::kBlockN);
  }
  if (TRACE && threadIdx.x == 0) WS_STAMP(4, cp::global_ns());
}

#if TMA
// ---- TMA = 1: full key tiles copied by the tensor-memory accelerator
//
// The host encodes two tensor maps (cupy_paged/_core/tma.py) that view K and V as [slots, kv heads,
// head dim]: a paged cache's slot is block * block_size + offset, a contiguous K/V's its row.  Each
// box is copied one 64-element column block at a time, and the maps' 128-byte swizzle writes exactly
// Sw128Tile's layout (it repeats every 8 rows, so one 128-row box writes the bytes of eight 16-row
// ones).  A contiguous full tile is one box of kBlockN rows (the host encodes its map so), issued by
// thread 0; a paged one is kRuns boxes of 16 rows (a box lies in one block for blocks of 16 keys or
// more), each issued by the producer thread of its first row with the block id that thread read
// for its own row, so that no thread waits on a chain of block-table loads and the runs' copies
// go out side by side.  Thread 0 arms the slot's barrier with the tile's bytes; the copies complete
// it by their byte count.  Where the cp.async loader has every producer thread issue kBlockN *
// kChunks / 128 copies a tile, a contiguous tile takes kChunks / 8 and a paged one kChunks / 8 from
// each of kRuns threads.  A contiguous full tile has no hole: its producer threads write no
// loadable byte and vote nothing, but each warp still writes its hole flag (zero), which a partial
// tile earlier in the same stage may have left set.  A hole's box starts at the first slot past the cache, so it lands
// as zeros, as a hole's cp.async rows do.  Partial tiles (a sequence's last keys, a table row's last
// columns) and blocks of 8 keys keep the cp.async loader (load_kv_tile).
static_assert(!Tr::kPersistent, "the TMA loader runs one CTA per query tile");
static_assert(Tr::kBlockN == 128, "a TMA tile's rows are the producer warpgroup's threads, one each");
constexpr int kBoxRows = 16, kColumnBlocks = Tr::kChunks / 8;

// Whether the tile at n0 is copied by the TMA: all its keys inside the sequence (contiguous: inside
// k and v) and, paged, in listed columns of blocks of at least 16 keys.
__device__ __forceinline__ bool tma_tile(const KvSource& src, int n0) {
  if (src.table == nullptr) return n0 + Tr::kBlockN <= src.loadable;
  return src.block_shift >= 4 && n0 + Tr::kBlockN <= src.length &&
         paged::Blocks(src.block_shift).column(n0 + Tr::kBlockN - 1) < src.table_width;
}

// This thread's boxes of the K or V tile at n0 -> the tile at s_tile, completing the barrier `bar`:
// contiguous, thread 0's one box of kBlockN rows a column block; paged, row `row`'s run of 16 rows
// (block id `id`; a hole's box starts at the first slot past the cache, num_blocks * block_size).
// The slot may have been written by cp.async (generic proxy) in an earlier round: the proxy fence
// orders those writes, released to this thread through the slot's free barrier, before the TMA's
// (async proxy).
__device__ __forceinline__ void tma_boxes(u32 s_tile, u64 map, u32 bar, const KvSource& src, int n0, int row, int id,
                                          int kv_head) {
  cp::fence_proxy_async();
  const int slot = src.table == nullptr ? src.first_row + n0
                   : paged::is_block(id, src.num_rows) ? static_cast<int>(paged::Blocks(src.block_shift).slot(id, n0 + row))
                                                       : src.num_rows << src.block_shift;
#pragma unroll
  for (int cb = 0; cb < kColumnBlocks; ++cb)
    cp::tma_load_3d(s_tile + cb * Tr::KVTile::kColumnBytes + row * 128, map, cb * 64, kv_head, slot, bar);
}

// produce() with the full tiles copied by the TMA (`maps`: the kernel's parameter, whose address the
// copies take where they are issued; the CTA's kv head).  One CTA per query tile: the task's tiles
// are the CTA's tiles 0, 1, ...  Tiles are visited downwards and a tile the TMA copies has every
// tile below it copied so too (tma_tile's bounds only grow more true as n0 falls), so the tiles
// the cp.async loader takes come first, in a loop of their own (two loops hold fewer registers
// than one that can take either kind).
__device__ __forceinline__ void produce_tma(const Task& t, u32 s_q, u32 s_kv, Barriers bars, unsigned char* holes,
                                            unsigned char* s_loadable, long long q_row, int total_q,
                                            const cp::TmaMaps& maps, int kv_head) {
  load_q_tile(s_q, t.q_head, q_row, (long long)t.q_start + t.m0, t.m_end - t.m0, total_q);
  cp::cp_async_mbar_arrive(bars.q_full());
  if (TRACE && threadIdx.x == 0) WS_STAMP(3, cp::global_ns());
  KvSource src = t.src;
  int it = 0;
  for (; it < t.num_tiles; ++it) {
    const int n0 = (t.tile_first - it) * Tr::kBlockN;
    if (tma_tile(src, n0)) break;
    asm volatile("" : "+r"(src.k_row), "+r"(src.v_row), "+l"(src.k_lane), "+l"(src.v_lane));
    const int stage = it % Tr::kStages;
    const u32 free_parity = round_parity(it) ^ 1u;  // the previous round's release (a fresh slot: at once)
    const u32 s_k = s_kv + 2 * stage * Tr::kKVBytes;
    unsigned char* loadable = s_loadable + stage * Tr::kBlockN;
    cp::mbar_wait(bars.k_free(stage), free_parity);
    const int hole = load_kv_tile<false, kLoadK>(s_k, 0u, loadable, nullptr, false, 0u, src, n0);
    cp::cp_async_mbar_arrive(bars.k_full(stage));
    const bool warp_hole = __any_sync(0xffffffffu, hole);
    if ((threadIdx.x & 31) == 0) holes[4 * stage + (threadIdx.x >> 5)] = warp_hole;
    cp::mbar_arrive(bars.k_full(stage));
    cp::mbar_wait(bars.v_free(stage), free_parity);
    load_kv_tile<false, kLoadV>(0u, s_k + Tr::kKVBytes, loadable, nullptr, false, 0u, src, n0);
    cp::cp_async_mbar_arrive(bars.v_full(stage));
  }
  const bool paged = src.table != nullptr;
  const int row = static_cast<int>(threadIdx.x);  // this thread's row of each tile
  // Paged, the first row of each 16-row run issues that run's boxes; contiguous, thread 0 the tile's.
  const bool issues = paged ? row % kBoxRows == 0 : row == 0;
  const paged::Blocks layout(src.block_shift);
  // This row's block id, read a tile ahead (the wait for the next free slot covers the load).
  int next_id = it < t.num_tiles && paged ? __ldg(src.table + layout.column((t.tile_first - it) * Tr::kBlockN + row)) : 0;
  for (; it < t.num_tiles; ++it) {
    const int stage = it % Tr::kStages;
    const u32 free_parity = round_parity(it) ^ 1u;
    const int n0 = (t.tile_first - it) * Tr::kBlockN;
    const u32 s_k = s_kv + 2 * stage * Tr::kKVBytes;
    const int id = next_id;
    if (it + 1 < t.num_tiles && paged) next_id = __ldg(src.table + layout.column(n0 - Tr::kBlockN + row));
    cp::mbar_wait(bars.k_free(stage), free_parity);
    bool warp_hole = false;
    if (paged) {
      const bool ok = paged::is_block(id, src.num_rows);
      s_loadable[stage * Tr::kBlockN + row] = ok;
      warp_hole = __any_sync(0xffffffffu, !ok);
    }
    // Thread 0's first arrival arms the tile's bytes; every other thread's stands in for its copies'.
    if (threadIdx.x == 0)
      cp::mbar_arrive_expect_tx(bars.k_full(stage), Tr::kKVBytes);
    else
      cp::mbar_arrive(bars.k_full(stage));
    if (issues) tma_boxes(s_k, reinterpret_cast<u64>(&maps.k), bars.k_full(stage), src, n0, row, id, kv_head);
    if ((threadIdx.x & 31) == 0) holes[4 * stage + (threadIdx.x >> 5)] = warp_hole;
    cp::mbar_arrive(bars.k_full(stage));
    cp::mbar_wait(bars.v_free(stage), free_parity);
    if (threadIdx.x == 0)
      cp::mbar_arrive_expect_tx(bars.v_full(stage), Tr::kKVBytes);
    else
      cp::mbar_arrive(bars.v_full(stage));
    if (issues) tma_boxes(s_k + Tr::kKVBytes, reinterpret_cast<u64>(&maps.v), bars.v_full(stage), src, n0, row, id, kv_head);
  }
  if (TRACE && threadIdx.x == 0) WS_STAMP(4, cp::global_ns());
}
#endif

// STAGED_STORE: a consumer warpgroup's output rows through shared memory, then to global memory
// 16 bytes a thread, each row written by 16 (D = 128) consecutive threads.  The warpgroup's
// half of the Q tile holds them (same swizzled layout, conflict-free both ways): its own last
// Q K^T has completed, and the other warpgroup reads only its own half.  `q_tile`: the Q tile.
// One CTA per query tile only (a persistent CTA's next Q may be loading there).  The LSE as in
// store_output (finish_rows: the rows that store_output writes are the ones stored here).
__device__ __forceinline__ void store_output_staged(WarpState& st, unsigned char* q_tile, T* out, long long out_row,
                                                    float* lse, long long lse_base, int q_start, int m0, int ct,
                                                    int length_q, int total_q, float scale_log2) {
  const int lane = ct & 31, warp = ct >> 5, group = warp >> 2, gt = ct & 127;
  finish_rows(st, lse, lse_base, q_start, m0 + warp * Tr::kWarpRows, length_q, total_q, scale_log2, lane,
              [&](int i, long long, int dt, u32 pair) {
                *reinterpret_cast<u32*>(q_tile + Tr::QTile::offset(i - m0, dt) + (lane & 3) * 4) = pair;
              });
  cp::named_sync(kTurnBarrier + 2 + group, 128);  // the warpgroup's rows are in shared memory
  constexpr int kRowsPerPass = 128 / Tr::kChunks;
#pragma unroll
  for (int pass = 0; pass < Tr::kGroupRows / kRowsPerPass; ++pass) {
    const int r = group * Tr::kGroupRows + pass * kRowsPerPass + gt / Tr::kChunks, c = gt % Tr::kChunks;
    const long long row = (long long)q_start + m0 + r;
    if (m0 + r < length_q && row >= 0 && row < total_q)
      reinterpret_cast<uint4*>(out + row * out_row)[c] =
          *reinterpret_cast<const uint4*>(q_tile + Tr::QTile::offset(r, c));
  }
}

// One consumer warpgroup (`group` 0 or 1, its threads numbered `ct` = 0 .. 255 across both): task
// number `n` of the CTA, whose first tile is the CTA's tile g0.
__device__ __forceinline__ void consume(const Task& t, u32 s_q, u32 s_kv, Barriers bars, const unsigned char* holes,
                                        const unsigned char* s_loadable, int ct, float* lse, int total_q,
                                        float softmax_scale, float softcap, int window_left, int window_right,
                                        int g0, int n, unsigned char* q_tile = nullptr) {
  const int m0 = t.m0, length_q = t.length_q, offset = t.offset;
  // The warp and warpgroup as warp-uniform values (a shuffle from lane 0), so that the compiler
  // sees the products issued on uniform paths.
  const int lane = ct & 31, warp = __shfl_sync(0xffffffffu, ct >> 5, 0), group = warp >> 2;
  const int row0 = m0 + warp * Tr::kWarpRows;  // this warp's first row, within the sequence
  const int row_last = min(row0 + Tr::kWarpRows, length_q) - 1;
  const int group_row0 = m0 + group * Tr::kGroupRows;
  const int group_last = min(group_row0 + Tr::kGroupRows, length_q) - 1;
  const bool group_active = group_row0 < length_q;  // a warpgroup past the sequence's end only takes turns
  auto sees = [&](int n0) {
    return group_active && (window_right < 0 || n0 <= group_last + offset + window_right) &&
           (window_left < 0 || n0 + Tr::kBlockN - 1 >= group_row0 + offset - window_left);
  };
  auto stage_step = [](int stage) { return static_cast<u64>((2 * stage * Tr::kKVBytes) >> 4); };
  const u64 desc_q = cp::smem_descriptor(s_q + group * Tr::kGroupRows * 128, 16, 1024);
  const u64 desc_k = cp::smem_descriptor(s_kv, 16, 1024);
  const u64 desc_v = cp::smem_descriptor(s_kv + Tr::kKVBytes, Tr::KVTile::kColumnBytes, 1024);
  const int my_turn = kTurnBarrier + group, other_turn = kTurnBarrier + 1 - group;

  WarpState st;
  init_state(st);
  PFrags p;
  float s[1][Tr::kNTiles][4];
  // The products are issued on every path alike (a wgmma under a branch is serialized by the
  // compiler): a tile this warpgroup does not see has its S computed and dropped, and a P of zeros.
  // Tile it's softmax in two halves: P = softmax(S) in S's registers with each row's factor for O
  // (false for a tile this warpgroup does not see), then, once O and P may be touched, O rescaled
  // and P packed (zeros for a tile not seen).
  auto scores_tile = [&](int it, RowFactors& alphas) {
    const int stage = (g0 + it) % Tr::kStages, n0 = (t.tile_first - it) * Tr::kBlockN;
    if (!sees(n0)) return false;
    const bool hole = *reinterpret_cast<const unsigned*>(holes + 4 * stage) != 0u;
    scores_to_p(s, st, alphas, t, n0, hole, s_loadable + stage * Tr::kBlockN, row0, row_last, lane,
                softmax_scale, softcap, window_left, window_right);
    return true;
  };
  auto finish_tile = [&](bool seen, const RowFactors& alphas) {
    if (seen) {
      rescale_o(st, alphas);
      pack_p(s, p);
    } else {
      // Zeros written by asm volatile: a plain store of zeros was hoisted above the branch and
      // executed on every tile (32 moves a thread), the seen tile's packing overwriting them.
#pragma unroll
      for (int kk = 0; kk < Tr::kBlockN / 16; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("mov.b32 %0, 0;" : "=r"(p[0][kk][e]));
    }
  };
  auto softmax_tile = [&](int it) {
    RowFactors alphas;
    finish_tile(scores_tile(it, alphas), alphas);
    cp::mbar_arrive(bars.k_free((g0 + it) % Tr::kStages));  // its hole and loadable bytes are read
  };

  cp::mbar_wait(bars.q_full(), static_cast<u32>(n & 1));
  if (TRACE && ct == 0) WS_STAMP(5, cp::global_ns());
  if (group == 1) cp::named_arrive(kTurnBarrier, kConsumerThreads);  // warpgroup 0 goes first
  // Tile 0: S only.
  cp::mbar_wait(bars.k_full(g0 % Tr::kStages), round_parity(g0));
  cp::fence_proxy_async();
  cp::named_sync(my_turn, kConsumerThreads);
  cp::wgmma_fence();
  qk_products(s[0], desc_q, desc_k + stage_step(g0 % Tr::kStages));
  cp::wgmma_commit();
  cp::named_arrive(other_turn, kConsumerThreads);
  cp::wgmma_wait<0>();
  fence_operands(s[0]);
  if (TRACE && ct == 0) WS_STAMP(6, cp::global_ns());
  softmax_tile(0);
  for (int it = 1; it < t.num_tiles; ++it) {
    const int g = g0 + it, stage = g % Tr::kStages, prev = (g - 1) % Tr::kStages;
    cp::mbar_wait(bars.k_full(stage), round_parity(g));
    cp::mbar_wait(bars.v_full(prev), round_parity(g - 1));
    cp::fence_proxy_async();
    cp::named_sync(my_turn, kConsumerThreads);
    fence_operands(st.o[0]);
    fence_operands(p[0]);
    cp::wgmma_fence();
#if PV_OVERLAP
    // S first, in its own group, then P V: once S is done its softmax runs while P V still does.
    // P V reads P from registers and accumulates into O: neither is touched until it is waited for.
    qk_products(s[0], desc_q, desc_k + stage_step(stage));  // S = Q K(t)^T
    cp::wgmma_commit();
    pv_products(st.o[0], p[0], desc_v + stage_step(prev));  // O += P(t-1) V(t-1)
    cp::wgmma_commit();
    cp::named_arrive(other_turn, kConsumerThreads);
    cp::wgmma_wait<1>();  // groups complete in order: S is done
    fence_operands(s[0]);
    RowFactors alphas;
    const bool seen = scores_tile(it, alphas);
    cp::mbar_arrive(bars.k_free(stage));  // its hole and loadable bytes are read
    cp::wgmma_wait<0>();
    fence_operands(st.o[0]);
    fence_operands(p[0]);
    cp::mbar_arrive(bars.v_free(prev));
    finish_tile(seen, alphas);
#else
    pv_products(st.o[0], p[0], desc_v + stage_step(prev));  // O += P(t-1) V(t-1)
    qk_products(s[0], desc_q, desc_k + stage_step(stage));  // S = Q K(t)^T
    cp::wgmma_commit();
    cp::named_arrive(other_turn, kConsumerThreads);
    cp::wgmma_wait<0>();
    fence_operands(st.o[0]);
    fence_operands(p[0]);
    fence_operands(s[0]);
    cp::mbar_arrive(bars.v_free(prev));
    softmax_tile(it);
#endif
  }
  if (TRACE && ct == 0) WS_STAMP(7, cp::global_ns());
  // Q is read no more: the producer may load the next task's.
  if (Tr::kPersistent) cp::mbar_arrive(bars.q_free());
  // The last tile's P V, in turn.  Warpgroup 1 gives no turn after it: warpgroup 0 takes none.
  const int last = (g0 + t.num_tiles - 1) % Tr::kStages;
  cp::mbar_wait(bars.v_full(last), round_parity(g0 + t.num_tiles - 1));
  cp::fence_proxy_async();
  cp::named_sync(my_turn, kConsumerThreads);
  fence_operands(st.o[0]);
  fence_operands(p[0]);
  cp::wgmma_fence();
  pv_products(st.o[0], p[0], desc_v + stage_step(last));
  cp::wgmma_commit();
  if (group == 0) cp::named_arrive(other_turn, kConsumerThreads);
  cp::wgmma_wait<0>();
  fence_operands(st.o[0]);
  if (Tr::kPersistent) cp::mbar_arrive(bars.v_free(last));  // the next task's tiles reuse the slot
  if (TRACE && ct == 0) WS_STAMP(8, cp::global_ns());

  if (STAGED_STORE && !Tr::kPersistent)
    store_output_staged(st, q_tile, t.out_head, t.out_row, lse, t.lse_base, t.q_start, m0, ct, length_q, total_q,
                        t.scale_log2);
  else if (row0 < length_q)
    store_output(st, t.out_head, t.out_row, lse, t.lse_base, t.q_start, row0, length_q, total_q, t.scale_log2, lane);
  if (TRACE && (ct & 127) == 0) WS_STAMP(ct == 0 ? 9 : 10, cp::global_ns());
}


#if PERSISTENT
// The tasks of a persistent launch and the order the CTAs take them in: sequence by sequence, kv
// head by kv head (a "column": the query heads of one kv head, all their query tiles), so the
// tasks running at once read the same keys, which then stay in L2 (the level-by-level order of
// the first version read each sequence's keys again per query tile: NOTES_varlen.md, v10).  In
// a column the query tiles alternate long and short (under causal masking: the last, the first,
// the second last, ...), the query heads of one tile side by side.  Task c goes to CTA c % G in
// even rounds (c / G) and to CTA G - 1 - c % G in odd ones, so each CTA's share of long and
// short tasks evens out.  The producer's warps find each task from the tasks per sequence that
// the CTA staged in shared memory (a prefix sum: a binary search finds the sequence) and hand it
// to the consumers with its Q.
// A task of the list, for task_at: its lane offsets for `thread`, which also writes empty rows
// with the others of `threads` (none when 0).
struct ListTask {
  static constexpr bool kOwnThread = false;
  int tile, head_index, sequence, thread_index, thread_count;
  __device__ __forceinline__ int m_block() const { return tile; }
  __device__ __forceinline__ int head() const { return head_index; }
  __device__ __forceinline__ int seq() const { return sequence; }
  __device__ __forceinline__ int lane_thread() const { return thread_index; }
  __device__ __forceinline__ int thread() const { return thread_index; }
  __device__ __forceinline__ int threads() const { return thread_count; }
};

struct TaskList {
  const int* prefix;  // tasks of the sequences before s, s = 0 .. batch (in shared memory)
  int batch, heads, group, round;

  // The CTA's next task (query tile, head, sequence, 1): false past its last.
  __device__ __forceinline__ bool next(int4& task) {
    const int c = round * gridDim.x + ((round & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
    ++round;
    if (c >= prefix[batch]) return false;
    int lo = 0, hi = batch;  // prefix[lo] <= c < prefix[hi]
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (prefix[mid] <= c) lo = mid; else hi = mid;
    }
    const int tiles = (prefix[lo + 1] - prefix[lo]) / heads, column = tiles * group;
    const int r = c - prefix[lo], kv = r / column, q = r - kv * column, j = q / group;
    task = make_int4((j & 1) ? j >> 1 : tiles - 1 - (j >> 1), kv * group + (q - j * group), lo, 1);
    return true;
  }
};
#endif

}  // namespace varlen

// TMA = 1: the K and V tensor maps come first, by value (their copies read them where they lie).
#if TMA
#define VARLEN_TMA_PARAM const __grid_constant__ cp::TmaMaps tma_maps,
#else
#define VARLEN_TMA_PARAM
#endif

extern "C" __global__ void __launch_bounds__(varlen::Tr::kCtaThreads, 1) varlen_fwd_wgmma(VARLEN_TMA_PARAM VARLEN_FWD_PARAMS) {
  using namespace varlen;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 raw = cp::smem_address(smem_raw);
  const u32 s_q = (raw + 1023u) & ~1023u;
  const u32 s_kv = s_q + Tr::kQBytes;
  const Barriers bars{s_kv + 2 * Tr::kStages * Tr::kKVBytes};
  unsigned char* holes = smem_raw + (bars.base - raw) + Tr::kBarrierBytes;
  unsigned char* s_loadable = holes + 4 * Tr::kStages;
#if PERSISTENT
  // Each sequence's tasks (its query tiles, at most the grid's max_seqlen_q covers, times the
  // heads), summed into a prefix, and the task of the Q in shared memory: (query tile, head,
  // sequence, 1), or (..., 0) past the CTA's last.
  int* s_prefix = reinterpret_cast<int*>(s_loadable + Tr::kStages * Tr::kBlockN);
  int* s_task = reinterpret_cast<int*>(holes - 16);
  if (threadIdx.x == 0) {
    bars.init();
    s_prefix[0] = 0;
  }
  const int max_tiles = max_seqlen_q / Tr::kBlockM + (max_seqlen_q % Tr::kBlockM != 0);
  for (int seq = threadIdx.x; seq < batch; seq += Tr::kCtaThreads) {
    // A length that does not fit an int wraps to negative: an empty sequence, as in task_at.
    const int length = static_cast<int>(static_cast<unsigned>(cu_seqlens_q[seq + 1]) -
                                        static_cast<unsigned>(cu_seqlens_q[seq]));
    s_prefix[seq + 1] =
        (length <= 0 ? 0 : min(length / Tr::kBlockM + (length % Tr::kBlockM != 0), max_tiles)) * num_heads;
  }
  __syncthreads();
  if (threadIdx.x < 32) {  // warp 0 sums: each lane a run of sequences, the runs' sums scanned
    const int lane = threadIdx.x, per = (batch + 31) / 32;
    const int first = 1 + lane * per, last = min(first + per, batch + 1);
    int sum = 0;
    for (int i = first; i < last; ++i) sum += s_prefix[i];
    int before = sum;
#pragma unroll
    for (int step = 1; step < 32; step <<= 1) {
      const int up = __shfl_up_sync(0xffffffffu, before, step);
      if (lane >= step) before += up;
    }
    before -= sum;
    for (int i = first; i < last; ++i) {
      before += s_prefix[i];
      s_prefix[i] = before;
    }
  }
  __syncthreads();
  Task t;
  if (__shfl_sync(0xffffffffu, threadIdx.x >> 7, 0) == 0) {  // warpgroup 0 (uniform per warp)
    cp::registers_decrease<kProducerRegisters>();
    TaskList list{s_prefix, batch, num_heads, group_size, 0};
    int4 task;
    int g = 0, n = 0;
    while (list.next(task)) {
      // A task whose rows see no key has its zeros written here.
      // The thread's index read afresh for each task: what task_at derives from it, kept across
      // the task loop, would outnumber the producer's registers and spill.
      unsigned tid;
      asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
      if (!task_at(t, ListTask{task.x, task.y, task.z, static_cast<int>(tid), 128}, VARLEN_FWD_ARGS)) continue;
      produce(t, s_q, s_kv, bars, holes, s_loadable, q_row, total_q, g, n, s_task, task);
      g += t.num_tiles;
      ++n;
    }
    // No more tasks: Q "loaded" with a task whose last number is 0.
    if (n > 0) cp::mbar_wait(bars.q_free(), static_cast<u32>((n - 1) & 1));
    if (threadIdx.x == 0) {
      s_task[3] = 0;
      cp::mbar_arrive(bars.q_full());
    }
    cp::cp_async_mbar_arrive(bars.q_full());
    cp::cp_async_wait<0>();  // no copy may still target shared memory when the thread exits
  } else {
    cp::registers_increase<kConsumerRegisters>();
    const int ct = threadIdx.x - 128;
    for (int g = 0, n = 0;; g += t.num_tiles, ++n) {
      cp::mbar_wait(bars.q_full(), static_cast<u32>(n & 1));
      if (s_task[3] == 0) break;
      task_at(t, ListTask{s_task[0], s_task[1], s_task[2], 0, 0}, VARLEN_FWD_ARGS);  // one with keys (produced)
      consume(t, s_q, s_kv, bars, holes, s_loadable, ct, lse, total_q, softmax_scale, softcap, window_left,
              window_right, g, n);
    }
  }
  // Each sequence checked once, by warp 0 of one CTA.
  if (errors != nullptr)
    for (int s = blockIdx.x; s < batch; s += gridDim.x)
      check_sequence<true>(cu_seqlens_q, cu_seqlens_k, block_table, table_width, block_shift, total_q, kv_rows,
                           max_seqlen_q, errors, s);
#else
  if (threadIdx.x == 0) bars.init();
#if TRACE
  if (threadIdx.x == 0) {
    s_trace_row = trace + 16ull * (blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
    WS_STAMP(0, cp::global_ns());
    WS_STAMP(1, cp::sm_id());
  }
#endif
  __syncthreads();

  Task t;
  if (make_task(t, VARLEN_FWD_ARGS)) {  // the CTA's work; then its one exit (check_sequence says why)
    if (__shfl_sync(0xffffffffu, threadIdx.x >> 7, 0) == 0) {  // warpgroup 0 (uniform per warp)
      cp::registers_decrease<kProducerRegisters>();
      if (TRACE && threadIdx.x == 0) {
        WS_STAMP(2, cp::global_ns());
        WS_STAMP(11, t.num_tiles);
      }
#if TMA
      produce_tma(t, s_q, s_kv, bars, holes, s_loadable, q_row, total_q, tma_maps, blockIdx.y / group_size);
#else
      produce(t, s_q, s_kv, bars, holes, s_loadable, q_row, total_q, 0, 0);
#endif
      cp::cp_async_wait<0>();  // no copy may still target shared memory when the thread exits
    } else {
      cp::registers_increase<kConsumerRegisters>();
      consume(t, s_q, s_kv, bars, holes, s_loadable, threadIdx.x - 128, lse, total_q, softmax_scale, softcap,
              window_left, window_right, 0, 0, smem_raw + (s_q - raw));
    }
  }
  check_inputs(VARLEN_FWD_ARGS);
#endif
}
