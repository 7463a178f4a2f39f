// The engine's shared memory and the protocols over it: the ring of operand stages, the epilogue's staging boxes,
// the tile handoff from the producer to the consumers, and the swizzle both sides agree on.
#pragma once

#include <cuda_bf16.h>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>

#include "../../kernels/ptx.cuh"
#include "../grouped_gemm_launch.cuh"

namespace primemoe::sm90 {

using namespace cute;

constexpr int kThreads = 384;                    // the producer warpgroup and two consumer warpgroups
constexpr int kSubTileElems = 128 * kGemmTileK;  // one 128 x 64 operand tile, 16 KiB
constexpr uint32_t kStageBytes = 3 * kSubTileElems * 2;
constexpr uint32_t kStageBBytes = 2 * kSubTileElems * 2;  // the weight half of a stage

// FC1's activation warps (two producer warps, one per consumer warpgroup, compute bf16(silu(g) * u) from the
// consumers' pre-activations, so the tensor cores never wait for it): the variants that have them.
constexpr bool gemm_activation_warps(GemmSchedule s, GemmEpilogue e) {
  return s == GemmSchedule::kRows && e == GemmEpilogue::kSwiGLU;
}

// The rows of each 64-row activation job that the helper warp (the producer warpgroup's fourth) takes: half.
constexpr int32_t kActivationHelperRows = 32;

// Ring depth and epilogue staging (64 x 64 bf16 boxes per consumer warpgroup) share shared memory: 4 stages leave
// room for 2 boxes, 3 stages for 4. FC2 dgrad's epilogue holds 3 boxes at once (gate, up, weighted activation), so
// it runs 3 stages; every other variant 4, with its epilogue in two rounds of two boxes.
// kSplitHalves: a half tile's warpgroups take alternate k-slices only with an even ring depth: with an odd one a
// warpgroup's next stage would last have been the other's, whose fill it cannot tell from its own two phases back.
template <GemmSchedule S, GemmEpilogue E>
struct Pipeline {
  static constexpr bool kDeep = E != GemmEpilogue::kSwiGLUBackward;
  static constexpr int kStages = kDeep ? 4 : 3;
  static constexpr int kBoxes = kDeep ? 2 : 4;
  static constexpr bool kSplitHalves = S == GemmSchedule::kRows && kStages % 2 == 0;
};

template <int Stages, int Boxes>
struct SharedStorage {
  bfloat16_t a[Stages * kSubTileElems];
  bfloat16_t b[Stages * 2 * kSubTileElems];  // per stage: the two 128-row weight halves, one 256-row operand
  bfloat16_t staging[2][Boxes * 64 * 64];
  uint64_t full[Stages];
  uint64_t empty[Stages];
  // The producer passes each tile, decoded, to the consumers (TileRing: two slots).
  alignas(16) int32_t tile_slot[2][8];
  uint64_t tile_full[2];
  uint64_t tile_empty[2];
  // Split half tiles: warpgroup 1's partial sums are in its staging boxes (exchange_full) / read (exchange_empty).
  uint64_t exchange_full;
  uint64_t exchange_empty;
  // FC1's activation warps: consumer warpgroup w's 64 columns of gate and up pre-activations are in its staging
  // boxes (act_full[w]; their row and column in act_job[w], column -1: stop), or the boxes are free (act_empty[w]).
  uint64_t act_full[2];
  uint64_t act_empty[2];
  int32_t act_job[2][2];
  // 192-row tiles: the staging boxes hold one 64-row A slice per stage while such a tile's k-slices load; the
  // consumers release them (every thread) once no store or job uses them.
  uint64_t staging_free;
};

template <GemmSchedule S, GemmEpilogue E>
using SharedStorageOf = SharedStorage<Pipeline<S, E>::kStages, Pipeline<S, E>::kBoxes>;

// + room to align the base to 1 KiB (swizzle atoms).
template <GemmSchedule S, GemmEpilogue E>
constexpr size_t kSmemBytes = sizeof(SharedStorageOf<S, E>) + 1024;

// Shared-memory layout of one operand's ring: (Rows of M or N, 64 of K, stage), 128-byte swizzled exactly as TMA
// writes it per 128 rows (K-major: one 64 x 128 box; MN-major: two 64 x 64 boxes), 128-row blocks back to back.
template <bool KMajor, int Rows, int Stages>
CUTE_HOST_DEVICE constexpr auto ring_layout() {
  if constexpr (KMajor) {
    return tile_to_shape(GMMA::Layout_K_SW128_Atom<bfloat16_t>{}, Shape<Int<Rows>, Int<kGemmTileK>, Int<Stages>>{});
  } else {
    return tile_to_shape(GMMA::Layout_MN_SW128_Atom<bfloat16_t>{}, Shape<Int<Rows>, Int<kGemmTileK>, Int<Stages>>{},
                         Step<_2, _1, _3>{});
  }
}

template <bool KMajor>
constexpr GMMA::Major major() {
  return KMajor ? GMMA::Major::K : GMMA::Major::MN;
}

// Loads one 128 x 64 operand tile: rows/cols [mn0, mn0 + 128) x [k0, k0 + 64) of layer l.
template <bool KMajor>
__device__ __forceinline__ void load_tile(const CUtensorMap* map, uint64_t* bar, bfloat16_t* dst, int32_t mn0,
                                          int32_t k0, int32_t l) {
  if constexpr (KMajor) {
    tma_load(map, bar, dst, k0, mn0, l);
  } else {
    tma_load(map, bar, dst, mn0, k0, l);
    tma_load(map, bar, dst + kSubTileElems / 2, mn0 + 64, k0, l);
  }
}

// TMA's 128-byte swizzle of 64-element bf16 rows: 16-byte chunk c of row r sits at chunk c ^ (r % 8). The staging
// boxes use it, so the accumulator layout's writes (8 rows x 4 column pairs per warp instruction) hit 32 banks.
constexpr int kBoxBytes = 64 * 64 * 2;

CUTE_HOST_DEVICE constexpr uint32_t swizzled(int r, int c) {
  return r * 128 + ((((c >> 3) ^ (r & 7)) << 4) | ((c & 7) << 1));
}

// The epilogue rounds' staging offsets, swizzled() taken apart: a consumer thread's value pair i of a 128-column
// half sits at its base (frag_row * 128 + frag_col * 2) plus pair_offset(i, (frag_row & 7) << 4), in box i / 32 of
// the round's two. Apart, the thread's part can be kept opaque (Consumer::staging_base).
CUTE_HOST_DEVICE constexpr uint32_t pair_offset(int i, uint32_t swizzle) {
  const int chunk = (i >> 2) % 8;
  return (i >> 5) * kBoxBytes + ((i >> 1) & 1) * 8 * 128 + ((chunk << 4) ^ swizzle);
}

// Every consumer thread (frag_row = 16 w + l / 4, frag_col = 2 (l % 4)) and pair: the same address both ways.
constexpr bool pair_offsets_match_swizzled() {
  for (int frag_row = 0; frag_row < 64; frag_row += frag_row % 16 == 7 ? 9 : 1) {
    for (int frag_col = 0; frag_col < 8; frag_col += 2) {
      for (int i = 0; i < 64; i += 2) {
        const int r = frag_row + 8 * ((i >> 1) & 1);
        const int c = frag_col + 8 * (i >> 2);
        if ((c / 64) * kBoxBytes + swizzled(r, c % 64) !=
            frag_row * 128 + frag_col * 2 + pair_offset(i, uint32_t(frag_row & 7) << 4)) {
          return false;
        }
      }
    }
  }
  return true;
}
static_assert(pair_offsets_match_swizzled(), "pair_offset must be swizzled() taken apart");

__device__ __forceinline__ void put_pair(uint32_t slots, int box, int r, int c, __nv_bfloat162 v) {
  st_shared(slots + box * kBoxBytes + swizzled(r, c), *reinterpret_cast<const uint32_t*>(&v));
}

__device__ __forceinline__ __nv_bfloat162 get_pair(uint32_t slots, int box, int r, int c) {
  const uint32_t v = ld_shared(slots + box * kBoxBytes + swizzled(r, c));
  return *reinterpret_cast<const __nv_bfloat162*>(&v);
}

// Consumer warpgroup wg's named barrier (ids 1 and 2).
__device__ __forceinline__ void wg_sync(int wg) { named_barrier<128>(wg + 1); }

// Before writing the staging boxes: the previous TMA stores have finished reading them.
__device__ __forceinline__ void staging_acquire(int wg, int wtid) {
  if (wtid == 0) store_wait_read();
  wg_sync(wg);
}

// After writing the staging boxes: the generic-proxy writes made visible to TMA, then one thread stores.
__device__ __forceinline__ void staging_release(int wg) {
  fence_proxy_async_shared();
  wg_sync(wg);
}

// A position in the ring of stages: the stage, and the parity of its fill there.
template <int Stages>
struct RingPos {
  int stage = 0;
  uint32_t phase = 0;
  __device__ void step(int32_t by) {  // by <= Stages: the k-loops' steps
    stage += by;
    if (stage >= Stages) {
      stage -= Stages;
      phase ^= 1;
    }
  }
  __device__ void advance(int32_t by) {  // any by >= 0: a whole tile's k-slices
    phase ^= (by / Stages) & 1;
    step(by % Stages);
  }
};

struct Tile {
  int32_t expert;
  int32_t m0;       // kRows: first row; kExperts: first output row of the expert's block
  int32_t n_tile;   // column tile index
  int32_t k_begin;  // first K element (kExperts: first row of the expert)
  int32_t k_tiles;
  int32_t rows;     // kRows: 128, 64 for an expert's last block of 64 rows (a half tile), 192 where merged
  bool split;       // a half tile split along K between the consumers (Pipeline::kSplitHalves)
};

// The producer's handoff of each tile, decoded, with its index in the sequence (-1: past the last tile, so that
// everyone stops), through two slots: the n-th tile uses slot n % 2 at parity n / 2 % 2. The producer walks ahead,
// so the consumers never wait at a tile boundary for the walk.
template <typename Smem>
struct TileRing {
  Smem& smem;

  __device__ void pass(uint32_t n, int32_t index, const Tile& tile) {
    const int slot = n & 1;
    const uint32_t at = smem_addr(smem.tile_slot[slot]);
    cutlass::arch::ClusterBarrier::wait(&smem.tile_empty[slot], ((n >> 1) & 1) ^ 1);
    st_shared_v4(at, make_uint4(tile.expert, tile.m0, tile.n_tile, tile.k_begin));
    st_shared_v4(at + 16, make_uint4(tile.k_tiles, tile.rows, tile.split, index));
    cutlass::arch::ClusterBarrier::arrive(&smem.tile_full[slot]);
  }

  // By every consumer thread; one arrival per warp gives the slot back.
  __device__ Tile take(uint32_t n, int32_t& index) {
    const int slot = n & 1;
    const uint32_t at = smem_addr(smem.tile_slot[slot]);
    cutlass::arch::ClusterBarrier::wait(&smem.tile_full[slot], (n >> 1) & 1);
    const uint4 w0 = ld_shared_v4(at);
    const uint4 w1 = ld_shared_v4(at + 16);
    __syncwarp();
    if (threadIdx.x % 32 == 0) cutlass::arch::ClusterBarrier::arrive(&smem.tile_empty[slot]);
    index = int32_t(w1.w);
    return Tile{int32_t(w0.x), int32_t(w0.y), int32_t(w0.z), int32_t(w0.w), int32_t(w1.x), int32_t(w1.y), w1.z != 0};
  }

  // Whether the n-th tile has 192 rows, before it is taken: the producer passes a tile before it loads it, so by the
  // previous tile's epilogue it is (nearly always) there.
  __device__ bool next_is_merged(uint32_t n) {
    const int slot = n & 1;
    cutlass::arch::ClusterBarrier::wait(&smem.tile_full[slot], (n >> 1) & 1);
    return int32_t(ld_shared(smem_addr(smem.tile_slot[slot]) + 20)) > kGemmTileM;  // Tile::rows
  }
};

}  // namespace primemoe::sm90
