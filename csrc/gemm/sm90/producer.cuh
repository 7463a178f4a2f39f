// Warpgroup 0, the producer: thread 0 walks the tiles, passes each to the consumers and issues its TMA loads into
// the ring of stages; in FC1, warps 1-3 compute the activation from the consumers' pre-activations.
#pragma once

#include "activation.cuh"
#include "tile_walker.cuh"
#include "../../kernels/device_wait.cuh"

namespace primemoe::sm90 {

// FC1's activation warps. Warp 1 + w serves consumer warpgroup w: per job, the 64 x 64 gate and up boxes go to h by
// TMA (when kept), a = bf16(silu(gate) * up) overwrites the gate box and goes to `out`, and the boxes are handed
// back once TMA has read them. Warp 3, the helper, takes the last kActivationHelperRows rows of every job of both
// (a job's latency, not its instructions, bounds it beside the wgmma, so two warps hold the boxes about half as
// long); owner and helper meet at named barrier 3 + w: h's stores have read the boxes, then the helper's rows are in.
template <typename Smem>
__device__ __forceinline__ void activation_warps(const GemmParams& p, Smem& smem, int ptid) {
  const GroupedGemmArgs& args = p.args;
  const int lane = ptid % 32;
  // Rows [row0, row0 + rows) of a job: per step of 8 rows a lane's 16-byte chunk of two rows, gate and up, four
  // loads issued before any of their values is used (a load's latency sets the loop's pace beside the wgmma).
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
    fence_proxy_async_shared();
  };
  // Unaligned: the owner and the helper reach it from different instructions (compute-sanitizer synccheck).
  auto meet = [](int w) { named_barrier_unaligned<64>(3 + w); };
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
        activate(smem_addr(smem.staging[w]), 64 - kActivationHelperRows, kActivationHelperRows);
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
    if (lane == 0 && args.out_h != nullptr) {
      tma_store(&p.tma_out2, gate_box, col, row0);
      tma_store(&p.tma_out2, up_box, int32_t(args.n) + col, row0);
      store_commit();
      store_wait_read();
    }
    __syncwarp();
    meet(w);
    activate(gate_box, 0, 64 - kActivationHelperRows);
    meet(w);
    __syncwarp();
    if (lane == 0) {
      tma_store(&p.tma_out, gate_box, col, row0);
      store_commit();
      store_wait_read();
    }
    // Each lane releases its own accesses to the boxes (lane 0 once TMA has read them): compute-sanitizer racecheck
    // does not follow the ordering of one arrival after __syncwarp.
    cutlass::arch::ClusterBarrier::arrive(&smem.act_empty[w]);
    __syncwarp();
  }
}

// Thread 0: every grid-th tile, or (Claim) the next one claimed from GroupedGemmArgs::tile_counter, which keeps the
// CTAs near each other in the sequence when tiles differ in length. Both orders give the same bits.
template <GemmSchedule S, GemmEpilogue E, bool BKMajor, bool Claim, bool Merge, typename Smem>
__device__ __forceinline__ void tma_producer(const GemmParams& p, Smem& smem, TileWalker<S, E, Merge>& walker,
                                             TileRing<Smem>& tiles) {
  constexpr int kStages = Pipeline<S, E>::kStages;
  const GroupedGemmArgs& args = p.args;
  prefetch_tensormap(&p.tma_a);
  prefetch_tensormap(&p.tma_b);
  RingPos<kStages> pos;
  int32_t ready_expert = -1;
  uint32_t passed = 0;        // tiles passed to the consumers
  uint32_t merged_tiles = 0;  // 192-row tiles loaded (the parity of staging_free's next phase)
  for (uint32_t t = blockIdx.x;; t = Claim ? gridDim.x + uint32_t(atomicAdd(args.tile_counter, 1)) : t + gridDim.x) {
    const bool past_last = t >= walker.total;
    const Tile tile = past_last ? Tile{} : walker.at(t);
    tiles.pass(passed++, past_last ? -1 : int32_t(t), tile);
    if (past_last) break;
    // The rows-ready hook (expert parallelism): an expert's first rows wait for its arrival counter.
    if (S == GemmSchedule::kRows && args.hook.counters != nullptr && tile.k_tiles > 0 &&
        tile.expert != ready_expert) {
      const uint64_t target = uint64_t(*args.hook.epoch) * args.hook.per_epoch;
      wait_at_least(args.hook.counters + tile.expert, target, args.hook.timeout_ns, args.error, args.hook.rank, -1,
                    tile.expert, kWaitGemmRows);
      fence_proxy_async_global();
      ready_expert = tile.expert;
    }
    const bool merged = Merge && tile.rows > kGemmTileM;
    for (int32_t kt = 0; kt < tile.k_tiles; ++kt) {
      const int stage = pos.stage;
      uint64_t* bar = &smem.full[stage];
      cutlass::arch::ClusterBarrier::wait(&smem.empty[stage], pos.phase ^ 1);
      const int32_t k0 = tile.k_begin + kt * kGemmTileK;
      bfloat16_t* sa = smem.a + stage * kSubTileElems;
      if constexpr (S == GemmSchedule::kRows) {
        // A split half tile's k-slice is read by one consumer warpgroup, from its own 64 rows of the A tile
        // (warpgroup kt % 2): only those are loaded.
        const uint32_t a_bytes = tile.split ? kBoxBytes : kStageBytes - kStageBBytes + (merged ? kBoxBytes : 0);
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(bar, kStageBBytes + a_bytes);
        if (tile.split) {
          tma_load(&p.tma_a_half, bar, sa + (kt % 2) * (kSubTileElems / 2), k0, tile.m0, 0);
        } else {
          load_tile<true>(&p.tma_a, bar, sa, tile.m0, k0, 0);
        }
      } else {
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(bar, kStageBytes);
        load_tile<false>(&p.tma_a, bar, sa, tile.m0, k0, 0);
      }
      for (int j = 0; j < 2; ++j) {
        bfloat16_t* sb = smem.b + (2 * stage + j) * kSubTileElems;
        if constexpr (S == GemmSchedule::kRows) {
          // Weight half j: FC1's up rows are n rows past its gate rows.
          const int32_t n0 = tile.n_tile * gemm_tile_n(E) + j * (E == GemmEpilogue::kSwiGLU ? args.n : 128);
          load_tile<BKMajor>(&p.tma_b, bar, sb, n0, k0, tile.expert);
        } else {
          load_tile<false>(&p.tma_b, bar, sb, tile.n_tile * kGemmTileN + j * 128, k0, 0);
        }
      }
      if (merged) {
        // The tail rows' slice, into the staging boxes once the consumers have released them for this tile.
        if (kt == 0) cutlass::arch::ClusterBarrier::wait(&smem.staging_free, merged_tiles++ & 1);
        tma_load(&p.tma_a_half, bar, &smem.staging[0][0] + stage * (kBoxBytes / 2), k0, tile.m0 + kGemmTileM, 0);
      }
      pos.step(1);
    }
  }
}

}  // namespace primemoe::sm90
