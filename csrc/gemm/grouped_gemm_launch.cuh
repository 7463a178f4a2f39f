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
  bool uncached_offsets;  // EXPERIMENT (temporary): PRIMEMOE_GEMM_OFFSETS=global walks args.expert_offsets in place
  bool consumers_walk;    // EXPERIMENT (temporary): PRIMEMOE_GEMM_TILES=walk: the consumers walk the tiles themselves
  // EXPERIMENT (temporary): per-tile records (PRIMEMOE_GEMM_TRACE=<device address>), kTraceTiles of kTraceValues per
  // CTA, in tile order: tile index, taken, first stage full, mainloop done, tile done (globaltimer ns, consumer
  // warpgroup 0), ns that warpgroup waited for filled stages after the first, and ns the producer waited for empty
  // stages (its own consumers', then the peer's pair_empty), when the producer's claim of the tile began and
  // returned (claimed order; zeros for a CTA's first tile), and when the consumers had its index (before the walk).
  unsigned long long* trace;
};
constexpr int kTraceTiles = 256;
constexpr int kTraceValues = 10;

// Defined for the variants listed in csrc/gemm/instantiations/ (generated). GatherA: A's rows are
// gathered from the tokens by the producer (GroupedGemmArgs::a_row_src).
template <GemmSchedule S, GemmEpilogue E, bool BKMajor, bool GatherA>
cudaError_t launch(const GemmParams& params, int grid, cudaStream_t stream);

}  // namespace primemoe::sm90
