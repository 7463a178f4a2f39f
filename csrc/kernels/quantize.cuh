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
// element is written; the result does not depend on the grid (max is order-independent).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#if defined(__CUDACC__)
#include <cuda_fp8.h>
#endif

namespace primemoe {

constexpr int kFp8Tile = 128;       // values per scale along a tile's long side
constexpr float kFp8E4M3Max = 448.0f;
constexpr float kFp8MaxMultiplier = 0x1p126f;  // fp8.M_MAX: its scale 2^-126 is a normal float

// q[r, c] = quantised x[r, c] with the scale of tile (r, c / 128): scale[r, c / 128].
struct Quantize1x128Args {
  const void* x;  // [rows, cols] bf16, 16-byte aligned
  void* q;        // [rows, cols] e4m3, 16-byte aligned
  float* scale;   // [rows, cols / 128]
  int64_t rows;
  int64_t cols;   // a multiple of 128
  bool pow2;
};

// q_t[c, r] = quantised x[r, c] with the scale of tile (r / 128, c): scale[c, r / 128].
struct Quantize128x1Args {
  const void* x;  // [rows, cols] bf16, 16-byte aligned
  void* q_t;      // [cols, rows] e4m3, 16-byte aligned
  float* scale;   // [cols, rows / 128]
  int64_t rows;   // a multiple of 128
  int64_t cols;   // a multiple of 8
  bool pow2;
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
#endif

}  // namespace primemoe
