// Blockwise-scaled FP8 (E4M3) expert GEMMs on Hopper (DESIGN.md section 2): one persistent, warp-specialised kernel
// family (csrc/gemm/sm90/fp8_kernel.cuh) over the routing layout's device-side expert offsets, fp32 accumulation
// promoted per 128-deep K block (each k-block's wgmma accumulate into a fresh register tile, which is then scaled by
// its two operand scales and added to the result: Hopper's FP8 tensor cores accumulate with a short mantissa).
//
//   kRows    out[r, n] = row_weight[r] * sum_k a[r, k] sa[k/128, r] * b[e(r), n, k] sb[e(r), n/128, k/128]
//            a [num_rows, k] (1x128 tiles, scales MN-major [k/128, num_rows]), b [E, n, k] (128x128 blocks)
//   kExperts out[e, m, n] = sum over expert e's rows r of a_t[m, r] sa[r/128, m] * b_t[n, r] sb[r/128, n]
//            a_t [m, num_rows], b_t [n, num_rows] (128x1 tiles along the rows, transposed; scales MN-major)
//
// Both operands K-major (what e4m3 wgmma reads). Tiles are 128 x 128, k-blocks 128 deep; kRows walks each expert's
// rows in 128-row blocks from its first row, any offsets (rows past an expert's end are computed but not stored;
// with offsets multiples of 128, as the layer's, every block is whole and leaves by TMA stores), kExperts each
// expert's rows in 128-row k-blocks from its first row (offsets must be multiples of 128: the scales' row blocks),
// up to its routed rows (expert_rows).
// Deterministic: every output element is one CTA's, in a fixed k order.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace primemoe {

constexpr int32_t kFp8TileM = 128;
constexpr int32_t kFp8TileN = 128;
constexpr int32_t kFp8TileK = 128;  // one scale block

enum class Fp8Schedule : int32_t { kRows = 0, kExperts = 1 };

struct Fp8GemmArgs {
  Fp8Schedule schedule;
  const void* a;         // e4m3, see above
  const float* a_scale;  // kRows [k/128, num_rows]; kExperts [num_rows/128, m]
  const void* b;         // e4m3
  const float* b_scale;  // kRows [E, n/128, k/128]; kExperts [num_rows/128, n]
  int64_t num_rows;      // rows of the row space (kExperts: a multiple of 128)
  int32_t m;             // kExperts: output rows per expert
  int32_t n;             // output columns
  int32_t k;             // kRows: reduction length
  int32_t num_experts;
  const int32_t* expert_offsets;  // [E + 1]
  const int32_t* expert_rows;     // kExperts, optional: routed rows per expert (k-blocks past them are skipped)
  const float* row_weight;        // kRows, optional: [num_rows]
  void* out;                      // kRows [num_rows, n]; kExperts [E, m, n]
  bool out_fp32;                  // else bf16
  bool accumulate;                // kExperts + out_fp32: out += the result (a weight's fp32 main gradient)
  int32_t num_sms;
};

// Whether the kernels cover this problem on this device (sm_90 built in, sizes tile-aligned, operands aligned).
bool fp8_gemm_supported(const Fp8GemmArgs& args, int device, const char** why);

cudaError_t launch_fp8_gemm(const Fp8GemmArgs& args, cudaStream_t stream);

// Loads both FP8 kernels on the current device now (preload_grouped_gemm_kernels says why).
cudaError_t preload_fp8_gemm_kernels();

}  // namespace primemoe
