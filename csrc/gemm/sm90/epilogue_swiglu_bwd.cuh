// FC2 dgrad's epilogue (GemmEpilogue::kSwiGLUBackward): the accumulator is da (unweighted) for activation columns
// [n_tile * 256, + 256); per 64-column quarter the gate / up pre-activations are loaded into staging boxes 0 / 1
// (coalesced cp.async, one memory round trip per quarter), overwritten in place by their gradients
// dh = w * da * dswiglu, box 2 takes aw = w * a, and <da, a> per row goes to out_dot.
#pragma once

#include "activation.cuh"
#include "pipeline.cuh"

namespace primemoe::sm90 {

// Quarter q's gate / up pre-activations of the warpgroup's 64 rows into boxes 0 / 1 (64 rows x 8 chunks of 16 bytes
// per box, 128 threads), all in flight at once; zeros past the routed rows.
__device__ __forceinline__ void swiglu_bwd_load_quarter(const GroupedGemmArgs& args, uint32_t slots, int wtid,
                                                        const Tile& tile, int32_t row0, bool routed, int q) {
  const int64_t n = args.n;
  const auto* in_h = static_cast<const __nv_bfloat16*>(args.in_h);
  const int32_t col0 = tile.n_tile * kGemmTileN + 64 * q;
#pragma unroll 1
  for (int v = 0; v < 4; ++v) {
    const int idx = wtid + 128 * v;
    const int r = idx / 8;
    const int chunk = idx % 8;
    const int64_t grow = int64_t(row0) + r;
    const bool real = routed && grow < args.num_rows;
    const __nv_bfloat16* src = real ? in_h + grow * 2 * n + col0 + chunk * 8 : in_h;
    const uint32_t dst = slots + swizzled(r, chunk * 8);
    cp_async_16(dst, src, real ? 16 : 0);
    cp_async_16(dst + kBoxBytes, real ? src + n : in_h, real ? 16 : 0);
  }
}

// Quarter 0's loads were issued during the mainloop (after the previous tile's stores read the boxes).
template <typename Acc>
__device__ __forceinline__ void swiglu_bwd_epilogue(const GemmParams& p, Acc& acc, uint32_t slots, int wg, int wtid,
                                                    int frag_row, int frag_col, const Tile& tile, int32_t row0,
                                                    bool routed, const float (&row_scale)[2]) {
  const GroupedGemmArgs& args = p.args;
  const int64_t n = args.n;
  constexpr int kHalf = 64;
  float dot[2] = {0.0f, 0.0f};
  CUTE_UNROLL
  for (int q = 0; q < 4; ++q) {
    const int32_t col0 = tile.n_tile * kGemmTileN + 64 * q;
    if (q > 0) {
      staging_acquire(wg, wtid);
      swiglu_bwd_load_quarter(args, slots, wtid, tile, row0, routed, q);
    }
    cp_async_wait_all();
    wg_sync(wg);
    // This quarter is accumulator values [32 q, +32): column groups of 8.
    CUTE_UNROLL
    for (int i = 32 * (q % 2); i < 32 * (q % 2) + 32; i += 2) {
      const float da0 = acc(kHalf * (q / 2) + i);
      const float da1 = acc(kHalf * (q / 2) + i + 1);
      const int row_half = (i >> 1) & 1;  // a thread holds two rows, 8 apart: value mode (2 cols, 2 rows, n/8)
      const int r = frag_row + 8 * row_half;
      const int c = (frag_col + 8 * (i >> 2)) % 64;
      const float2 g = __bfloat1622float2(get_pair(slots, 0, r, c));
      const float2 u = __bfloat1622float2(get_pair(slots, 1, r, c));
      const float s0 = __fdividef(1.0f, 1.0f + exp_neg(g.x));
      const float s1 = __fdividef(1.0f, 1.0f + exp_neg(g.y));
      const float2 a = __bfloat1622float2(pack(g.x * s0 * u.x, g.y * s1 * u.y));
      dot[row_half] += da0 * a.x + da1 * a.y;
      const float dw0 = da0 * row_scale[row_half];
      const float dw1 = da1 * row_scale[row_half];
      put_pair(slots, 0, r, c,
               pack(dw0 * u.x * s0 * (1.0f + g.x * (1.0f - s0)), dw1 * u.y * s1 * (1.0f + g.y * (1.0f - s1))));
      put_pair(slots, 1, r, c, pack(dw0 * g.x * s0, dw1 * g.y * s1));
      put_pair(slots, 2, r, c, pack(row_scale[row_half] * a.x, row_scale[row_half] * a.y));
    }
    staging_release(wg);
    if (wtid == 0) {
      tma_store(&p.tma_out2, slots, col0, row0);
      tma_store(&p.tma_out2, slots + kBoxBytes, int32_t(n) + col0, row0);
      tma_store(&p.tma_out, slots + 2 * kBoxBytes, col0, row0);
      store_commit();
    }
  }
  // The four threads of a quad share its rows; a fixed butterfly keeps the sum deterministic.
  CUTE_UNROLL
  for (int h = 0; h < 2; ++h) {
    dot[h] += __shfl_xor_sync(0xffffffffu, dot[h], 1);
    dot[h] += __shfl_xor_sync(0xffffffffu, dot[h], 2);
    const int64_t r = int64_t(row0) + frag_row + 8 * h;
    if ((threadIdx.x & 3) == 0 && r < args.num_rows) args.out_dot[r * (n / kGemmTileN) + tile.n_tile] = dot[h];
  }
}

}  // namespace primemoe::sm90
