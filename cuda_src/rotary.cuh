// Rotary embedding for decode.cu (ROTARY=1): FlashAttention-2's rotation of q and the new keys,
// on the rows of a cp::SmemTile in shared memory and on new key rows in global memory.  The
// including file defines, in namespace decode, the element type T and the tile layout Tile.
//
// Each product and each sum is rounded on its own (no FMA contraction, as NumPy's float32
// arithmetic in the reference): the fused append and the K stage rotate the same key, and the
// cache must get the bits the attended key had.  A rotation moves whole 16-byte chunks of 8
// elements: interleaved (GPT-J) pairs sit in one chunk, NeoX pairs (i, i + rotary_dim / 2) in
// chunks c and c + rotary_dim / 16.  rotary_cos/rotary_sin [seqlen_ro, rotary_dim / 2] are read
// 2 bytes at a time: any C-contiguous array will do.
#pragma once

namespace decode {

__device__ __forceinline__ float2 to_float2(u32 w, __half) {
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
}
__device__ __forceinline__ float2 to_float2(u32 w, __nv_bfloat16) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
}
// (x, y) -> (x cos - y sin, x sin + y cos).
__device__ __forceinline__ void rotate(float& x, float& y, float c, float s) {
  const float xr = __fsub_rn(__fmul_rn(x, c), __fmul_rn(y, s));
  y = __fadd_rn(__fmul_rn(x, s), __fmul_rn(y, c));
  x = xr;
}
// 2 * kWords consecutive elements of a cos/sin row, packed in pairs like a chunk's words.
template <int kWords>
__device__ __forceinline__ void load_pairs(const T* row, u32 (&w)[kWords]) {
  const unsigned short* h = reinterpret_cast<const unsigned short*>(row);
#pragma unroll
  for (int k = 0; k < kWords; ++k)
    w[k] = static_cast<u32>(__ldg(h + 2 * k)) | (static_cast<u32>(__ldg(h + 2 * k + 1)) << 16);
}
// Interleaved (GPT-J): chunk u holds pairs 4u..4u+3 as elements (2i, 2i + 1); cw/sw: cos/sin[4u..4u+3].
__device__ __forceinline__ uint4 rotate_interleaved(uint4 v, const u32 (&cw)[2], const u32 (&sw)[2]) {
  u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 cf = to_float2(cw[k / 2], T()), sf = to_float2(sw[k / 2], T());
    float2 p = to_float2(w[k], T());
    rotate(p.x, p.y, k % 2 ? cf.y : cf.x, k % 2 ? sf.y : sf.x);
    w[k] = cp::from_float2(p.x, p.y, T());
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}
// NeoX: x = chunk u (elements i = 8u..8u+7), y = the chunk rotary_dim / 2 elements on; cw/sw: cos/sin[8u..8u+7].
__device__ __forceinline__ void rotate_neox(uint4& x, uint4& y, const u32 (&cw)[4], const u32 (&sw)[4]) {
  u32 xw[4] = {x.x, x.y, x.z, x.w}, yw[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float2 xf = to_float2(xw[k], T()), yf = to_float2(yw[k], T());
    const float2 cf = to_float2(cw[k], T()), sf = to_float2(sw[k], T());
    rotate(xf.x, yf.x, cf.x, sf.x);
    rotate(xf.y, yf.y, cf.y, sf.y);
    xw[k] = cp::from_float2(xf.x, xf.y, T());
    yw[k] = cp::from_float2(yf.x, yf.y, T());
  }
  x = make_uint4(xw[0], xw[1], xw[2], xw[3]);
  y = make_uint4(yw[0], yw[1], yw[2], yw[3]);
}

// Where the rotation of one row reads its cos/sin rows: rotary_cos/sin + position * (rotary_dim / 2).
struct Rotary {
  const T* cos;
  const T* sin;
  int dim;           // rotary_dim (> 0, a multiple of 16, <= head dim)
  int seqlen_ro;     // rows of cos/sin: a position from seqlen_ro on is left unrotated
  bool interleaved;
  // Work units of one row: a chunk of 4 pairs (interleaved), a pair of chunks (NeoX).
  __device__ __forceinline__ int units() const { return interleaved ? dim / 8 : dim / 16; }
  __device__ __forceinline__ long long row_at(long long position) const { return position * (dim / 2); }
};

// Unit `unit` of row `row` of a swizzled tile at `tile` (shared memory), at `position` (< seqlen_ro).
__device__ __forceinline__ void rotate_tile_unit(const Rotary& ro, unsigned char* tile, int row, int unit,
                                                 long long position) {
  const T* c = ro.cos + ro.row_at(position);
  const T* s = ro.sin + ro.row_at(position);
  if (ro.interleaved) {
    u32 cw[2], sw[2];
    load_pairs(c + 4 * unit, cw);
    load_pairs(s + 4 * unit, sw);
    uint4* p = reinterpret_cast<uint4*>(tile + Tile::offset(row, unit));
    *p = rotate_interleaved(*p, cw, sw);
  } else {
    u32 cw[4], sw[4];
    load_pairs(c + 8 * unit, cw);
    load_pairs(s + 8 * unit, sw);
    uint4* px = reinterpret_cast<uint4*>(tile + Tile::offset(row, unit));
    uint4* py = reinterpret_cast<uint4*>(tile + Tile::offset(row, unit + ro.dim / 16));
    uint4 x = *px, y = *py;
    rotate_neox(x, y, cw, sw);
    *px = x;
    *py = y;
  }
}

// Chunk `v` of a new key row `key` (global memory) after rotation at `position` (< seqlen_ro): the
// fused append's value, computed by the same arithmetic as rotate_tile_unit.
__device__ __forceinline__ cp::Vec8 rotated_chunk(const Rotary& ro, const cp::Vec8* key, int v, long long position) {
  const T* c = ro.cos + ro.row_at(position);
  const T* s = ro.sin + ro.row_at(position);
  cp::Vec8 out = key[v];
  if (ro.interleaved) {
    if (v < ro.dim / 8) {
      u32 cw[2], sw[2];
      load_pairs(c + 4 * v, cw);
      load_pairs(s + 4 * v, sw);
      out.raw = rotate_interleaved(out.raw, cw, sw);
    }
  } else {
    const int half = ro.dim / 16;  // chunks of one half of the rotated dims
    if (v < 2 * half) {
      const int unit = v < half ? v : v - half;
      u32 cw[4], sw[4];
      load_pairs(c + 8 * unit, cw);
      load_pairs(s + 8 * unit, sw);
      uint4 x = key[unit].raw, y = key[unit + half].raw;
      rotate_neox(x, y, cw, sw);
      out.raw = v < half ? x : y;
    }
  }
  return out;
}

}  // namespace decode
