// What the host launcher and the generated instantiation files share: the kernel parameters (TMA descriptors and
// arguments) and the per-variant launch entry points.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "grouped_gemm.cuh"

namespace primemoe::sm90 {

struct GemmParams {
  CUtensorMap tma_a;       // kRows: rows [num_rows, k]; kExperts: rows [num_rows, m] (M-major)
  CUtensorMap tma_a_half;  // kRows: the same rows in 64-row boxes (half tiles, the tails of 192-row tiles)
  CUtensorMap tma_b;       // kRows: weights [E, n, k] or [E, k, n]; kExperts: rows [num_rows, n]
  CUtensorMap tma_out;     // out: kRows [num_rows, n]; kExperts [E * m, n] (kSwiGLUBackward: aw)
  CUtensorMap tma_out2;    // kSwiGLU: h, kSwiGLUBackward: dh, both [num_rows, 2n]
  GroupedGemmArgs args;
};

// Defined for the variants of csrc/gemm/instantiations/variants.cuh (generated): Claim and Merge are the
// GemmConfig the kernel is built for.
template <GemmSchedule S, GemmEpilogue E, bool BKMajor, bool Claim, bool Merge>
cudaError_t launch(const GemmParams& params, int grid, bool programmatic, cudaStream_t stream);

}  // namespace primemoe::sm90
