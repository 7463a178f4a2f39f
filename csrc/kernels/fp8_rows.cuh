// The FP8 path's SwiGLU epilogues as row kernels over the expert-major rows (reference.moe_fp8, steps 3-4 and
// 9-11; python/primemoe/_quant_ops.py holds the same definitions in PyTorch, the spec these kernels are tested
// against). Rows are h's rows [R, 2I] (gate = columns [0, I), up = [I, 2I)), I a multiple of 128; the rows at or
// past *rows_end (expert_offsets[E], read on the device, clamped to [0, R]) are left unwritten. Everything in
// fp32 from the bf16 h with IEEE roundings in the order written (no contraction into FMAs):
//
//   e = exp(-g), silu = g / (1 + e), sig = 1 / (1 + e), a = bf16(silu * u)           (torch's F.silu, sigmoid)
//   forward:  a quantised 1x128 along I (quantize.cuh's rule on the bf16 values): a_q, a_scale
//   backward: dw = da * w, dh = bf16([((dw * u) * sig) * (1 + g * (1 - sig)) | (dw * g) * sig]), dh quantised
//             1x128 along 2I (tiles never straddle the halves), aw = bf16(w * a), dot = sum_i da[i] * a[i]
//
// Scales are MN-major (scale[t * R + r] for tile t of row r: the layout the FP8 GEMMs load). exp is CUDA's expf
// (within an ulp or two of the CPU's), so a differs from the CPU kernel's where that flips a bf16 rounding.
// dot is summed in a fixed order (per lane over its columns, then a butterfly over the 16 lanes of the row):
// deterministic. One launch, nothing allocated, no host sync, no atomics: capturable in a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace primemoe {

struct Fp8SwigluQuantArgs {
  const void* h;            // [rows, 2 * inter] bf16, 16-byte aligned
  void* a_q;                // [rows, inter] e4m3
  float* a_scale;           // [inter / 128, rows]
  const int32_t* rows_end;  // null (all rows), or a device pointer to the routed row count (expert_offsets[E])
  int64_t rows;
  int64_t inter;            // I, a multiple of 128
  bool pow2;
};

struct Fp8SwigluBackwardArgs {
  const float* da;          // [rows, inter] fp32 (unweighted), 16-byte aligned
  const void* h;            // [rows, 2 * inter] bf16, 16-byte aligned
  const float* row_weight;  // [rows]
  void* dh;                 // [rows, 2 * inter] bf16
  void* dh_q;               // [rows, 2 * inter] e4m3
  float* dh_scale;          // [2 * inter / 128, rows]
  void* aw;                 // [rows, inter] bf16
  float* dot;               // [rows]
  const int32_t* rows_end;  // null (all rows), or a device pointer to the routed row count (expert_offsets[E])
  int64_t rows;
  int64_t inter;            // I, a multiple of 128
  bool pow2;
};

// cudaErrorInvalidValue for sizes outside the above; cudaSuccess without a launch when there are no rows.
cudaError_t launch_fp8_swiglu_quant(const Fp8SwigluQuantArgs& args, cudaStream_t stream);
cudaError_t launch_fp8_swiglu_backward(const Fp8SwigluBackwardArgs& args, cudaStream_t stream);

}  // namespace primemoe
