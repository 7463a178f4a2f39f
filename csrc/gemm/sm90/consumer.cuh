// Warpgroups 1 and 2, the consumers: each owns 64 rows of the 128 x 256 tile as one 64 x 256 fp32 accumulator
// (m64n256 wgmma from shared memory: least shared-memory traffic per FLOP) whose column halves are the tile's two
// 128-row weight loads (FC1: gate and up of the same activation columns, so SwiGLU needs no shuffle), and hands its
// epilogue to TMA stores through swizzled staging boxes, which drain while the next tile's mainloop runs.
//
// Tiles of three heights: 128 rows (one 64-row accumulator per warpgroup); 64 (an expert's last rows, a half tile:
// where the ring depth allows, split along K, the warpgroups taking alternate k-slices from their own halves of the A
// tile and warpgroup 1's partial sums joining warpgroup 0's, which alone runs the epilogue; else multiplied as a full
// tile whose second half nobody stores); 192 (Merge: the first 128 rows as a full tile, the tail 64 rows split along
// N between the warpgroups, m64n128, their A slices in the staging boxes).
#pragma once

#include <cute/atom/mma_atom.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include "activation.cuh"
#include "epilogue_swiglu_bwd.cuh"
#include "pipeline.cuh"

namespace primemoe::sm90 {

template <GemmSchedule S, GemmEpilogue E, bool BKMajor, bool Merge, typename Smem>
__device__ __forceinline__ void consumer_warpgroups(const GemmParams& p, Smem& smem, TileRing<Smem>& tiles) {
  constexpr bool AKMajor = S == GemmSchedule::kRows;
  constexpr int kStages = Pipeline<S, E>::kStages;
  constexpr bool kActWarps = gemm_activation_warps(S, E);
  const GroupedGemmArgs& args = p.args;
  // The thread index read again: one derived before the role split would be held across it, in the few registers
  // that the accumulators leave free (a merged tile's take all but 24 of those below setmaxnreg's).
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
  // Value i of a thread: row frag_row + 8 * ((i >> 1) & 1), column frag_col + 8 * (i >> 2) + (i & 1) of its
  // warpgroup's 64 rows; values [0, 64) are the first weight half's columns, [64, 128) the second's.
  Tensor acc = partition_fragment_C(tiled_mma, Shape<_128, Int<kGemmTileN>>{});
  constexpr int kHalf = 64;
  const int frag_row = 16 * (wtid / 32) + (wtid % 32) / 4;
  const int frag_col = 2 * (wtid % 4);

  // A stage goes back to the producer with one arrival per warp once the warp's wgmma reading it are done; `count`
  // 2 in a split half tile, whose stages only one warpgroup reads.
  auto release = [&](int s, uint32_t count) {
    __syncwarp();
    if (threadIdx.x % 32 == 0) arrive_count(&smem.empty[s], count);
  };
  const int64_t n = args.n;
  const uint32_t slots = smem_addr(smem.staging[wg]);
  // Epilogue (every variant but FC2 dgrad's): the accumulator leaves in rounds of two 64 x 64 bf16 boxes (one
  // 128-column half of the warpgroup's 64 rows) written into its staging boxes and handed by one thread to TMA
  // stores. TMA clips rows past the tensor, and kRows tiles past the routed rows (k_tiles == 0) hold zeros. The last
  // round is deferred: its values wait in registers as bf16 pairs and are stored during the next tile's first
  // k-slice, behind its wgmma, so the tensor cores idle through less of the epilogue.
  constexpr bool kDeferred = Pipeline<S, E>::kDeep;
  static_assert(!kDeferred || Pipeline<S, E>::kBoxes == 2, "every round refills the same two boxes");
  // kStore: round r is column half r, scaled by the row weights; kSwiGLU: rounds 0 and 1 are h's gate and up halves
  // (when h is kept), round 2 the activation.
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
  // Published results (GroupedGemmArgs::done), by each warpgroup's thread 0: a tile's 64 rows of this warpgroup once
  // both its store rounds are written. The second round goes out during the next tile, so a tile is published after
  // the next one's first round (by then long written), or at the end.
  constexpr bool kPublishes = S == GemmSchedule::kRows && E == GemmEpilogue::kStore;
  const bool publishes = kPublishes && args.done.flags != nullptr && wtid == 0;
  int32_t unpublished = -1;  // the row block of this warpgroup's last stored tile
  auto publish = [&](int32_t block) {
    fence_proxy_async_global();  // the bulk stores' writes, before the release below
    __threadfence();
    int32_t* count = args.done.counts + block;
    if (atomicAdd(count, 1) + 1 == args.done.cols) {
      *count = 0;  // every column tile of the block is in: zero for the next GEMM that publishes here
      store_release(args.done.flags + block, uint64_t(*args.done.epoch));
    }
  };
  // FC1 hands its tile to the warpgroup's activation warp in two jobs of 64 columns: gate and up pre-activations
  // (bf16) into the two staging boxes, then act_full. The first job goes at the tile's end; the second waits in
  // `held` (16 gate pairs, then 16 up pairs) until the middle of the next tile's k-slices, so that each job has half
  // a tile to finish before the boxes are needed again.
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
    fence_proxy_async_shared();
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
  // Whatever of the previous tile is still held goes out (FC1: as a job, else as a store round).
  auto flush_held = [&] {
    if constexpr (kActWarps) {
      submit_held();
    } else {
      store_held();
    }
  };
  // The ring position where this tile's k-slices start (both warpgroups step through every tile's).
  RingPos<kStages> ring;
  // A 192-row tile: rows [m0, m0 + 128) as a full tile, the tail rows [m0 + 128, + 64) split along N, warpgroup w
  // multiplying them by the tile's weight half w (m64n128; FC1: gate, up), their A slices read from the staging
  // boxes. The boxes go to the producer first (the deferred round and the activation jobs done with them), and are
  // written again once both warpgroups are done with the last slice; the tail's epilogue comes first.
  using TailAtom = SM90_64x128x16_F32BF16BF16_SS<GMMA::Major::K, major<BKMajor>()>;
  auto tail_mma = make_tiled_mma(TailAtom{});
  auto thr_tail = tail_mma.get_slice(wtid);
  Tensor sTailA = make_tensor(make_smem_ptr(&smem.staging[0][0]), ring_layout<true, 64, kStages>());
  Tensor sHalfB = make_tensor(make_smem_ptr(smem.b), ring_layout<BKMajor, 128, 2 * kStages>());  // (.., 2 s + j)
  Tensor tTrA = thr_tail.make_fragment_A(thr_tail.partition_A(sTailA));
  Tensor tTrB = thr_tail.make_fragment_B(thr_tail.partition_B(sHalfB));
  auto merged_tile = [&](const Tile& tile) {
    if (holding) flush_held();
    if constexpr (kActWarps) await_boxes();
    if (wtid == 0) store_wait_read();  // the previous tile's activation, when the consumers stored it
    fence_proxy_async_shared();
    cutlass::arch::ClusterBarrier::arrive(&smem.staging_free);
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
      // The consumers compute the tail's activation (as two jobs of the activation warps it would hold all four
      // boxes while the 128 rows' first job waits for them): warpgroup w takes job w (boxes w) once both
      // warpgroups' values are in: h's two stores, the activation into registers while they read the boxes, then a
      // over the gate box.
      fence_proxy_async_shared();
      named_barrier<256>(5);
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
  // kExperts into an fp32 main gradient (GroupedGemmArgs::accumulate): each value added to its element in place,
  // straight from the accumulator, eight pairs in flight at a time (all 64 would take 128 registers).
  auto accumulate_tile = [&](const Tile& tile) {
    if (tile.k_tiles == 0) return;  // an expert without rows adds nothing
    float* out = args.accumulate + int64_t(tile.expert) * args.m * n;
    const int32_t r0 = tile.m0 + 64 * wg + frag_row;
    const int32_t c0 = tile.n_tile * kGemmTileN + frag_col;
    CUTE_UNROLL
    for (int g = 0; g < 2 * kHalf; g += 16) {
      float2 v[8];
      CUTE_UNROLL
      for (int j = 0; j < 8; ++j) {
        const int i = g + 2 * j;
        const int32_t r = r0 + 8 * ((i >> 1) & 1);
        if (r < args.m) v[j] = *reinterpret_cast<const float2*>(out + int64_t(r) * n + c0 + 8 * (i >> 2));
      }
      CUTE_UNROLL
      for (int j = 0; j < 8; ++j) {
        const int i = g + 2 * j;
        const int32_t r = r0 + 8 * ((i >> 1) & 1);
        if (r < args.m) {
          *reinterpret_cast<float2*>(out + int64_t(r) * n + c0 + 8 * (i >> 2)) =
              make_float2(v[j].x + acc(i), v[j].y + acc(i + 1));
        }
      }
      asm volatile("" ::: "memory");  // the next group's loads after these stores: eight pairs live at a time
    }
  };
  uint32_t exchanges = 0;  // split half tiles: partial-sum rounds passed between the warpgroups
  for (uint32_t taken = 0;; ++taken) {
    int32_t t;
    const Tile tile = tiles.take(taken, t);
    if (t < 0) break;
    const bool half = S == GemmSchedule::kRows && tile.rows <= kGemmRowAlign;
    const bool split = tile.split;
    const int32_t row0 = (S == GemmSchedule::kRows ? tile.m0 : tile.expert * args.m + tile.m0) + (split ? 0 : 64 * wg);
    // Warpgroup 1 of a half tile only multiplies and stores nothing.
    const bool epilogue = !half || wg == 0;
    // Past the routed rows the epilogue's inputs are undefined: zeros are used instead of them.
    const bool routed = tile.k_tiles > 0;
    // The routing weights of the thread's two rows (FC2, FC2 dgrad), loaded ahead of the epilogue so that it does
    // not wait a memory round trip for them: before the mainloop, or with the rows-ready hook once the tile's first
    // k-slice has landed (the dispatch writes them with the rows; through L2, which the arrival made current).
    float row_scale[2] = {1.0f, 1.0f};
    constexpr bool kRowScale = S == GemmSchedule::kRows && E != GemmEpilogue::kSwiGLU;
    const bool hooked = args.hook.counters != nullptr;
    auto load_row_scale = [&] {
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int64_t r = int64_t(row0) + frag_row + 8 * h;
        row_scale[h] = routed && r < args.num_rows ? __ldcg(args.row_weight + r) : 0.0f;
      }
    };
    if (kRowScale && args.row_weight != nullptr) {
      if (hooked && routed) {
        row_scale[0] = row_scale[1] = 0.0f;  // loaded in the first k-slice
      } else {
        load_row_scale();
      }
    }
    constexpr bool kLoadsQuarters = E == GemmEpilogue::kSwiGLUBackward;
    // FC2 dgrad's first quarter loads overlap the mainloop: issued once the first k-slice's wgmma are (or before an
    // empty mainloop), after the previous tile's stores have read the boxes.
    auto prefetch_first_quarter = [&] {
      staging_acquire(wg, wtid);
      swiglu_bwd_load_quarter(args, slots, wtid, tile, row0, routed, 0);
    };
    // The epilogue of the tile's (first) 128 rows, every variant but FC2 dgrad's.
    auto deferred_epilogue = [&] {
      // Before a 192-row tile the consumers compute the activation (three store rounds, none deferred): as jobs,
      // this tile's two would hold the boxes that the next one's tail slices need while its mainloop waits.
      const bool jobs = kActWarps && !(Merge && tiles.next_is_merged(taken + 1));
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
        await_boxes();  // the activation warps' last job is done with the boxes
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
        if (publishes) {
          if (unpublished >= 0) {
            store_wait_written<1>();  // all but the round just committed: the previous tile's two
            publish(unpublished);
          }
          unpublished = row0 / int32_t(kGemmRowAlign);
        }
        CUTE_UNROLL
        for (int i = 0; i < kHalf; i += 2) held[i / 2] = scaled_pair(kHalf + i);
      }
      held_row0 = row0;
      held_col = E != GemmEpilogue::kSwiGLU ? tile.n_tile * kGemmTileN + 128
                 : jobs                     ? tile.n_tile * 128 + 64
                                            : tile.n_tile * 128;
      holding = true;
      if (kActWarps && !jobs) store_held();
    };
    // A merged tile goes straight to its epilogue: from no other path does a deferred round reach the next tile
    // through its mainloop, whose accumulators leave no registers for one.
    if (Merge && tile.rows > kGemmTileM) {
      merged_tile(tile);
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
      if (kRowScale && hooked && kt == kt_first && args.row_weight != nullptr) load_row_scale();
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
        if (kDeferred && holding && !kActWarps) store_held();
      }
      // Keep one k-tile of wgmma in flight; the one before it is done, so its stage goes back.
      warpgroup_wait<1>();
      warpgroup_fence_operand(acc);
      if (prev_stage >= 0) release(prev_stage, arrivals);
      prev_stage = stage;
      pos.step(kt_step);
    };
    if constexpr (kActWarps) {
      // The held job goes in the middle of this warpgroup's k-slices (a separate iteration, so that the loops around
      // it carry nothing of it).
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
    if (prev_stage >= 0) release(prev_stage, arrivals);
    ring.advance(tile.k_tiles);
    // This warpgroup had no k-slice in the tile.
    if (kDeferred && holding) flush_held();
    if (split) {
      // Warpgroup 1's partial sums (if it had a k-slice) join warpgroup 0's through its own staging boxes, as many
      // values per thread per round as they hold; thread-major, so the accesses are conflict-free. The rounds pass
      // through two mbarriers (each thread arrives: its own accesses are released), so warpgroup 1 refills the
      // boxes only after warpgroup 0 has read them, and leaves once the last round is read (racecheck-clean, unlike
      // pairs of named barriers).
      constexpr int kPerRound = Pipeline<S, E>::kBoxes * kBoxBytes / (128 * 4);
      const uint32_t part = smem_addr(smem.staging[1]) + 4 * wtid;
      if (wg == 1) staging_acquire(1, wtid);
      // The activation warp is done with these boxes.
      if (kActWarps && wg == 1) await_boxes();
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
    if (S == GemmSchedule::kExperts && E == GemmEpilogue::kStore && args.accumulate != nullptr) {
      accumulate_tile(tile);
      continue;
    }
    if constexpr (kDeferred) {
      deferred_epilogue();
    } else {
      swiglu_bwd_epilogue(p, acc, slots, wg, wtid, frag_row, frag_col, tile, row0, routed, row_scale);
    }
  }
  if constexpr (kActWarps) {
    if (holding) submit_held();
    await_boxes();
    post_job(0, -1);
  } else if (kDeferred && holding) {
    store_held();
  }
  if (publishes && unpublished >= 0) {
    store_wait_written<0>();
    publish(unpublished);
  }
  // The staging boxes must outlive the TMA stores that read them.
  if ((ct % 128) == 0) store_wait_read();
}

}  // namespace primemoe::sm90
