// The tile sequence of one launch, walked by the producer.
//
// kRows: (row block, column tile), row blocks in order: each expert's rows in 128-row blocks, its last block 64
// rows when its padded count is an odd multiple of 64 (a half tile), or, with Merge, its first block 192 rows when
// that count is above 128 (the weight slice of a k-step then serves 192 rows in one CTA). Rows past the routed ones
// get zero tiles unless the caller leaves them unwritten (GroupedGemmArgs::zero_unrouted).
// kExperts: (expert, row tile, column tile), so neighbouring CTAs share an expert's operands in L2.
#pragma once

#include "pipeline.cuh"

namespace primemoe::sm90 {

template <GemmSchedule S, GemmEpilogue E, bool Merge>
struct TileWalker {
  const GroupedGemmArgs& args;
  int32_t n_tiles;
  int32_t m_tiles;
  uint32_t total;  // < 2^31 (grouped_gemm_supported), so that indices past it fit 32 bits too
  int32_t expert = 0;
  int32_t expert_block = 0;  // kRows: index of the first row block of `expert`

  // Whether an expert of `rows` rows (a multiple of 64) starts with a 192-row tile.
  __device__ bool merged(int32_t rows) const { return Merge && rows > kGemmTileM && rows % kGemmTileM != 0; }

  // Row blocks of an expert's rows.
  __device__ int32_t blocks(int32_t rows) const {
    return merged(rows) ? rows / kGemmTileM : (rows + kGemmTileM - 1) / kGemmTileM;
  }

  __device__ explicit TileWalker(const GroupedGemmArgs& a) : args(a) {
    n_tiles = a.n / gemm_tile_n(E);
    if constexpr (S == GemmSchedule::kRows) {
      m_tiles = 0;
      int64_t row_blocks = 0;
      for (int32_t e = 0; e < a.num_experts; ++e) row_blocks += blocks(a.expert_offsets[e + 1] - a.expert_offsets[e]);
      const int32_t routed_rows = a.expert_offsets[a.num_experts];
      const int64_t rows = a.zero_unrouted ? a.num_rows : min(int64_t(routed_rows), a.num_rows);
      row_blocks += (max(rows - routed_rows, int64_t(0)) + kGemmTileM - 1) / kGemmTileM;
      total = uint32_t(row_blocks * n_tiles);
    } else {
      m_tiles = a.m / kGemmTileM;
      total = uint32_t(int64_t(a.num_experts) * m_tiles * n_tiles);
    }
  }

  // Only moves its expert cursor forward: each CTA must ask for increasing tile indices (both tile orders do).
  __device__ Tile at(uint32_t t) {
    Tile tile;
    if constexpr (S == GemmSchedule::kRows) {
      const int32_t block = int32_t(t / uint32_t(n_tiles));
      const int32_t n_tile = int32_t(t % uint32_t(n_tiles));
      while (expert < args.num_experts) {
        const int32_t b = blocks(args.expert_offsets[expert + 1] - args.expert_offsets[expert]);
        if (block < expert_block + b) break;
        expert_block += b;
        ++expert;
      }
      // Past the last expert, expert_offsets[expert] is the end of the routed rows.
      const int32_t begin = args.expert_offsets[expert];
      const int32_t index = block - expert_block;
      if (expert == args.num_experts) return {expert, begin + index * kGemmTileM, n_tile, 0, 0, kGemmTileM, false};
      // A 192-row tile is its expert's first block: claimed before the full blocks of its column tile, it reads
      // their weight slices while they are still in L2.
      const int32_t count = args.expert_offsets[expert + 1] - begin;
      const bool first_merged = merged(count);
      const int32_t m0 = begin + index * kGemmTileM + (first_merged && index > 0 ? kGemmRowAlign : 0);
      const int32_t rows =
          first_merged && index == 0 ? kGemmTileM + kGemmRowAlign : min(count - (m0 - begin), kGemmTileM);
      tile = {expert, m0, n_tile, 0, args.k / kGemmTileK, rows, Pipeline<S, E>::kSplitHalves && rows <= kGemmRowAlign};
    } else {
      const uint32_t per_expert = uint32_t(m_tiles * n_tiles);
      const int32_t e = int32_t(t / per_expert);
      const int32_t r = int32_t(t % per_expert);
      const int32_t begin = args.expert_offsets[e];
      int32_t rows = args.expert_offsets[e + 1] - begin;
      if (args.expert_rows != nullptr) rows = max(min(rows, args.expert_rows[e]), 0);
      tile = {e, (r / n_tiles) * kGemmTileM, r % n_tiles, begin, (rows + kGemmTileK - 1) / kGemmTileK, kGemmTileM,
              false};
    }
    return tile;
  }
};

}  // namespace primemoe::sm90
