// Paged KV-cache addressing: the one place that says where a key of a sequence lives.
//
// A paged cache [num_blocks, block_size, Hkv, D] holds num_blocks blocks of block_size slots (token
// rows), block_size = 1 << block_shift: a power of two (the host checks it), so that a position
// splits into column and offset without a division.  Key (position) pos of a sequence lives in
// block table[column(pos)] at offset(pos) (Blocks), that is in slot
//   table[pos >> block_shift] * block_size + (pos & (block_size - 1)),
// and a block id outside [0, num_blocks) (-1 for an unallocated column, or any bad value) names no
// block: the kernels read nothing there, write nothing, and mask the keys ("holes").
//
// decode.cu, varlen_common.cuh and kv_write.cu address their caches through these helpers only.
#pragma once

namespace paged {

// The block size of one cache, 1 << shift, and the position arithmetic that depends on it.
struct Blocks {
  int shift;  // log2(block_size)
  int mask;   // block_size - 1

  Blocks() = default;
  __device__ __forceinline__ explicit Blocks(int block_shift) : shift(block_shift), mask((1 << block_shift) - 1) {}

  // The block-table column of position pos (pos >= 0).
  __device__ __forceinline__ int column(int pos) const { return pos >> shift; }
  // The offset of position pos inside its block.
  __device__ __forceinline__ int offset(int pos) const { return pos & mask; }
  // The slot of position pos in block `block` (a valid block id: is_block), in 32 bits: for a
  // cache of fewer than 2^31 slots (varlen's host checks it).
  __device__ __forceinline__ unsigned slot(int block, int pos) const {
    return static_cast<unsigned>((block << shift) | offset(pos));
  }
  // The same in 64 bits, for any cache.
  __device__ __forceinline__ long long slot_wide(int block, int pos) const {
    return static_cast<long long>(block) * (mask + 1) + offset(pos);
  }
  // The table columns that hold positions [0, keys) (keys >= 0; 0 for none).
  __device__ __forceinline__ long long columns(long long keys) const { return ((keys - 1) >> shift) + 1; }
  // The positions that `cols` table columns hold.
  __device__ __forceinline__ long long positions(long long cols) const { return cols << shift; }
};

// Whether `id`, read from a block table, names a block of a cache of num_blocks blocks.  One
// unsigned compare: a negative id is out of range too.
__device__ __forceinline__ bool is_block(int id, int num_blocks) {
  return static_cast<unsigned>(id) < static_cast<unsigned>(num_blocks);
}

// Whether `slot` (a resolved slot, e.g. from a slot mapping) lies inside a cache of num_slots slots.
__device__ __forceinline__ bool is_slot(long long slot, long long num_slots) { return slot >= 0 && slot < num_slots; }

}  // namespace paged
