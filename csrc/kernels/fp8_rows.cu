#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <climits>

#include "bf16_vec.cuh"
#include "fp8_rows.cuh"
#include "quantize.cuh"

namespace primemoe {
namespace {

// A half-warp per row: lane `part` of the 16 holds values [8 * part, 8 * part + 8) of each 128-column tile (one
// 16-byte bf16 vector), so a tile's amax is 4 xor-shuffles inside the half-warp and a warp loads 2 x 256
// contiguous bytes per access. The half-warps walk their row's tiles kUnroll at a time, all those loads in
// flight before any math; the rows of a block are consecutive, so its 16 scales of one tile column are 64
// contiguous bytes of the MN-major scale.
constexpr int kVec = kBf16Vec;                       // 8 values per lane and tile
constexpr int kRowLanes = kFp8Tile / kVec;           // 16
constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / kRowLanes;  // 16
constexpr int kMinBlocks = 3;  // 24 warps per SM: at most 85 registers (4 would spill)
constexpr int kQuantUnroll = 4;                      // tiles in flight per row: 4 x 32 bytes per lane
constexpr int kBackwardUnroll = 2;                   // 2 x 64 bytes per lane
constexpr unsigned kFullMask = 0xffffffffu;
static_assert(kRowLanes == 16, "a row is half a warp");

// The routed row count *end (read on the device) clamped to [0, rows]; rows without a bound.
__device__ __forceinline__ int64_t live_rows(const int32_t* end, int64_t rows) {
  return end == nullptr ? rows : max(int64_t(0), min(int64_t(*end), rows));
}

// The largest amax of the half-warp's 16 lanes (a row's 128-value tile). Every lane of the warp must call it.
__device__ __forceinline__ float tile_amax(float amax) {
#pragma unroll
  for (int off = kRowLanes / 2; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, off));
  return amax;
}

// The sum over the half-warp's 16 lanes, in a fixed butterfly order.
__device__ __forceinline__ float row_sum(float v) {
#pragma unroll
  for (int off = kRowLanes / 2; off > 0; off /= 2) v = __fadd_rn(v, __shfl_xor_sync(kFullMask, v, off));
  return v;
}

// The SwiGLU pieces of one gate value g (fp32 from bf16), IEEE roundings as torch's F.silu and sigmoid:
// e = exp(-g), silu = g / (1 + e), sig = 1 / (1 + e).
struct Swiglu {
  float silu, sig;
};
__device__ __forceinline__ Swiglu swiglu_terms(float g) {
  const float den = __fadd_rn(1.0f, expf(-g));
  return {__fdiv_rn(g, den), __frcp_rn(den)};
}

// a = bf16(silu(g) * u) in fp32, the value both kernels use.
__device__ __forceinline__ float swiglu_value(float silu, float u) {
  return __bfloat162float(__float2bfloat16_rn(__fmul_rn(silu, u)));
}

// ---------------------------------------------------------------- forward: a = swiglu(h), quantised 1x128

__global__ void __launch_bounds__(kThreads, kMinBlocks) fp8_swiglu_quant_kernel(Fp8SwigluQuantArgs p) {
  const int64_t rows = live_rows(p.rows_end, p.rows);
  const int64_t tiles = p.inter / kFp8Tile;  // a's tiles per row
  const int64_t h_vecs = 2 * tiles * kRowLanes;  // 16-byte vectors per row of h
  const int part = threadIdx.x % kRowLanes;
  const uint4* __restrict__ h = static_cast<const uint4*>(p.h);
  uint2* __restrict__ q = static_cast<uint2*>(p.a_q);
  // The loop bound is the warp's first row (warp-uniform): both half-warps run every shuffle, the one past the
  // last row with its loads and stores switched off.
  for (int64_t first = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32 * 2; first < rows;
       first += int64_t(gridDim.x) * kRowsPerBlock) {
    const int64_t row = first + threadIdx.x / kRowLanes % 2;
    const bool live = row < rows;
    const uint4* __restrict__ gate = h + row * h_vecs + part;
    const uint4* __restrict__ up = gate + tiles * kRowLanes;
    uint2* __restrict__ q_row = q + row * tiles * kRowLanes + part;
    for (int64_t t0 = 0; t0 < tiles; t0 += kQuantUnroll) {
      uint4 g[kQuantUnroll], u[kQuantUnroll];
#pragma unroll
      for (int i = 0; i < kQuantUnroll; ++i) {
        const bool on = live && t0 + i < tiles;
        g[i] = on ? __ldg(gate + (t0 + i) * kRowLanes) : make_uint4(0, 0, 0, 0);
        u[i] = on ? __ldg(up + (t0 + i) * kRowLanes) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int i = 0; i < kQuantUnroll; ++i) {
        const int64_t t = t0 + i;
        if (t >= tiles) break;  // uniform over the warp
        float gf[kVec], uf[kVec], af[kVec];
        unpack(g[i], gf);
        unpack(u[i], uf);
#pragma unroll
        for (int j = 0; j < kVec; ++j) af[j] = swiglu_value(swiglu_terms(gf[j]).silu, uf[j]);
        const uint4 a = pack(af);  // exact: af are bf16 values
        const float m = fp8_multiplier(tile_amax(bf16x8_abs_max(a)), p.pow2);
        if (live) {
          q_row[t * kRowLanes] = fp8x8_quantize(a, m);
          if (part == 0) p.a_scale[t * p.rows + row] = fp8_scale(m);
        }
      }
    }
  }
}

// ---------------------------------------------------------------- backward: dh, its 1x128 quantisation, aw, dot

__global__ void __launch_bounds__(kThreads, kMinBlocks) fp8_swiglu_backward_kernel(Fp8SwigluBackwardArgs p) {
  const int64_t rows = live_rows(p.rows_end, p.rows);
  const int64_t tiles = p.inter / kFp8Tile;  // tiles of I per row; dh has 2 * tiles
  const int64_t h_vecs = 2 * tiles * kRowLanes;
  const int part = threadIdx.x % kRowLanes;
  const uint4* __restrict__ h = static_cast<const uint4*>(p.h);
  const float4* __restrict__ da = reinterpret_cast<const float4*>(p.da);
  uint4* __restrict__ dh = static_cast<uint4*>(p.dh);
  uint2* __restrict__ dh_q = static_cast<uint2*>(p.dh_q);
  uint4* __restrict__ aw = static_cast<uint4*>(p.aw);
  for (int64_t first = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32 * 2; first < rows;
       first += int64_t(gridDim.x) * kRowsPerBlock) {
    const int64_t row = first + threadIdx.x / kRowLanes % 2;
    const bool live = row < rows;
    const float w = live ? __ldg(p.row_weight + row) : 0.0f;
    const int64_t h_at = row * h_vecs + part;                 // gate vector of tile 0; up at + tiles * 16
    const int64_t da_at = (row * tiles * kRowLanes + part) * 2;  // float4s: 2 per lane and tile
    const int64_t a_at = row * tiles * kRowLanes + part;       // 8-value vectors of [rows, I]
    float dot = 0.0f;
    for (int64_t t0 = 0; t0 < tiles; t0 += kBackwardUnroll) {
      uint4 g[kBackwardUnroll], u[kBackwardUnroll];
      float4 d0[kBackwardUnroll], d1[kBackwardUnroll];
#pragma unroll
      for (int i = 0; i < kBackwardUnroll; ++i) {
        const int64_t t = t0 + i;
        const bool on = live && t < tiles;
        const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        g[i] = on ? __ldg(h + h_at + t * kRowLanes) : make_uint4(0, 0, 0, 0);
        u[i] = on ? __ldg(h + h_at + (tiles + t) * kRowLanes) : make_uint4(0, 0, 0, 0);
        d0[i] = on ? __ldg(da + da_at + t * kRowLanes * 2) : zero4;
        d1[i] = on ? __ldg(da + da_at + t * kRowLanes * 2 + 1) : zero4;
      }
#pragma unroll
      for (int i = 0; i < kBackwardUnroll; ++i) {
        const int64_t t = t0 + i;
        if (t >= tiles) break;  // uniform over the warp
        float gf[kVec], uf[kVec], dg[kVec], du[kVec], awf[kVec];
        const float df[kVec] = {d0[i].x, d0[i].y, d0[i].z, d0[i].w, d1[i].x, d1[i].y, d1[i].z, d1[i].w};
        unpack(g[i], gf);
        unpack(u[i], uf);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const Swiglu s = swiglu_terms(gf[j]);
          const float a = swiglu_value(s.silu, uf[j]);
          dot = fmaf(df[j], a, dot);
          const float dw = __fmul_rn(df[j], w);
          // ((dw * u) * sig) * (1 + g * (1 - sig)) and (dw * g) * sig, each operation rounded (no FMA).
          const float slope = __fadd_rn(1.0f, __fmul_rn(gf[j], __fsub_rn(1.0f, s.sig)));
          dg[j] = __fmul_rn(__fmul_rn(__fmul_rn(dw, uf[j]), s.sig), slope);
          du[j] = __fmul_rn(__fmul_rn(dw, gf[j]), s.sig);
          awf[j] = __fmul_rn(w, a);
        }
        const uint4 dg_v = pack(dg), du_v = pack(du), aw_v = pack(awf);
        // The two tiles of dh: t (gate half) and tiles + t (up half), quantised from the bf16 values.
        const float mg = fp8_multiplier(tile_amax(bf16x8_abs_max(dg_v)), p.pow2);
        const float mu = fp8_multiplier(tile_amax(bf16x8_abs_max(du_v)), p.pow2);
        if (live) {
          dh[h_at + t * kRowLanes] = dg_v;
          dh[h_at + (tiles + t) * kRowLanes] = du_v;
          dh_q[h_at + t * kRowLanes] = fp8x8_quantize(dg_v, mg);
          dh_q[h_at + (tiles + t) * kRowLanes] = fp8x8_quantize(du_v, mu);
          aw[a_at + t * kRowLanes] = aw_v;
          if (part == 0) {
            p.dh_scale[t * p.rows + row] = fp8_scale(mg);
            p.dh_scale[(tiles + t) * p.rows + row] = fp8_scale(mu);
          }
        }
      }
    }
    dot = row_sum(dot);
    if (live && part == 0) p.dot[row] = dot;
  }
}

// At most INT_MAX blocks of threads; the kernels loop past that.
int grid_of(int64_t rows) {
  return static_cast<int>(std::min<int64_t>((rows + kRowsPerBlock - 1) / kRowsPerBlock, INT_MAX));
}

bool valid(int64_t rows, int64_t inter) { return rows >= 0 && inter >= 0 && inter % kFp8Tile == 0; }

}  // namespace

cudaError_t launch_fp8_swiglu_quant(const Fp8SwigluQuantArgs& a, cudaStream_t stream) {
  if (!valid(a.rows, a.inter)) return cudaErrorInvalidValue;
  if (a.rows == 0 || a.inter == 0) return cudaSuccess;
  fp8_swiglu_quant_kernel<<<grid_of(a.rows), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_fp8_swiglu_backward(const Fp8SwigluBackwardArgs& a, cudaStream_t stream) {
  if (!valid(a.rows, a.inter)) return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaSuccess;  // with inter == 0 the kernel still writes dot = 0
  fp8_swiglu_backward_kernel<<<grid_of(a.rows), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace primemoe
