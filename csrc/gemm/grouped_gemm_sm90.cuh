// Device template of the expert-grouped GEMM family for sm_90a (see grouped_gemm.cuh).
//
// One CTA per SM, persistent. Warpgroup 0 is the producer: one thread walks the tile
// sequence and issues TMA loads into a ring of stages guarded by mbarriers; when the A
// rows are gathered from the tokens, the 32 lanes of that thread's warp copy them (cp.async
// into the swizzled layout), because TMA has no row gather on sm_90.
// Warpgroups 1 and 2 are the consumers: each owns 64 rows of the 128 x 256 tile as one
// 64 x 256 fp32 accumulator (m64n256 wgmma, the widest: least shared-memory traffic per
// FLOP) whose column halves are the tile's two 128-row weight loads (for FC1 the gate and
// the up projection of the same activation columns, so SwiGLU needs no shuffle),
// runs wgmma straight from shared memory, and hands its epilogue to TMA stores through
// swizzled shared-memory boxes (they drain while the next tile's mainloop runs; in every variant but FC2
// dgrad, a tile's last round of boxes is written during the next tile's first k-slice).
// The producer walks the tile sequence and passes each tile, decoded, to the consumers (so the ring's
// stage/phase counters stay in step, in either tile order); the consumers never walk it themselves. With paired row
// blocks (GemmConfig::pair_rows) the CTAs of a 2-CTA cluster take two row blocks of one column tile,
// and where both are one expert's, each producer loads half of the weight tile into both CTAs
// (TMA multicast) once both CTAs' consumers have released the stage; the consumers do not change. An expert's last
// 64 rows (a half tile) are split along K between the consumers where the ring depth and
// GemmConfig allow (see Pipeline and the consumers' comment), else multiplied as a full tile.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "../kernels/device_wait.cuh"
#include "grouped_gemm_launch.cuh"

namespace primemoe::sm90 {

using namespace cute;

constexpr int kThreads = 384;
constexpr int kSubTileElems = 128 * kGemmTileK;  // one 128 x 64 operand tile, 16 KiB
constexpr uint32_t kStageBytes = 3 * kSubTileElems * 2;
constexpr uint32_t kStageBBytes = 2 * kSubTileElems * 2;  // the weight half of a stage

// Ring depth and epilogue staging (64 x 64 bf16 boxes per consumer warpgroup) share shared memory:
// 4 stages leave room for 2 boxes, 3 stages for 4. FC1 (H200, Qwen3-30B, T = 16384) went from 1.61
// to 1.30 ms with 4 stages, 2 boxes and the fast SiLU division together. The plain-store variants,
// 3 against 4 stages interleaved in one process (H200, both shapes, T = 8192 and 16384): FC2 3-4%
// faster with 4 (its epilogue then stores in two rounds), FC1 dgrad within 1.5%, the weight
// gradients (kExperts) up to 1.7% slower. Since the second round is deferred (see the consumers), the
// weight gradients run faster with 4 stages than with 3 and one round of 4 boxes (7 of 8 GEMM medians,
// by up to 3.4%; same shapes).
// FC2 dgrad's epilogue uses 3 of its 4 boxes at once (gate, up, weighted activation): with 3 stages
// there is room for 4 either way, and a 4th stage would not fit beside 3. 4 stages with 2 boxes and
// the weighted activation written from registers measured ~13-14% slower when it spilled; without a spill
// (thirteenth session) it was within 1.6% on every shape, although Nsight shows FC2 dgrad's consumer warps
// waiting ~39% of their time for a filled stage (Qwen3-235B, T = 8192): the ring's depth is not what
// starves them.
// kSplitHalves: a half tile's warpgroups take alternate k-slices only with an even ring depth. With an
// odd one a warpgroup's next stage would last have been the other's, whose fill it cannot tell from its
// own two phases back (the parity wait passes early); FC2 dgrad runs half tiles as full ones instead.
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
  // The producer passes each tile, decoded, to the consumers (pass_tile in the kernel: a two-slot ring).
  alignas(16) int32_t tile_slot[2][8];
  uint64_t tile_full[2];
  uint64_t tile_empty[2];
  // Split half tiles: warpgroup 1's partial sums are in its staging boxes (exchange_full) / read (exchange_empty).
  uint64_t exchange_full;
  uint64_t exchange_empty;
  // Paired row blocks (GemmConfig::pair_rows): the peer's producer found its own consumers done with the stage.
  uint64_t pair_empty[Stages];
  // Paired and claimed: rank 0's producer passes each claimed pair to rank 1's (a two-slot ring in rank 1's
  // pair_work / pair_work_full, emptied into rank 0's pair_work_empty).
  int32_t pair_work[2];
  uint64_t pair_work_full[2];
  uint64_t pair_work_empty[2];
  // FC1's activation warps (kActWarps in the kernel): consumer warpgroup w's 64 columns of gate and up
  // pre-activations are in its staging boxes (act_full[w]; their row and column in act_job[w], column -1: stop),
  // or the boxes are free again (act_empty[w]).
  uint64_t act_full[2];
  uint64_t act_empty[2];
  int32_t act_job[2][2];
  // A gathered A: where the current tile's rows start in x, in the order the gathering lanes read them.
  alignas(16) int32_t gather_tokens[128];
  // 192-row tail tiles (GemmConfig::merge_tails): the staging boxes hold one 64-row A slice per stage while such a
  // tile's k-slices load; the consumers release them (every thread) once no store or job uses them.
  uint64_t staging_free;
};

template <GemmSchedule S, GemmEpilogue E>
using SharedStorageOf = SharedStorage<Pipeline<S, E>::kStages, Pipeline<S, E>::kBoxes>;

// + room to align the base to 1 KiB (swizzle atoms).
template <GemmSchedule S, GemmEpilogue E>
constexpr size_t kSmemBytes = sizeof(SharedStorageOf<S, E>) + 1024;

// Shared-memory layout of one operand's ring: (Rows of M or N, 64 of K, stage), 128-byte
// swizzled exactly as TMA writes it per 128 rows (K-major: one 64 x 128 box; MN-major: two
// 64 x 64 boxes), 128-row blocks back to back.
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

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void tma_load(const CUtensorMap* map, uint64_t* bar, void* dst, int32_t c0, int32_t c1,
                                         int32_t c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];"
      :
      : "r"(smem_addr(dst)), "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// The same box into the same shared-memory offset of both CTAs of a 2-CTA cluster; each CTA's barrier there
// counts the bytes it receives.
__device__ __forceinline__ void tma_load_pair(const CUtensorMap* map, uint64_t* bar, void* dst, int32_t c0, int32_t c1,
                                              int32_t c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4, %5}], [%2], %6;"
      :
      : "r"(smem_addr(dst)), "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "h"(uint16_t(3))
      : "memory");
}

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// The address of `p`'s copy in CTA `rank` of the cluster (the shared::cluster window).
__device__ __forceinline__ uint32_t cluster_addr(const void* p, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(p)), "r"(rank));
  return remote;
}

// One arrival on the barrier at `bar`'s offset in CTA `rank` of the cluster.
__device__ __forceinline__ void arrive_remote(uint64_t* bar, uint32_t rank) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(cluster_addr(bar, rank)) : "memory");
}

// Waits for a phase of a barrier that another CTA of the cluster completes (acquire at cluster scope).
__device__ __forceinline__ void wait_cluster(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n\t.reg .pred done;\n\t"
      "wait_cluster_again:\n\t"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n\t"
      "@!done bra wait_cluster_again;\n\t}" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// An arrival on the peer's `bar` that releases this thread's earlier accesses at cluster scope.
__device__ __forceinline__ void arrive_remote_release(uint64_t* bar, uint32_t rank) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(cluster_addr(bar, rank))
               : "memory");
}

// The peer's copy of a shared int32, then an arrival on the peer's `bar` that releases it.
__device__ __forceinline__ void put_remote(int32_t* slot, uint64_t* bar, int32_t v, uint32_t rank) {
  asm volatile("st.shared::cluster.b32 [%0], %1;" ::"r"(cluster_addr(slot, rank)), "r"(v) : "memory");
  arrive_remote_release(bar, rank);
}

// `count` arrivals by this thread on a barrier of this CTA (release: its earlier accesses come before).
__device__ __forceinline__ void arrive_count(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// Whether the barrier's phase of this parity is complete, after waiting at most ~100 ns for it: a warp that
// watches several barriers must not sleep on one while another is ready.
__device__ __forceinline__ bool poll_parity(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, 100;\n\tselp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// 16 bytes into shared memory, or 16 zero bytes when `bytes` is 0 (src is then not read).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

// 16 bytes into shared memory from src, or 16 zero bytes where at < 0 (src is then not read).
__device__ __forceinline__ void cp_async_16_unless_negative(uint32_t dst, const void* src, int32_t at) {
  asm volatile(
      "{\n\t.reg .pred zeros;\n\tsetp.lt.s32 zeros, %2, 0;\n\t"
      "cp.async.cg.shared.global [%0], [%1], 16, zeros;\n\t}" ::"r"(dst),
      "l"(src), "r"(at)
      : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// One arrival on `bar` once this thread's earlier cp.async copies have landed (counted in the
// barrier's expected arrivals).
__device__ __forceinline__ void cp_async_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
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

// TMA's 128-byte swizzle of 64-element bf16 rows: 16-byte chunk c of row r sits at chunk c ^ (r % 8).
// The epilogue's staging boxes (Pipeline::kBoxes of 64 x 64 per consumer warpgroup) use it, so the
// accumulator layout's writes (8 rows x 4 column pairs per warp instruction) hit 32 distinct banks,
// and so does the gathered A.
constexpr int kBoxBytes = 64 * 64 * 2;

CUTE_HOST_DEVICE constexpr uint32_t swizzled(int r, int c) {
  return r * 128 + ((((c >> 3) ^ (r & 7)) << 4) | ((c & 7) << 1));
}

// The epilogue rounds' staging offsets, swizzled() taken apart: a consumer thread's value pair i of a 128-column
// half sits at its base (frag_row * 128 + frag_col * 2, see the consumers) plus pair_offset(i, (frag_row & 7)
// << 4), in box i / 32 of the round's two. Apart, the thread's part can be kept opaque (see store_round).
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

// Shared-memory accesses by 32-bit shared address: through a generic pointer (the storage's address space is
// lost in its alignment arithmetic) they compiled to generic 64-bit stores whose addresses took two registers each.
// No memory clobber: the staging boxes are touched only by volatile asm (these, cp.async, TMA, the fences and
// barriers), which the compiler keeps in order; a plain C++ access to them would need one.
__device__ __forceinline__ void st_shared(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v));
}

__device__ __forceinline__ uint32_t ld_shared(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}

__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

__device__ __forceinline__ void put_pair(uint32_t slots, int box, int r, int c, __nv_bfloat162 v) {
  st_shared(slots + box * kBoxBytes + swizzled(r, c), *reinterpret_cast<const uint32_t*>(&v));
}

__device__ __forceinline__ __nv_bfloat162 get_pair(uint32_t slots, int box, int r, int c) {
  const uint32_t v = ld_shared(slots + box * kBoxBytes + swizzled(r, c));
  return *reinterpret_cast<const __nv_bfloat162*>(&v);
}

__device__ __forceinline__ void wg_sync(int wg) { asm volatile("bar.sync %0, 128;" ::"r"(wg + 1) : "memory"); }

__device__ __forceinline__ void tma_store(const CUtensorMap* map, uint32_t src, int32_t c0, int32_t c1) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];"
               :
               : "l"(map), "r"(src), "r"(c0), "r"(c1), "r"(0)
               : "memory");
}

__device__ __forceinline__ void store_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

__device__ __forceinline__ void store_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

// Before writing the slots: the previous TMA stores have finished reading them.
__device__ __forceinline__ void staging_acquire(int wg, int wtid) {
  if (wtid == 0) store_wait_read();
  wg_sync(wg);
}

// After writing the slots: make the generic-proxy writes visible to TMA, then one thread stores.
__device__ __forceinline__ void staging_release(int wg) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
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
  bool split;       // a half tile split along K between the consumers (see Pipeline::kSplitHalves)
};

// The tile sequence, walked by the producer. kRows: (row block, column
// tile), row blocks in order (each expert's rows in 128-row blocks, its last block 64 rows
// when its padded count is an odd multiple of 64, or, merging tails, its first block 192 rows
// when that count is above 128). `at` only moves its expert cursor forward:
// each CTA must ask for increasing tile indices (both tile orders do).
// kExperts: (expert, row tile, column tile), so neighbouring CTAs share an expert's operands in L2.
template <GemmSchedule S, GemmEpilogue E>
struct TileWalker {
  const GroupedGemmArgs& args;
  int32_t n_tiles;
  int32_t m_tiles;
  uint32_t total;  // < 2^31 (grouped_gemm_supported), so that indices past it fit 32 bits too
  int32_t expert = 0;
  int32_t expert_block = 0;  // kRows: index of the first row block of `expert`
  bool split_halves;         // GemmConfig::split_half_tiles, where the ring depth allows it
  bool merge_tails;          // GemmConfig::merge_tails, where the variant has it

  // Whether an expert of `rows` rows (a multiple of 64) starts with a 192-row tile.
  __device__ bool merged(int32_t rows) const { return merge_tails && rows > kGemmTileM && rows % kGemmTileM != 0; }

  // Row blocks of an expert's rows.
  __device__ int32_t blocks(int32_t rows) const {
    return merged(rows) ? rows / kGemmTileM : (rows + kGemmTileM - 1) / kGemmTileM;
  }

  __device__ TileWalker(const GroupedGemmArgs& a, bool split_half_tiles, bool merge)
      : args(a), split_halves(Pipeline<S, E>::kSplitHalves && split_half_tiles), merge_tails(merge) {
    n_tiles = a.n / gemm_tile_n(E);
    if constexpr (S == GemmSchedule::kRows) {
      // Every allocated row gets a tile: rows past the last expert are written as zeros, so no
      // output element is left undefined; unless the caller reads only the routed rows.
      m_tiles = 0;
      int64_t row_blocks = 0;
      for (int32_t e = 0; e < a.num_experts; ++e) row_blocks += blocks(a.expert_offsets[e + 1] - a.expert_offsets[e]);
      const int32_t routed_rows = a.expert_offsets[a.num_experts];
      const int64_t rows = a.skip_unrouted_rows ? min(int64_t(routed_rows), a.num_rows) : a.num_rows;
      row_blocks += (max(rows - routed_rows, int64_t(0)) + kGemmTileM - 1) / kGemmTileM;
      total = uint32_t(row_blocks * n_tiles);
    } else {
      m_tiles = a.m / kGemmTileM;
      total = uint32_t(int64_t(a.num_experts) * m_tiles * n_tiles);
    }
  }

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
      // A 192-row tile is its expert's first block: claimed before the full blocks of its column tile, whose
      // k-slices it reads 1.5x slower, it stays within L2's reach of them (last, its weight slices had left L2 by
      // the time it read them: +73% DRAM reads, FC1 at Qwen3-235B).
      const int32_t count = args.expert_offsets[expert + 1] - begin;
      const bool first_merged = merged(count);
      const int32_t m0 = begin + index * kGemmTileM + (first_merged && index > 0 ? kGemmRowAlign : 0);
      const int32_t rows =
          first_merged && index == 0 ? kGemmTileM + kGemmRowAlign : min(count - (m0 - begin), kGemmTileM);
      tile = {expert, m0, n_tile, 0, args.k / kGemmTileK, rows, split_halves && rows <= kGemmRowAlign};
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

#ifdef PRIMEMOE_GEMM_TILE_TRACE
// GroupedGemmArgs::tile_trace: field f of the n-th tile consumer thread ct takes (thread 0 only records).
__device__ __forceinline__ void tile_trace_put(const GroupedGemmArgs& a, int ct, uint32_t n, int f, uint64_t value) {
  if (ct == 0 && n < uint32_t(kTileTraceTiles)) {
    a.tile_trace[uint64_t(blockIdx.x) * kTileTraceCtaWords + n * kTileTraceFields + f] = value;
  }
}
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Field f of warpgroup 0's n-th activation job, now (by the thread that stamps it only).
__device__ __forceinline__ void job_trace_put(const GroupedGemmArgs& a, bool stamps, uint32_t n, int f) {
  if (stamps && n < uint32_t(kTileTraceJobs)) {
    a.tile_trace[uint64_t(blockIdx.x) * kTileTraceCtaWords + kTileTraceTiles * kTileTraceFields +
                 n * kTileTraceJobFields + f] = global_ns();
  }
}
__device__ __forceinline__ uint64_t sm_id() {
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}
#define PRIMEMOE_TILE_TRACE(n, f, value) tile_trace_put(args, ct, n, f, value)
#define PRIMEMOE_JOB_TRACE(stamps, n, f) job_trace_put(args, stamps, n, f)
#else
#define PRIMEMOE_TILE_TRACE(n, f, value) ((void)0)
#define PRIMEMOE_JOB_TRACE(stamps, n, f) ((void)0)
#endif

// e^-g as __expf(-g) computes it, with its result flushed below 2^-126 (ex2's .ftz): 1 + e^-g, the only use, has the
// same bits either way, and the flush drops __expf's three-instruction rescale around ex2. The activation warps run
// at a fraction of their issue rate beside the wgmma (tile_trace), so their instruction count is their latency.
__device__ __forceinline__ float exp_neg(float g) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.4426950408889634f));
  return e;
}
// Fast division: the result is rounded to bf16, so its 2-ulp error does not show.
__device__ __forceinline__ float silu(float g) { return __fdividef(g, 1.0f + exp_neg(g)); }

// A bf16 pair as floats, the high half by a mask: one instruction less than __bfloat1622float2's extract and shift.
__device__ __forceinline__ float2 bf16_pair_to_float2(uint32_t v) {
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}
__device__ __forceinline__ __nv_bfloat162 pack(float lo, float hi) { return __floats2bfloat162_rn(lo, hi); }

// bf16(silu(g) * u) of a pair of bf16 gate and a pair of bf16 up values.
__device__ __forceinline__ uint32_t silu_times(uint32_t gate_pair, uint32_t up_pair) {
  const float2 g = bf16_pair_to_float2(gate_pair);
  const float2 u = bf16_pair_to_float2(up_pair);
  const __nv_bfloat162 a = pack(silu(g.x) * u.x, silu(g.y) * u.y);
  return *reinterpret_cast<const uint32_t*>(&a);
}
// The same for a 16-byte chunk: four pairs of gate and of up values.
__device__ __forceinline__ uint4 silu_times(uint4 gate, uint4 up) {
  return make_uint4(silu_times(gate.x, up.x), silu_times(gate.y, up.y), silu_times(gate.z, up.z),
                    silu_times(gate.w, up.w));
}

template <GemmSchedule S, GemmEpilogue E, bool BKMajor, bool GatherA>
__global__ void __launch_bounds__(kThreads, 1) grouped_gemm_kernel(const __grid_constant__ GemmParams p) {
  static_assert(!GatherA || S == GemmSchedule::kRows, "only row operands are gathered");
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool AKMajor = S == GemmSchedule::kRows;
  const GroupedGemmArgs& args = p.args;
  extern __shared__ uint8_t smem_raw[];
  constexpr int kStages = Pipeline<S, E>::kStages;
  constexpr bool kPairs = gemm_pairs_rows(S, BKMajor);
  // FC1's activation by two warps of the producer warpgroup (one per consumer warpgroup), off the consumers'
  // critical path: see the epilogue.
  constexpr bool kActWarps = gemm_activation_warps(S, E);
  const bool act_warps = kActWarps && p.activation_warps;
  // 192-row tail tiles: their tail rows' A slices go into the staging boxes, one 64-row slice per stage. FC1 hands
  // their epilogue to the activation warps only.
  constexpr bool kMerge = gemm_merges_tails(S, E, BKMajor, GatherA);
  static_assert(!kMerge || sizeof(SharedStorageOf<S, E>::staging) == kStages * kBoxBytes, "a tail slice per stage");
  const bool merge = kMerge && p.merge_tails && (E != GemmEpilogue::kSwiGLU || act_warps);
  auto& smem =
      *reinterpret_cast<SharedStorageOf<S, E>*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));

  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      // The TMA thread's arrival, plus one per lane of the gathering warp.
      cutlass::arch::ClusterTransactionBarrier::init(&smem.full[s], GatherA ? 33 : 1);
      cutlass::arch::ClusterBarrier::init(&smem.empty[s], 8);  // one arrival per consumer warp
    }
    for (int s = 0; s < 2; ++s) {
      cutlass::arch::ClusterBarrier::init(&smem.tile_full[s], 1);
      cutlass::arch::ClusterBarrier::init(&smem.tile_empty[s], 8);  // one arrival per consumer warp
    }
    if constexpr (Pipeline<S, E>::kSplitHalves) {
      cutlass::arch::ClusterBarrier::init(&smem.exchange_full, 128);  // one arrival per thread
      cutlass::arch::ClusterBarrier::init(&smem.exchange_empty, 128);
    }
    if constexpr (kActWarps) {
      for (int w = 0; w < 2; ++w) {
        // Every thread of the consumer warpgroup arrives twice (a tail tile's job: every thread of both, once).
        cutlass::arch::ClusterBarrier::init(&smem.act_full[w], 256);
        // every lane of the activation warp (and of the helper warp)
        cutlass::arch::ClusterBarrier::init(&smem.act_empty[w], p.activation_helper_rows > 0 ? 64 : 32);
      }
    }
    if constexpr (kMerge) cutlass::arch::ClusterBarrier::init(&smem.staging_free, 256);  // every consumer thread
    if constexpr (kPairs) {
      // the peer's producer
      for (int s = 0; s < kStages; ++s) cutlass::arch::ClusterBarrier::init(&smem.pair_empty[s], 1);
      for (int s = 0; s < 2; ++s) {
        cutlass::arch::ClusterBarrier::init(&smem.pair_work_full[s], 1);   // rank 0's producer
        cutlass::arch::ClusterBarrier::init(&smem.pair_work_empty[s], 1);  // rank 1's producer
      }
    }
    cutlass::arch::fence_barrier_init();
  }
  // Paired: the peer arrives on this CTA's barriers and writes its stages only once they are initialised.
  if (kPairs && p.pair_rows) {
    cluster_sync();
  } else {
    __syncthreads();
  }

  TileWalker<S, E> walker(args, p.split_half_tiles, merge);
  // Tile order: every grid-th tile (static), or claimed from a global counter as the producer gets to
  // it (GemmConfig::claim_tiles), which keeps CTAs near each other in the tile sequence when tiles
  // differ in length. Both give the same bits: a tile's result does not depend on which CTA
  // computes it.
  const bool claimed = gemm_claims_tiles(S, E) && p.claim_tiles;
  // Every grid-th tile, or with paired row blocks (GemmConfig::pair_rows, launched as 2-CTA clusters) every
  // cluster-count-th pair of row blocks 2q and 2q + 1 in one column tile, of which this CTA takes the one its rank in
  // the cluster names. Past the last real tile of the sequence comes none (a CTA of rank 1 stops where the row
  // blocks are odd in number). Lambdas, so that nothing of this is held in registers across the mainloop.
  auto pair_tile = [&](uint32_t pair) {
    const uint32_t n = walker.n_tiles;
    return (2 * (pair / n) + cluster_rank()) * n + pair % n;
  };
  auto first_tile = [&]() -> uint32_t {
    if constexpr (kPairs) {
      if (p.pair_rows) return pair_tile(blockIdx.x / 2);
    }
    return blockIdx.x;
  };
  auto next_tile = [&](uint32_t t) -> uint32_t {
    if constexpr (kPairs) {
      if (p.pair_rows) {
        const uint32_t n = walker.n_tiles;
        return pair_tile(t / n / 2 * n + t % n + gridDim.x / 2);
      }
    }
    return t + gridDim.x;
  };
  // Each tile goes from the producer to the consumers decoded, with its index in the sequence (-1: past the last
  // tile, so that everyone stops), through a two-slot ring: the n-th tile uses slot n % 2 at parity n / 2 % 2.
  // The producer walks ahead of the consumers; when the consumers walked the sequence themselves, at every tile
  // boundary, both consumer warpgroups and the tensor cores waited ~0.8 us for it (benchmarks/RESULTS.md,
  // twenty-second session).
  auto pass_tile = [&](uint32_t n, int32_t index, const Tile& tile) {
    const int slot = n & 1;
    const uint32_t at = smem_addr(smem.tile_slot[slot]);
    cutlass::arch::ClusterBarrier::wait(&smem.tile_empty[slot], ((n >> 1) & 1) ^ 1);
    st_shared_v4(at, make_uint4(tile.expert, tile.m0, tile.n_tile, tile.k_begin));
    st_shared_v4(at + 16, make_uint4(tile.k_tiles, tile.rows, tile.split, index));
    cutlass::arch::ClusterBarrier::arrive(&smem.tile_full[slot]);
  };
  auto take_tile = [&](uint32_t n, int32_t& index) {
    const int slot = n & 1;
    const uint32_t at = smem_addr(smem.tile_slot[slot]);
    cutlass::arch::ClusterBarrier::wait(&smem.tile_full[slot], (n >> 1) & 1);
    const uint4 w0 = ld_shared_v4(at);
    const uint4 w1 = ld_shared_v4(at + 16);
    __syncwarp();
    if (threadIdx.x % 32 == 0) cutlass::arch::ClusterBarrier::arrive(&smem.tile_empty[slot]);
    index = int32_t(w1.w);
    return Tile{int32_t(w0.x), int32_t(w0.y), int32_t(w0.z), int32_t(w0.w), int32_t(w1.x), int32_t(w1.y), w1.z != 0};
  };
  // Whether the n-th tile has 192 rows, before it is taken: the producer passes a tile before it loads it, so by
  // the previous tile's epilogue it is (nearly always) there, and waiting for it depends on nothing after that.
  auto next_is_merged = [&](uint32_t n) {
    const int slot = n & 1;
    cutlass::arch::ClusterBarrier::wait(&smem.tile_full[slot], (n >> 1) & 1);
    return int32_t(ld_shared(smem_addr(smem.tile_slot[slot]) + 20)) > kGemmTileM;  // Tile::rows
  };

  if (warpgroup == 0) {
    // Exactly what the consumers take: setmaxnreg grows them only from registers the producer gave back. The
    // gathering warp holds more (its copies' addresses), and its consumers fit in 224.
    cutlass::arch::warpgroup_reg_dealloc<GatherA ? 56 : 40>();
    const int ptid = threadIdx.x;
    if (act_warps && ptid >= 32 && ptid < (p.activation_helper_rows > 0 ? 128 : 96)) {
      // Activation warp of consumer warpgroup w: per job, the 64 x 64 gate and up boxes go to h by TMA (when
      // kept), a = bf16(silu(gate) * up) of the bf16 values overwrites the gate box and goes to `out`, and the
      // boxes are handed back once TMA has read them. With the helper (the fourth warp) each job's last
      // activation_helper_rows rows are the helper's: beside the wgmma one warp took ~12 us per job (tile_trace),
      // paced by latency, not by its instructions, so a second warp shortens the time the boxes are held. The
      // owner and the helper meet at named barrier 3 + w: h's stores have read the boxes, then the helper's rows
      // are written.
      const int lane = ptid % 32;
      // Rows [row0, row0 + rows) of a job: per step of 8 rows a lane's 16-byte chunk of two rows, gate and up, four
      // loads issued before any of their values is used (as far as the producer's 40 registers let ptxas). Beside
      // the wgmma's operand reads a load's latency, not the arithmetic, seems to set the loop's pace: 32 rows took
      // 5.1 us with one chunk's loads at a time (~17 cycles per instruction), 4.2 us with two (tile_trace, two
      // boards).
      auto activate = [&](uint32_t gate_box, int row0, int rows) {
        const uint32_t at0 = gate_box + swizzled(row0 + lane / 8, (lane % 8) * 8);
        const uint32_t at1 = gate_box + swizzled(row0 + lane / 8 + 4, (lane % 8) * 8);
        for (int r = 0; r < rows; r += 8) {  // the swizzle repeats every 8 rows
          const uint4 g0 = ld_shared_v4(at0 + r * 128);
          const uint4 u0 = ld_shared_v4(at0 + r * 128 + kBoxBytes);
          const uint4 g1 = ld_shared_v4(at1 + r * 128);
          const uint4 u1 = ld_shared_v4(at1 + r * 128 + kBoxBytes);
          st_shared_v4(at0 + r * 128, silu_times(g0, u0));
          st_shared_v4(at1 + r * 128, silu_times(g1, u1));
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      };
      // barrier.sync, not bar.sync: the owner and the helper reach it from different instructions, which the
      // aligned form does not allow (compute-sanitizer synccheck).
      auto meet = [](int w) { asm volatile("barrier.sync %0, 64;" ::"r"(3 + w) : "memory"); };
      if (ptid >= 96) {
        // The helper takes the owners' jobs as they come (a split half tile's warpgroup 1 posts none).
        uint32_t jobs[2] = {0, 0};
        bool live[2] = {true, true};
        while (live[0] || live[1]) {
          for (int w = 0; w < 2; ++w) {
            if (!live[w] || !__all_sync(0xffffffffu, poll_parity(&smem.act_full[w], jobs[w] & 1))) continue;
            asm volatile("" ::: "memory");
            if (smem.act_job[w][1] < 0) {
              live[w] = false;
              continue;
            }
            meet(w);
            activate(smem_addr(smem.staging[w]), 64 - p.activation_helper_rows, p.activation_helper_rows);
            meet(w);
            cutlass::arch::ClusterBarrier::arrive(&smem.act_empty[w]);
            ++jobs[w];
          }
        }
        return;
      }
      const int w = ptid / 32 - 1;
      const uint32_t gate_box = smem_addr(smem.staging[w]);
      const uint32_t up_box = gate_box + kBoxBytes;
      for (uint32_t job = 0;; ++job) {
        cutlass::arch::ClusterBarrier::wait(&smem.act_full[w], job & 1);
        asm volatile("" ::: "memory");
        const int32_t row0 = smem.act_job[w][0];
        const int32_t col = smem.act_job[w][1];
        if (col < 0) break;
        PRIMEMOE_JOB_TRACE(w == 0 && lane == 0, job, 1);
        if (lane == 0 && args.out_h != nullptr) {
          tma_store(&p.tma_out2, gate_box, col, row0);
          tma_store(&p.tma_out2, up_box, int32_t(args.n) + col, row0);
          store_commit();
          store_wait_read();
        }
        PRIMEMOE_JOB_TRACE(w == 0 && lane == 0, job, 2);
        __syncwarp();
        const bool helped = p.activation_helper_rows > 0;
        if (helped) meet(w);
        activate(gate_box, 0, 64 - p.activation_helper_rows);
        if (helped) meet(w);
        __syncwarp();
        PRIMEMOE_JOB_TRACE(w == 0 && lane == 0, job, 3);
        if (lane == 0) {
          tma_store(&p.tma_out, gate_box, col, row0);
          store_commit();
          store_wait_read();
        }
        PRIMEMOE_JOB_TRACE(w == 0 && lane == 0, job, 4);
        // Each lane releases its own accesses to the boxes (lane 0 once TMA has read them): one arrival by lane 0
        // after __syncwarp orders them as well, but compute-sanitizer racecheck does not follow that ordering.
        cutlass::arch::ClusterBarrier::arrive(&smem.act_empty[w]);
        __syncwarp();
      }
      return;
    }
    if (ptid >= (GatherA ? 32 : 1)) return;
    if (ptid == 0) {
      if (!GatherA) asm volatile("prefetch.tensormap [%0];" ::"l"(&p.tma_a) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"(&p.tma_b) : "memory");
    }
    const auto* tokens = static_cast<const __nv_bfloat16*>(args.a);
    RingPos<kStages> pos;
    int32_t ready_expert = -1;
    uint32_t passed = 0;  // tiles passed to the consumers
    uint32_t merged_tiles = 0;  // 192-row tiles loaded (the parity of staging_free's next phase)
    uint32_t pair_phases = 0;  // paired: bit s is the parity of pair_empty[s]'s next phase
    // Paired and claimed: rank 0 claims each pair and passes it to rank 1 until rank 1's block of it does not exist
    // (past the last row block), after which rank 1 has stopped. handoffs counts the pairs passed / taken.
    uint32_t handoffs = 0;
    bool peer_stopped = false;
    if constexpr (kPairs)
      peer_stopped = claimed && p.pair_rows && cluster_rank() == 0 && first_tile() + walker.n_tiles >= walker.total;
    auto claim_next = [&]() -> uint32_t {
      if constexpr (kPairs) {
        if (p.pair_rows) {
          const int slot = handoffs & 1;
          const uint32_t parity = (handoffs >> 1) & 1;
          int32_t work;
          if (cluster_rank() == 0) {
            work = int32_t(gridDim.x / 2) + atomicAdd(args.tile_counter, 1);
            if (!peer_stopped) {
              wait_cluster(&smem.pair_work_empty[slot], parity ^ 1);
              put_remote(&smem.pair_work[slot], &smem.pair_work_full[slot], work, 1);
              ++handoffs;
              peer_stopped = pair_tile(work) + walker.n_tiles >= walker.total;
            }
          } else {
            wait_cluster(&smem.pair_work_full[slot], parity);
            work = smem.pair_work[slot];
            ++handoffs;
            // The last handoff is not given back: rank 0 no longer waits for it, and may have left.
            if (pair_tile(work) < walker.total) arrive_remote_release(&smem.pair_work_empty[slot], 0);
          }
          return pair_tile(work);
        }
      }
      return gridDim.x + uint32_t(atomicAdd(args.tile_counter, 1));
    };
    // Gathering, the whole warp walks the tiles; lane 0 claims them.
    auto claim_in_warp = [&]() -> uint32_t {
      if constexpr (GatherA) return __shfl_sync(~0u, ptid == 0 ? claim_next() : 0u, 0);
      return claim_next();
    };
    for (uint32_t t = first_tile();; t = claimed ? claim_in_warp() : next_tile(t)) {
      const bool past_last = t >= walker.total;
      const Tile tile = past_last ? Tile{} : walker.at(t);
      if (ptid == 0) pass_tile(passed++, past_last ? -1 : int32_t(t), tile);
      if (past_last) break;
      // Both CTAs of a pair see that its two blocks are one routed expert's (then they share its weight tile).
      bool shared = false;
      if constexpr (kPairs) {
        const int32_t block = int32_t(t / walker.n_tiles);
        if (p.pair_rows && tile.expert < args.num_experts) {
          const int32_t expert_blocks =
              walker.blocks(args.expert_offsets[tile.expert + 1] - args.expert_offsets[tile.expert]);
          shared = cluster_rank() == 0 ? block + 1 < walker.expert_block + expert_blocks : block > walker.expert_block;
        }
      }
      // The rows-ready hook (expert parallelism: rows are placed by the dispatch, never gathered).
      if (S == GemmSchedule::kRows && !GatherA && args.hook.counters != nullptr && tile.k_tiles > 0 &&
          tile.expert != ready_expert) {
        const uint64_t target = uint64_t(*args.hook.epoch) * args.hook.per_epoch;
        wait_at_least(args.hook.counters + tile.expert, target, args.hook.timeout_ns, args.error, args.hook.rank, -1,
                      tile.expert, kWaitGemmRows);
        asm volatile("fence.proxy.async.global;" ::: "memory");
        ready_expert = tile.expert;
      }
      // Gathered A: where each row's token starts in x (in 16-byte units; -1: a padding row, zeros) goes into
      // shared memory once per tile, so that no k-slice waits for a global load before its copies (looked up per
      // k-slice, FC1 ran 2.4x slower than gather_rows + TMA: twenty-fourth session). Lane l copies 16-byte chunk
      // l % 8 of rows l / 8 + 4 i; gather_tokens[(r % 4) * 32 + r / 4] is row r's, so a lane's are consecutive. Rows
      // past a half tile's 64 repeat them (its unsplit form reads 128 rows and stores 64).
      if constexpr (GatherA) {
        __syncwarp();
        if (tile.k_tiles > 0) {
          CUTE_UNROLL
          for (int j = 0; j < 4; ++j) {
            const int r = ptid + 32 * j;
            const int32_t slot = args.a_row_src[tile.m0 + r % tile.rows];
            smem.gather_tokens[(r % 4) * 32 + r / 4] = slot >= 0 ? slot / args.a_src_div * (args.k / 8) : -1;
          }
        }
        __syncwarp();
      }
      const bool merged = kMerge && tile.rows > kGemmTileM;
      for (int32_t kt = 0; kt < tile.k_tiles; ++kt) {
        const int stage = pos.stage;
        uint64_t* bar = &smem.full[stage];
        cutlass::arch::ClusterBarrier::wait(&smem.empty[stage], pos.phase ^ 1);
        if (shared && ptid == 0) {
          // The peer's stage is written too: its consumers must be done with it as well. Each producer arrives on the
          // other's pair_empty once its own consumers are, so a stage's next use waits for this one's on both sides.
          arrive_remote(&smem.pair_empty[stage], cluster_rank() ^ 1);
          cutlass::arch::ClusterBarrier::wait(&smem.pair_empty[stage], (pair_phases >> stage) & 1);
          pair_phases ^= 1u << stage;
        }
        const int32_t k0 = tile.k_begin + kt * kGemmTileK;
        bfloat16_t* sa = smem.a + stage * kSubTileElems;
        if (ptid == 0) {
          if constexpr (S == GemmSchedule::kRows) {
            // A half tile's k-slice is read by one consumer warpgroup, from its own 64 rows of the A tile
            // (warpgroup kt % 2, see the consumers): only those are loaded.
            const uint32_t a_bytes = GatherA       ? 0
                                     : tile.split ? kBoxBytes
                                                  : kStageBytes - kStageBBytes + (merged ? kBoxBytes : 0);
            cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(bar, kStageBBytes + a_bytes);
            if (!GatherA && tile.split) {
              tma_load(&p.tma_a_half, bar, sa + (kt % 2) * (kSubTileElems / 2), k0, tile.m0, 0);
            }
            if (!GatherA && !tile.split) load_tile<true>(&p.tma_a, bar, sa, tile.m0, k0, 0);
          } else {
            cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(bar, kStageBytes);
            load_tile<false>(&p.tma_a, bar, sa, tile.m0, k0, 0);
          }
          for (int j = 0; j < 2; ++j) {
            bfloat16_t* sb = smem.b + (2 * stage + j) * kSubTileElems;
            if constexpr (S == GemmSchedule::kRows) {
              // Weight half j: FC1's up rows are n rows past its gate rows.
              const int32_t n0 = tile.n_tile * gemm_tile_n(E) + j * (E == GemmEpilogue::kSwiGLU ? args.n : 128);
              if (!shared) {
                load_tile<BKMajor>(&p.tma_b, bar, sb, n0, k0, tile.expert);
              } else if (j == int(cluster_rank())) {  // the other half comes from the peer
                tma_load_pair(&p.tma_b, bar, sb, k0, n0, tile.expert);
              }
            } else {
              load_tile<false>(&p.tma_b, bar, sb, tile.n_tile * kGemmTileN + j * 128, k0, 0);
            }
          }
          if (merged) {
            // The tail rows' slice, into the staging boxes once the consumers have released them for this tile.
            if (kt == 0) cutlass::arch::ClusterBarrier::wait(&smem.staging_free, merged_tiles++ & 1);
            tma_load(&p.tma_a_half, bar, &smem.staging[0][0] + stage * (kBoxBytes / 2), k0, tile.m0 + kGemmTileM, 0);
          }
        }
        if constexpr (GatherA) {
          // The 128-byte swizzle TMA would apply: rows r and r + 8 swizzle alike. A split half tile's 64 rows go to
          // the rows of the consumer warpgroup that reads the k-slice (kt % 2).
          const int chunk = ptid % 8;
          const int row0 = (tile.split ? 64 * (kt % 2) : 0) + ptid / 8;
          const uint32_t dst[2] = {smem_addr(sa) + swizzled(row0, 8 * chunk),
                                   smem_addr(sa) + swizzled(row0 + 4, 8 * chunk)};
          const auto* src = reinterpret_cast<const uint4*>(tokens + k0 + 8 * chunk);
          const uint32_t lane_rows = smem_addr(smem.gather_tokens + (ptid / 8) * 32);
          const int quads = tile.split ? 4 : 8;
          CUTE_UNROLL
          for (int q = 0; q < 8; ++q) {
            if (q < quads) {
              const uint4 tok = ld_shared_v4(lane_rows + 16 * q);
              const int32_t row_tokens[4] = {int32_t(tok.x), int32_t(tok.y), int32_t(tok.z), int32_t(tok.w)};
              CUTE_UNROLL
              for (int j = 0; j < 4; ++j) {
                const int i = 4 * q + j;  // rows row0 + 4 i
                cp_async_16_unless_negative(dst[i % 2] + 8 * 128 * (i / 2), src + row_tokens[j], row_tokens[j]);
              }
            }
          }
          cp_async_arrive(bar);
        }
        pos.step(1);
      }
    }
    if constexpr (kPairs) {
      // Rank 1 gives back every handoff but the last; the one before the last is waited for by no later handoff,
      // and rank 1's arrival on it must not find this CTA gone.
      if (claimed && p.pair_rows && cluster_rank() == 0 && handoffs >= 2) {
        wait_cluster(&smem.pair_work_empty[(handoffs - 2) & 1], ((handoffs - 2) >> 1) & 1);
      }
    }
    if constexpr (GatherA) cp_async_wait_all();
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<GatherA ? 224 : 232>();
  // The thread index read again: one derived before the role split would be held across it, in the few registers
  // that the accumulators leave free there (a merged tile's take all but 24 of those below setmaxnreg's).
  uint32_t tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  const int ct = int(tid) - 128;
  const int wg = ct / 128;
  const int wtid = ct % 128;
  using MmaAtom = SM90_64x256x16_F32BF16BF16_SS<major<AKMajor>(), major<BKMajor>()>;
  auto tiled_mma = make_tiled_mma(MmaAtom{}, Layout<Shape<_2, _1, _1>>{});
  auto thr_mma = tiled_mma.get_slice(ct);
  Tensor sA = make_tensor(make_smem_ptr(smem.a), ring_layout<AKMajor, 128, kStages>());
  Tensor sB = make_tensor(make_smem_ptr(smem.b), ring_layout<BKMajor, kGemmTileN, kStages>());
  Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));  // (MMA, 1, 4, stage) descriptors
  Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB));
  // Value i of a thread: row frag_row + 8 * ((i >> 1) & 1), column frag_col + 8 * (i >> 2) + (i & 1)
  // (see the epilogue); values [0, 64) are the first weight half's columns, [64, 128) the second's.
  Tensor acc = partition_fragment_C(tiled_mma, Shape<_128, Int<kGemmTileN>>{});
  constexpr int kHalf = 64;
  // A half tile (an expert's last 64 rows, kRows) is split along K: the warpgroups take alternate
  // k-slices, each finding the tile's rows in its own half of the A tile, and warpgroup 1's partial sums
  // join warpgroup 0's, which alone runs the epilogue. Two accumulator chains keep the tensor cores fed
  // as in a full tile; one warpgroup alone on 64 rows measured slower, and a second accumulator shape
  // (m64n128 per warpgroup, split along N) made ptxas serialise FC1's wgmma.

  // A stage goes back to the producer with one arrival per warp, once the warp's wgmma reading it
  // are done; `count` 2 in a split half tile, whose stages only one warpgroup reads.
  auto release = [&](int s, uint32_t count) {
    __syncwarp();
    if (threadIdx.x % 32 == 0) {
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(&smem.empty[s])), "r"(count)
                   : "memory");
    }
  };
  const int64_t n = args.n;
  // wgmma's accumulator fragment: value i of a thread sits at row frag_row + 8 * ((i >> 1) & 1)
  // of its warpgroup's 64 rows and column frag_col + 8 * (i >> 2) + (i & 1).
  const int frag_row = 16 * (wtid / 32) + (wtid % 32) / 4;
  const int frag_col = 2 * (wtid % 4);
  const uint32_t slots = smem_addr(smem.staging[wg]);
  const auto* in_h = static_cast<const __nv_bfloat16*>(args.in_h);
  // Epilogue (every variant but FC2 dgrad's, below): the accumulator leaves in rounds of two 64 x 64 bf16
  // boxes (one 128-column half of the warpgroup's 64 rows) written into its staging slots (128-byte
  // swizzled, conflict-free) and handed by one thread to TMA stores, which drain while the warpgroup goes
  // on. TMA clips rows past the tensor, and kRows tiles past the routed rows (k_tiles == 0) hold zeros.
  // The last round is deferred: its values wait in registers as bf16 pairs and are stored during the next
  // tile's first k-slice, behind its wgmma, so the tensor cores idle through less of the epilogue. (All
  // rounds deferred held 64 registers beside the accumulator's 128: the row GEMMs spilled, and the weight
  // gradients, which do not, measured 1-5% slower.)
  constexpr bool kDeferred = Pipeline<S, E>::kDeep;
  static_assert(!kDeferred || Pipeline<S, E>::kBoxes == 2, "every round refills the same two boxes");
  // kStore: round r is column half r, scaled by the row weights; kSwiGLU: rounds 0 and 1 are h's gate and
  // up halves (when h is kept), round 2 the activation.
  constexpr int kRounds = E == GemmEpilogue::kSwiGLU ? 3 : 2;
  __nv_bfloat162 held[kHalf / 2];  // the deferred round
  int32_t held_row0 = 0;
  int32_t held_col = 0;  // its first column (with activation warps, the job's)
  bool holding = false;
  // The thread's part of the staging address, made opaque where it is used: else the compiler hoists all 32
  // addresses out of the tile loop and holds them through the mainloop, 32 registers it does not have.
  auto staging_base = [&](uint32_t& at, uint32_t& swizzle) {
    at = slots + frag_row * 128 + frag_col * 2;
    swizzle = (frag_row & 7) << 4;
    asm volatile("" : "+r"(at), "+r"(swizzle));
  };
  // One round: two boxes to columns [col, col + 128) of rows [rows_at, + 64); FC1's round 2 is the activation.
  auto store_round = [&](auto round, auto pair, int32_t rows_at, int32_t col) {
    constexpr int r = decltype(round)::value;
    staging_acquire(wg, wtid);
    uint32_t at, swizzle;
    staging_base(at, swizzle);
    CUTE_UNROLL
    for (int i = 0; i < kHalf; i += 2) {
      const __nv_bfloat162 v = pair(i);
      st_shared(at + pair_offset(i, swizzle), *reinterpret_cast<const uint32_t*>(&v));
    }
    staging_release(wg);
    if (wtid == 0) {
      for (int b = 0; b < 2; ++b) {
        tma_store(E == GemmEpilogue::kSwiGLU && r != 2 ? &p.tma_out2 : &p.tma_out, slots + b * kBoxBytes,
                  col + 64 * b, rows_at);
      }
      store_commit();
    }
  };
  auto store_held = [&] {
    store_round(Int<kRounds - 1>{}, [&](int i) { return held[i / 2]; }, held_row0, held_col);
    holding = false;
  };
  // With activation warps (act_warps), FC1's epilogue hands its tile to the warpgroup's activation warp in two
  // jobs of 64 columns: gate and up pre-activations (bf16) into the two staging boxes, then act_full. The first
  // job goes at the tile's end; the second waits in `held` (16 gate pairs, then 16 up pairs) until the middle of
  // the next tile's k-slices, so that each job has half a tile to finish before the boxes are needed again.
  // The consumers then never compute the activation (it measured 3.9% of FC1 at 235B, 5.9% at 30B, with the
  // tensor cores idle) nor wait for a TMA store between rounds.
  uint32_t act_jobs = 0;
  // The warpgroup's staging boxes are its own again once its activation warp has finished the last job.
  auto await_boxes = [&] { cutlass::arch::ClusterBarrier::wait(&smem.act_empty[wg], (act_jobs & 1) ^ 1); };
  // A job's descriptor (column -1: stop) to the activation warp; the boxes' contents are made visible to TMA first.
  auto post_job = [&](int32_t rows_at, int32_t col) {
    if (wtid == 0) {
      asm volatile("" ::: "memory");
      smem.act_job[wg][0] = rows_at;
      smem.act_job[wg][1] = col;
      asm volatile("" ::: "memory");
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    PRIMEMOE_JOB_TRACE(ct == 0, act_jobs, 0);
    arrive_count(&smem.act_full[wg], 2);
    ++act_jobs;
  };
  auto submit_job = [&](auto gate_pair, auto up_pair, int32_t rows_at, int32_t col) {
    await_boxes();
    uint32_t at, swizzle;
    staging_base(at, swizzle);
    CUTE_UNROLL
    for (int j = 0; j < 32; j += 2) {
      const __nv_bfloat162 g = gate_pair(j);
      const __nv_bfloat162 u = up_pair(j);
      st_shared(at + pair_offset(j, swizzle), *reinterpret_cast<const uint32_t*>(&g));
      st_shared(at + pair_offset(j, swizzle) + kBoxBytes, *reinterpret_cast<const uint32_t*>(&u));
    }
    post_job(rows_at, col);
  };
  auto submit_held = [&] {
    submit_job([&](int j) { return held[j / 2]; }, [&](int j) { return held[16 + j / 2]; }, held_row0, held_col);
    holding = false;
  };
  // The ring position where this tile's k-slices start (both warpgroups step through every tile's).
  RingPos<kStages> ring;
  // A 192-row tile (merge): rows [m0, m0 + 128) as a full tile, and the tail rows [m0 + 128, + 64) split along N,
  // warpgroup w multiplying them by the tile's weight half w (m64n128; FC1: gate, up), their A slices read from the
  // staging boxes. The boxes go to the producer first (the deferred round and the activation jobs done with them),
  // and are written again once both warpgroups are done with the last slice; the tail's epilogue comes first.
  using TailAtom = SM90_64x128x16_F32BF16BF16_SS<GMMA::Major::K, major<BKMajor>()>;
  auto tail_mma = make_tiled_mma(TailAtom{});
  auto thr_tail = tail_mma.get_slice(wtid);
  Tensor sTailA = make_tensor(make_smem_ptr(&smem.staging[0][0]), ring_layout<true, 64, kStages>());
  Tensor sHalfB = make_tensor(make_smem_ptr(smem.b), ring_layout<BKMajor, 128, 2 * kStages>());  // (.., 2 s + j)
  Tensor tTrA = thr_tail.make_fragment_A(thr_tail.partition_A(sTailA));
  Tensor tTrB = thr_tail.make_fragment_B(thr_tail.partition_B(sHalfB));
  auto merged_tile = [&](const Tile& tile, uint32_t taken) {
    if (holding) {
      if (kActWarps && act_warps) {
        submit_held();
      } else {
        store_held();
      }
    }
    if (kActWarps && act_warps) await_boxes();
    if (wtid == 0) store_wait_read();  // the previous tile's activation, when the consumers stored it
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    cutlass::arch::ClusterBarrier::arrive(&smem.staging_free);
    PRIMEMOE_TILE_TRACE(taken, 2, global_ns());
    const int32_t tail_row0 = tile.m0 + kGemmTileM;
    Tensor acc_t = partition_fragment_C(tail_mma, Shape<_64, _128>{});
    CUTE_STATIC_ASSERT_V(size(acc_t) == Int<kHalf>{});
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    tail_mma.accumulate_ = GMMA::ScaleOut::Zero;
    RingPos<kStages> pos = ring;
    int prev_stage = 0;
    uint32_t prev_phase = 0;
    // A do-while: a merged tile has k-slices (K >= 64), and a path around the loop would join the accumulators
    // before the last wait, where ptxas then serialises every wgmma (C7514).
    int32_t kt = 0;
    do {
      const int stage = pos.stage;
      cutlass::arch::ClusterTransactionBarrier::wait(&smem.full[stage], pos.phase);
      if (kt == 0) PRIMEMOE_TILE_TRACE(taken, 3, global_ns());
      warpgroup_fence_operand(acc);
      warpgroup_fence_operand(acc_t);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), acc);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tTrA); ++kb) {
        cute::gemm(tail_mma, tTrA(_, _, kb, stage), tTrB(_, _, kb, 2 * stage + wg), acc_t);
        tail_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_wait<1>();
      warpgroup_fence_operand(acc);
      warpgroup_fence_operand(acc_t);
      if (kt > 0) release(prev_stage, 1);
      prev_stage = stage;
      prev_phase = pos.phase;
      pos.step(1);
    } while (++kt < tile.k_tiles);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
    warpgroup_fence_operand(acc_t);
    PRIMEMOE_TILE_TRACE(taken, 4, global_ns());
    release(prev_stage, 1);
    ring.advance(tile.k_tiles);
    // Both warpgroups' wgmma are done with the staging boxes once the last stage is back.
    cutlass::arch::ClusterBarrier::wait(&smem.empty[prev_stage], prev_phase);
    if constexpr (E == GemmEpilogue::kSwiGLU) {
      // Job w (the tile's activation columns [64 w, + 64)) in staging boxes w: its gate values from warpgroup 0,
      // its up values from warpgroup 1. Both activation warps were done before the boxes went to the producer; the
      // waits say so to compute-sanitizer, which does not follow that through the TMA loads.
      for (int w = 0; w < 2; ++w) cutlass::arch::ClusterBarrier::wait(&smem.act_empty[w], (act_jobs & 1) ^ 1);
      uint32_t at, swizzle;
      staging_base(at, swizzle);
      at += (smem_addr(smem.staging[0]) - slots) + wg * kBoxBytes;
      CUTE_UNROLL
      for (int i = 0; i < kHalf; i += 2) {  // values [0, 32): columns [0, 64), job 0; [32, 64): job 1
        const __nv_bfloat162 v = pack(acc_t(i), acc_t(i + 1));
        st_shared(at + (i / 32) * 2 * kBoxBytes + pair_offset(i % 32, swizzle), *reinterpret_cast<const uint32_t*>(&v));
      }
      if (p.merged_activation == MergedActivation::kWarps) {
        if (wtid == 0) {
          asm volatile("" ::: "memory");
          smem.act_job[wg][0] = tail_row0;
          smem.act_job[wg][1] = tile.n_tile * 128 + 64 * wg;
          asm volatile("" ::: "memory");
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        cutlass::arch::ClusterBarrier::arrive(&smem.act_full[0]);
        cutlass::arch::ClusterBarrier::arrive(&smem.act_full[1]);
        ++act_jobs;
      } else {
        // The consumers compute the tail's activation: handed to the activation warps, its two jobs held all four
        // boxes while the 128 rows' first job waited for them (~9.4 us of epilogue per merged tile, tile_trace).
        // Warpgroup w takes job w (boxes w) once both warpgroups' values are in: h's two stores, the activation
        // into registers while they read the boxes, then a over the gate box.
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        asm volatile("bar.sync 5, 256;" ::: "memory");
        const uint32_t gate_box = smem_addr(smem.staging[wg]);
        const int32_t tail_col = tile.n_tile * 128 + 64 * wg;
        if (wtid == 0 && args.out_h != nullptr) {
          tma_store(&p.tma_out2, gate_box, tail_col, tail_row0);
          tma_store(&p.tma_out2, gate_box + kBoxBytes, int32_t(args.n) + tail_col, tail_row0);
          store_commit();
        }
        uint4 a[4];
        CUTE_UNROLL
        for (int q = 0; q < 4; ++q) {  // 16-byte chunks wtid + 128 q of the box: 64 rows x 8, swizzled
          const int c = wtid + 128 * q;
          const uint32_t chunk = gate_box + swizzled(c / 8, (c % 8) * 8);
          a[q] = silu_times(ld_shared_v4(chunk), ld_shared_v4(chunk + kBoxBytes));
        }
        staging_acquire(wg, wtid);  // h's stores have read the boxes
        CUTE_UNROLL
        for (int q = 0; q < 4; ++q) {
          const int c = wtid + 128 * q;
          st_shared_v4(gate_box + swizzled(c / 8, (c % 8) * 8), a[q]);
        }
        staging_release(wg);
        if (wtid == 0) {
          tma_store(&p.tma_out, gate_box, tail_col, tail_row0);
          store_commit();
        }
        staging_acquire(wg, wtid);  // the 128 rows' first job goes into these boxes next
      }
    } else {
      float tail_scale[2] = {1.0f, 1.0f};
      if (args.row_weight != nullptr) {
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) tail_scale[h] = args.row_weight[tail_row0 + frag_row + 8 * h];
      }
      auto scaled_pair = [&](int v) {
        const float scale = (v >> 1) & 1 ? tail_scale[1] : tail_scale[0];
        return pack(acc_t(v) * scale, acc_t(v + 1) * scale);
      };
      store_round(Int<0>{}, scaled_pair, tail_row0, tile.n_tile * kGemmTileN + 128 * wg);
    }
  };
  uint32_t exchanges = 0;  // split half tiles: partial-sum rounds passed between the warpgroups
  for (uint32_t taken = 0;; ++taken) {
    int32_t t;
    const Tile tile = take_tile(taken, t);
    PRIMEMOE_TILE_TRACE(taken, 1, global_ns());
    if (t < 0) break;
    PRIMEMOE_TILE_TRACE(taken, 0, uint64_t(uint32_t(t)) | uint64_t(tile.rows) << 32 | sm_id() << 48);
    // A half tile: split along K (kSplitHalves and GemmConfig), else multiplied as a full tile
    // whose second 64 rows (the next expert's, or past the layout) warpgroup 1 does not store.
    const bool half = S == GemmSchedule::kRows && tile.rows <= kGemmRowAlign;
    const bool split = tile.split;
    const int32_t row0 = (S == GemmSchedule::kRows ? tile.m0 : tile.expert * args.m + tile.m0) + (split ? 0 : 64 * wg);
    // Warpgroup 1 of a half tile only multiplies and stores nothing.
    const bool epilogue = !half || wg == 0;
    // Past the routed rows the epilogue's inputs are undefined: zeros are used instead of them.
    const bool routed = tile.k_tiles > 0;
    // The routing weights of the thread's two rows (FC2, FC2 dgrad), loaded before the mainloop so that
    // the epilogue does not wait a memory round trip for them.
    float row_scale[2] = {1.0f, 1.0f};
    if (S == GemmSchedule::kRows && E != GemmEpilogue::kSwiGLU && args.row_weight != nullptr) {
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int64_t r = int64_t(row0) + frag_row + 8 * h;
        row_scale[h] = routed && r < args.num_rows ? args.row_weight[r] : 0.0f;
      }
    }
    // FC2 dgrad: quarter q's gate / up pre-activations into boxes 0 / 1 (64 rows x 8 chunks of 16 bytes
    // per box, 128 threads), all in flight at once.
    auto load_quarter = [&](int q) {
      const int32_t col0 = tile.n_tile * kGemmTileN + 64 * q;
#pragma unroll 1
      for (int v = 0; v < 4; ++v) {
        const int idx = wtid + 128 * v;
        const int r = idx / 8;
        const int chunk = idx % 8;
        const int64_t grow = int64_t(row0) + r;
        const bool real = routed && grow < args.num_rows;
        const __nv_bfloat16* src = real ? in_h + grow * 2 * n + col0 + chunk * 8 : in_h;
        const uint32_t dst = slots + swizzled(r, chunk * 8);
        cp_async_16(dst, src, real ? 16 : 0);
        cp_async_16(dst + kBoxBytes, real ? src + n : in_h, real ? 16 : 0);
      }
    };
    constexpr bool kLoadsQuarters = E == GemmEpilogue::kSwiGLUBackward;
    // The first quarter's loads overlap the mainloop: issued once the first k-slice's wgmma are (or
    // before an empty mainloop), after the previous tile's stores have read the boxes.
    auto prefetch_first_quarter = [&] {
      staging_acquire(wg, wtid);
      load_quarter(0);
    };
    // The epilogue of the tile's (first) 128 rows, every variant but FC2 dgrad's.
    auto deferred_epilogue = [&] {
      // Before a 192-row tile the consumers compute the activation (three store rounds, none deferred): as jobs,
      // this tile's two held the boxes that the next one's tail slices need, one job after the other, while its
      // mainloop waited (~9-13 us per merged tile, tile_trace).
      const bool jobs = kActWarps && act_warps &&
                        !(kMerge && merge && p.merged_activation == MergedActivation::kConsumers &&
                          next_is_merged(taken + 1));
      if (jobs) {
        auto gate = [&](int i) { return pack(acc(i), acc(i + 1)); };
        auto up = [&](int i) { return pack(acc(kHalf + i), acc(kHalf + i + 1)); };
        submit_job(gate, up, row0, tile.n_tile * 128);
        CUTE_UNROLL
        for (int j = 0; j < 32; j += 2) {
          held[j / 2] = gate(32 + j);
          held[16 + j / 2] = up(32 + j);
        }
      } else if constexpr (E == GemmEpilogue::kSwiGLU) {
        if (kActWarps && act_warps) await_boxes();  // the activation warps' last job is done with the boxes
        // The pre-activations, rounded to bf16 as kept for the backward, and the activation from them.
        if (args.out_h != nullptr) {
          // h: the gate half at column n_tile * 128, the up half n columns further; a: n_tile * 128.
          store_round(Int<0>{}, [&](int i) { return pack(acc(i), acc(i + 1)); }, row0, tile.n_tile * 128);
          store_round(Int<1>{}, [&](int i) { return pack(acc(kHalf + i), acc(kHalf + i + 1)); }, row0,
                      int32_t(n) + tile.n_tile * 128);
        }
        CUTE_UNROLL
        for (int i = 0; i < kHalf; i += 2) {
          const float2 g = __bfloat1622float2(pack(acc(i), acc(i + 1)));
          const float2 u = __bfloat1622float2(pack(acc(kHalf + i), acc(kHalf + i + 1)));
          held[i / 2] = pack(silu(g.x) * u.x, silu(g.y) * u.y);
        }
      } else {
        auto scaled_pair = [&](int v) {
          const float scale = (v >> 1) & 1 ? row_scale[1] : row_scale[0];
          return pack(acc(v) * scale, acc(v + 1) * scale);
        };
        store_round(Int<0>{}, scaled_pair, row0, tile.n_tile * kGemmTileN);
        CUTE_UNROLL
        for (int i = 0; i < kHalf; i += 2) held[i / 2] = scaled_pair(kHalf + i);
      }
      held_row0 = row0;
      held_col = E != GemmEpilogue::kSwiGLU ? tile.n_tile * kGemmTileN + 128
                 : jobs                     ? tile.n_tile * 128 + 64
                                            : tile.n_tile * 128;
      holding = true;
      if (kActWarps && act_warps && !jobs) store_held();
    };
    // A merged tile goes straight to its epilogue: from no other path does a deferred round reach the next tile
    // through its mainloop, whose accumulators leave no registers for one.
    if (kMerge && tile.rows > kGemmTileM) {
      merged_tile(tile, taken);
      deferred_epilogue();
      continue;
    }
    if (kLoadsQuarters && !routed) prefetch_first_quarter();
    if (tile.k_tiles == 0) clear(acc);
    const int32_t kt_first = split ? wg : 0;
    const int32_t kt_step = split ? 2 : 1;
    const uint32_t arrivals = split ? 2 : 1;
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    int prev_stage = -1;
    RingPos<kStages> pos = ring;
    pos.step(kt_first);
    auto k_slice = [&](int32_t kt, auto submits) {
      const int stage = pos.stage;
      cutlass::arch::ClusterTransactionBarrier::wait(&smem.full[stage], pos.phase);
      if (kt == kt_first) PRIMEMOE_TILE_TRACE(taken, 3, global_ns());
      // Gathered rows were written by cp.async (the generic proxy); wgmma reads them through the async proxy.
      if constexpr (GatherA) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      warpgroup_fence_operand(acc);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), acc);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      if constexpr (decltype(submits)::value) {
        if (holding) submit_held();
      } else {
        if (kLoadsQuarters && epilogue && kt == kt_first) prefetch_first_quarter();
        if (kDeferred && holding && !act_warps) store_held();
      }
      // Keep one k-tile of wgmma in flight; the one before it is done, so its stage goes back.
      warpgroup_wait<1>();
      warpgroup_fence_operand(acc);
      if (prev_stage >= 0) release(prev_stage, arrivals);
      prev_stage = stage;
      pos.step(kt_step);
    };
    if (kActWarps && act_warps) {
      // The held job goes in the middle of this warpgroup's k-slices (a separate iteration, so that the loops
      // around it carry nothing of it).
      const int32_t count = tile.k_tiles > kt_first ? (tile.k_tiles - kt_first + kt_step - 1) / kt_step : 0;
      const int32_t kt_mid = kt_first + kt_step * (count / 2);
      int32_t kt = kt_first;
      for (; kt < kt_mid; kt += kt_step) k_slice(kt, cute::false_type{});
      if (kt < tile.k_tiles) {
        k_slice(kt, cute::true_type{});
        kt += kt_step;
      }
      for (; kt < tile.k_tiles; kt += kt_step) k_slice(kt, cute::false_type{});
    } else {
      for (int32_t kt = kt_first; kt < tile.k_tiles; kt += kt_step) k_slice(kt, cute::false_type{});
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
    PRIMEMOE_TILE_TRACE(taken, 4, global_ns());
    if (prev_stage >= 0) release(prev_stage, arrivals);
    ring.advance(tile.k_tiles);
    // This warpgroup had no k-slice in the tile.
    if (kDeferred && holding) {
      if (kActWarps && act_warps) {
        submit_held();
      } else {
        store_held();
      }
    }
    if (split) {
      // Warpgroup 1's partial sums (if it had a k-slice) join warpgroup 0's through its own staging boxes,
      // as many values per thread per round as they hold; thread-major, so the accesses are conflict-free.
      // The rounds pass through two mbarriers (each thread arrives: its own accesses are released), so
      // warpgroup 1 refills the boxes only after warpgroup 0 has read them, and leaves once the last
      // round is read (its next writes to the boxes come after). Pairs of bar.sync 3, 256 ordered them
      // as well, but compute-sanitizer racecheck reports RAW hazards on that form, also in a small kernel
      // whose exchanged values all check out (scripts/racecheck_probe.cu); this form is racecheck-clean.
      constexpr int kPerRound = Pipeline<S, E>::kBoxes * kBoxBytes / (128 * 4);
      const uint32_t part = smem_addr(smem.staging[1]) + 4 * wtid;
      if (wg == 1) staging_acquire(1, wtid);
      // The activation warp is done with these boxes.
      if (kActWarps && act_warps && wg == 1) await_boxes();
      CUTE_UNROLL
      for (int v0 = 0; v0 < size(acc); v0 += kPerRound) {
        const uint32_t parity = exchanges & 1;
        if (wg == 1) {
          cutlass::arch::ClusterBarrier::wait(&smem.exchange_empty, parity ^ 1);
          CUTE_UNROLL
          for (int v = 0; v < kPerRound; ++v) st_shared(part + 512 * v, __float_as_uint(acc(v0 + v)));
          cutlass::arch::ClusterBarrier::arrive(&smem.exchange_full);
        } else {
          cutlass::arch::ClusterBarrier::wait(&smem.exchange_full, parity);
          if (tile.k_tiles > 1) {
            CUTE_UNROLL
            for (int v = 0; v < kPerRound; ++v) acc(v0 + v) += __uint_as_float(ld_shared(part + 512 * v));
          }
          cutlass::arch::ClusterBarrier::arrive(&smem.exchange_empty);
        }
        ++exchanges;
      }
      if (wg == 1) cutlass::arch::ClusterBarrier::wait(&smem.exchange_empty, (exchanges & 1) ^ 1);
    }
    if (!epilogue) continue;
    if constexpr (kDeferred) {
      deferred_epilogue();
    } else {
      // acc = da (unweighted) for activation columns [n_tile * 256, +256), done a 64-column
      // quarter at a time: slot 0 / 1 take that quarter's gate / up pre-activations (coalesced
      // loads, straight into shared memory: one memory round trip per quarter), are overwritten in
      // place by their gradients, slot 2 takes weight * a.
      float dot[2] = {0.0f, 0.0f};
      CUTE_UNROLL
      for (int q = 0; q < 4; ++q) {
        const int32_t col0 = tile.n_tile * kGemmTileN + 64 * q;
        if (q > 0) {
          staging_acquire(wg, wtid);
          load_quarter(q);
        }
        cp_async_wait_all();
        wg_sync(wg);
        // This quarter is accumulator values [32 q, +32): column groups of 8.
        CUTE_UNROLL
        for (int i = 32 * (q % 2); i < 32 * (q % 2) + 32; i += 2) {
          const float da0 = acc(kHalf * (q / 2) + i);
          const float da1 = acc(kHalf * (q / 2) + i + 1);
          const int row_half = (i >> 1) & 1;  // a thread holds two rows, 8 apart: value mode (2 cols, 2 rows, n/8)
          const int r = frag_row + 8 * row_half;
          const int c = (frag_col + 8 * (i >> 2)) % 64;
          const float2 g = __bfloat1622float2(get_pair(slots, 0, r, c));
          const float2 u = __bfloat1622float2(get_pair(slots, 1, r, c));
          const float s0 = __fdividef(1.0f, 1.0f + exp_neg(g.x));
          const float s1 = __fdividef(1.0f, 1.0f + exp_neg(g.y));
          const float2 a = __bfloat1622float2(pack(g.x * s0 * u.x, g.y * s1 * u.y));
          dot[row_half] += da0 * a.x + da1 * a.y;
          const float dw0 = da0 * row_scale[row_half];
          const float dw1 = da1 * row_scale[row_half];
          put_pair(slots, 0, r, c,
                   pack(dw0 * u.x * s0 * (1.0f + g.x * (1.0f - s0)), dw1 * u.y * s1 * (1.0f + g.y * (1.0f - s1))));
          put_pair(slots, 1, r, c, pack(dw0 * g.x * s0, dw1 * g.y * s1));
          put_pair(slots, 2, r, c, pack(row_scale[row_half] * a.x, row_scale[row_half] * a.y));
        }
        staging_release(wg);
        if (wtid == 0) {
          tma_store(&p.tma_out2, slots, col0, row0);
          tma_store(&p.tma_out2, slots + kBoxBytes, int32_t(n) + col0, row0);
          tma_store(&p.tma_out, slots + 2 * kBoxBytes, col0, row0);
          store_commit();
        }
      }
      // The four threads of a quad share its rows; a fixed butterfly keeps the sum deterministic.
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        dot[h] += __shfl_xor_sync(0xffffffffu, dot[h], 1);
        dot[h] += __shfl_xor_sync(0xffffffffu, dot[h], 2);
        const int64_t r = int64_t(row0) + frag_row + 8 * h;
        if ((threadIdx.x & 3) == 0 && r < args.num_rows) args.out_dot[r * (n / kGemmTileN) + tile.n_tile] = dot[h];
      }
    }
  }
  if (kActWarps && act_warps) {
    if (holding) submit_held();
    await_boxes();
    post_job(0, -1);
  } else if (kDeferred && holding) {
    store_held();
  }
  // The staging slots must outlive the TMA stores that read them.
  if ((ct % 128) == 0) store_wait_read();
#endif
}

// How many clusters of `kernel` fit at once (0: none, or the query failed; its error cleared). The query
// enqueues nothing, but a global-mode graph capture forbids calls it does not know to be safe on every thread:
// this thread's mode is relaxed around it, so a launch captured before any eager one pairs as well.
template <typename Kernel>
int max_active_clusters(Kernel kernel, const cudaLaunchConfig_t& config) {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  const bool exchanged = cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) clusters = 0;
  if (exchanged) cudaThreadExchangeStreamCaptureMode(&mode);
  cudaGetLastError();
  return std::max(clusters, 0);
}

template <GemmSchedule S, GemmEpilogue E, bool BKMajor, bool GatherA>
cudaError_t launch(const GemmParams& params, int grid, cudaStream_t stream) {
  static_assert(kSmemBytes<S, E> <= 227 * 1024, "shared memory ring too large");
  auto kernel = grouped_gemm_kernel<S, E, BKMajor, GatherA>;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  static std::atomic<bool> smem_set_on[kMaxDevices];  // the attribute is per device: set once on each
  if (device >= kMaxDevices) return cudaErrorInvalidDevice;
  if (!smem_set_on[device].load(std::memory_order_acquire)) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemBytes<S, E>));
    if (err != cudaSuccess) return err;
    smem_set_on[device].store(true, std::memory_order_release);
  }
  if (params.pair_rows) {
    // 2-CTA clusters, as many as fit at once (1 CTA per SM), asked once per device and variant.
    static std::atomic<int> clusters_on[kMaxDevices];
    cudaLaunchAttribute cluster{};
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = 2;
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(2 * ((grid + 1) / 2));
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = kSmemBytes<S, E>;
    config.stream = stream;
    config.attrs = &cluster;
    config.numAttrs = 1;
    int clusters = clusters_on[device].load(std::memory_order_relaxed);
    if (clusters == 0) {
      clusters = max_active_clusters(kernel, config);
      if (clusters == 0) clusters = -1;  // no cluster of this kernel fits: the unpaired launch
      clusters_on[device].store(clusters, std::memory_order_relaxed);
    }
    if (clusters > 0) {
      config.gridDim = dim3(2 * std::min(clusters, (grid + 1) / 2));
      err = cudaLaunchKernelEx(&config, kernel, params);
      if (err != cudaSuccess) {
        cudaGetLastError();  // returned here; left set, the next launch would report it
        return err;
      }
      count_paired_gemm_launch(device);
      return cudaGetLastError();
    }
  }
  // Unpaired, also where a paired launch finds no cluster: every grid-th tile, each CTA loading its whole weight tile.
  GemmParams unpaired = params;
  unpaired.pair_rows = false;
  kernel<<<grid, kThreads, kSmemBytes<S, E>, stream>>>(unpaired);
  return cudaGetLastError();
}

}  // namespace primemoe::sm90
