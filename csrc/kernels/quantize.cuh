// Blockwise FP8 (E4M3) quantisation of bf16 tensors, DESIGN.md section 2: one fp32 scale per tile of 128
// values, 1x128 tiles along the contiguous dimension (activations, gradients), 128x1 tiles along the rows
// with a transposed output (the wgrad operands, token dimension contiguous), 128x128 blocks (weights).
//
// Per tile (python/primemoe/fp8.py is the same rule in PyTorch; the kernels equal it bitwise):
//   amax = max |t| over the tile (fp32)
//   m    = amax == 0 ? 1 : min(448 / amax, 2^126) (IEEE fp32 division; the cap keeps tiles of tiny values,
//          amax < 448 / 2^126 ~ 5.3e-36, finite with a normal scale); with pow2, m rounded down to a power of
//          two (mantissa cleared), so the stored scale is amax / 448 rounded up to a power of two
//   q    = e4m3(clamp(t * m, -448, 448)), fp32 multiply, round to nearest even
//   s    = 1 / m, the dequantisation scale: t ~ q * s
// Non-finite inputs are outside the contract (here a NaN is ignored by amax; fp8.py's amax propagates it).
//
// One kernel launch per call, no host sync, nothing allocated: capturable in a CUDA graph; every output
// element is written (but those of the rows past rows_end, when given); the result does not depend on the grid
// (max is order-independent).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "bf16_vec.cuh"
#endif

namespace primemoe {

constexpr int kFp8Tile = 128;       // values per scale along a tile's long side
constexpr float kFp8E4M3Max = 448.0f;
constexpr float kFp8MaxMultiplier = 0x1p126f;  // fp8.M_MAX: its scale 2^-126 is a normal float

// q[r, c] = quantised x[r, c] with the scale of tile (r, c / 128): scale[r, c / 128], or with scale_mn_major
// scale[c / 128, r] (scale [cols / 128, rows], element (r, t) at scale[t * rows + r]). With rows_end, the rows
// r >= *rows_end (read on the device, clamped to [0, rows]) are left unwritten (q and scale).
struct Quantize1x128Args {
  const void* x;  // [rows, cols] bf16, 16-byte aligned
  void* q;        // [rows, cols] e4m3, 16-byte aligned
  float* scale;   // [rows, cols / 128], or [cols / 128, rows] with scale_mn_major
  int64_t rows;
  int64_t cols;   // a multiple of 128
  bool pow2;
  bool scale_mn_major;
  const int32_t* rows_end;  // null, or a device pointer to the routed row count (expert_offsets[E])
};

// q_t[c, r] = quantised x[r, c] with the scale of tile (r / 128, c): scale[c, r / 128], or with scale_mn_major
// scale[r / 128, c] (scale [rows / 128, cols]). With rows_end, the row tiles rt with rt * 128 >= *rows_end (read
// on the device) are left unwritten (their q_t columns and scales); a tile holding rows on both sides is written.
struct Quantize128x1Args {
  const void* x;  // [rows, cols] bf16, 16-byte aligned
  void* q_t;      // [cols, rows] e4m3, 16-byte aligned
  float* scale;   // [cols, rows / 128], or [rows / 128, cols] with scale_mn_major
  int64_t rows;   // a multiple of 128
  int64_t cols;   // a multiple of 8
  bool pow2;
  bool scale_mn_major;
  const int32_t* rows_end;  // null, or a device pointer to the routed row count (expert_offsets[E])
};

// q[r, c] = quantised w[r, c] with the scale of block (r / 128, c / 128): scale[r / 128, c / 128]. The rows
// are a weight's leading dimensions flattened ([E, N, K] -> [E * N, K]; N a multiple of 128, so no block
// straddles two experts and scale [E * N / 128, K / 128] is [E, N / 128, K / 128]).
struct Quantize128x128Args {
  const void* w;  // [rows, cols] bf16, 16-byte aligned
  void* q;        // [rows, cols] e4m3, 16-byte aligned
  float* scale;   // [rows / 128, cols / 128]
  int64_t rows;   // a multiple of 128
  int64_t cols;   // a multiple of 128
  bool pow2;
};

// cudaErrorInvalidValue for sizes outside the above; cudaSuccess without a launch for an empty tensor.
cudaError_t launch_quantize_1x128(const Quantize1x128Args& args, cudaStream_t stream);
cudaError_t launch_quantize_128x1(const Quantize128x1Args& args, cudaStream_t stream);
cudaError_t launch_quantize_128x128(const Quantize128x128Args& args, cudaStream_t stream);

#if defined(__CUDACC__)
// The per-tile rule in device code, for every kernel that quantises (these and fused GEMM epilogues).

// The quantisation multiplier of a tile whose largest magnitude is amax.
__device__ __forceinline__ float fp8_multiplier(float amax, bool pow2) {
  if (amax == 0.0f) return 1.0f;
  const float m = fminf(__fdiv_rn(kFp8E4M3Max, amax), kFp8MaxMultiplier);
  return pow2 ? __int_as_float(__float_as_int(m) & 0x7F800000) : m;
}

// The stored (dequantisation) scale of multiplier m.
__device__ __forceinline__ float fp8_scale(float m) { return __frcp_rn(m); }

// e4m3(clamp(a * m, -448, 448)) (low byte) and the same of b (high byte), round to nearest even. The
// conversion's satfinite is the clamp: it maps every finite value (and inf) past +-448 to +-448, NaN to NaN.
__device__ __forceinline__ uint32_t fp8x2_quantize(float a, float b, float m) {
  return __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(a, m), __fmul_rn(b, m)), __NV_SATFINITE, __NV_E4M3);
}

// max(acc, |v|) elementwise over the 4 bf16 pairs of a 16-byte vector, in bf16: exact (abs and max only pick values).
__device__ __forceinline__ __nv_bfloat162 bf16x8_abs_max2(const uint4& v, __nv_bfloat162 acc) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < kBf16Vec / 2; ++i) acc = __hmax2(acc, __habs2(h[i]));
  return acc;
}

// max |v| over the 8 bf16 values of a 16-byte vector, in fp32.
__device__ __forceinline__ float bf16x8_abs_max(const uint4& v) {
  const __nv_bfloat162 m = bf16x8_abs_max2(v, __float2bfloat162_rn(0.0f));
  return fmaxf(__low2float(m), __high2float(m));
}

// The 8 bf16 values of a 16-byte vector quantised with multiplier m: 8 e4m3 bytes in memory order.
__device__ __forceinline__ uint2 fp8x8_quantize(const uint4& v, float m) {
  float f[kBf16Vec];
  unpack(v, f);
  return make_uint2(fp8x2_quantize(f[0], f[1], m) | fp8x2_quantize(f[2], f[3], m) << 16,
                    fp8x2_quantize(f[4], f[5], m) | fp8x2_quantize(f[6], f[7], m) << 16);
}
#endif

}  // namespace primemoe
