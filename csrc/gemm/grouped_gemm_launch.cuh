// What the host launcher and the generated instantiation files share: the kernel
// parameters (TMA descriptors + arguments) and the per-variant launch entry points.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "grouped_gemm.cuh"

namespace primemoe::sm90 {

struct GemmParams {
  CUtensorMap tma_a;  // kRows: rows [num_rows, k] (unset when A is gathered); kExperts: rows [num_rows, m] (M-major)
  CUtensorMap tma_a_half;  // kRows: the same rows in 64-row boxes, for half tiles
  CUtensorMap tma_b;  // kRows: weights [E, n, k] or [E, k, n]; kExperts: rows [num_rows, n]
  CUtensorMap tma_out;   // out: kRows [num_rows, n]; kExperts [E * m, n] (kSwiGLUBackward: aw)
  CUtensorMap tma_out2;  // kSwiGLU: h, kSwiGLUBackward: dh, both [num_rows, 2n]
  GroupedGemmArgs args;
  bool split_half_tiles;  // kRows: a half tile's k-slices alternate between the consumers (GemmConfig)
  bool claim_tiles;       // kRows: tiles claimed from args.tile_counter (GemmConfig)
  bool pair_rows;         // kRows: launched as 2-CTA clusters over pairs of row blocks (GemmConfig)
  bool activation_warps;  // FC1: two producer warps compute the activation (GemmConfig)
  int32_t activation_helper_rows;  // FC1: rows of every activation job the fourth producer warp takes (GemmConfig)
  bool merge_tails;       // kRows: 192-row tiles instead of 64-row ones (GemmConfig)
  MergedActivation merged_activation;  // FC1: who computes the activation around a 192-row tile (GemmConfig)
};

// Defined for the variants listed in csrc/gemm/instantiations/ (generated). GatherA: A's rows are
// gathered from the tokens by the producer (GroupedGemmArgs::a_row_src).
template <GemmSchedule S, GemmEpilogue E, bool BKMajor, bool GatherA>
cudaError_t launch(const GemmParams& params, int grid, cudaStream_t stream);

}  // namespace primemoe::sm90
