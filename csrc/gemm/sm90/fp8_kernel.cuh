// The blockwise-scaled FP8 expert GEMM for sm_90a (see ../fp8_gemm.cuh): one persistent CTA per SM, 384 threads.
// Warpgroup 0 produces: thread 0 issues the TMA loads of the e4m3 operand tiles, warp 1 copies each k-block's
// scales (cp.async, completing on the same mbarrier); warpgroups 1 and 2 consume: each owns 64 rows of the
// 128 x 128 tile, multiplies a k-block into a fresh m64n128 accumulator (4 wgmma k32), waits for it and adds it,
// scaled by its rows' (and columns') operand scales, into the fp32 result (the promotion). While one warpgroup
// promotes, the other's wgmma keep the tensor cores busy. bf16 results leave through 128B-swizzled staging boxes and
// TMA stores that drain while the next tile's mainloop runs; fp32 results are stored from registers.
#pragma once

#include <cuda_bf16.h>

#include <cute/tensor.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "../../kernels/ptx.cuh"
#include "../fp8_gemm.cuh"
#include "pipeline.cuh"  // the staging boxes' swizzle (swizzled, pair_offset, kBoxBytes)

namespace primemoe::sm90 {

using namespace cute;

constexpr int kFp8Threads = 384;
// setmaxnreg budgets: the launch gives every thread 168 registers (65536 / 384, rounded down to 8); the consumers can
// grow only into what the producer warpgroup gives back, or setmaxnreg.inc waits forever.
constexpr int kFp8LaunchRegs = 168;
constexpr int kFp8ProducerRegs = 56;
constexpr int kFp8ConsumerRegs = 224;
static_assert(128 * (kFp8LaunchRegs - kFp8ProducerRegs) >= 256 * (kFp8ConsumerRegs - kFp8LaunchRegs),
              "the consumers' registers must come from the producer's");
constexpr int kFp8Stages = 5;  // with the staging boxes, what fits in 227 KiB
constexpr int kFp8TileBytes = kFp8TileM * kFp8TileK;  // one 128 x 128 e4m3 operand tile, 16 KiB

struct Fp8Params {
  CUtensorMap tma_a;  // kRows: [num_rows, k]; kExperts: [m, num_rows]
  CUtensorMap tma_b;  // kRows: [E, n, k]; kExperts: [n, num_rows]
  CUtensorMap tma_out;  // bf16 out: kRows [num_rows, n]; kExperts [E * m, n], in 64 x 64 boxes
  Fp8GemmArgs args;
};

struct Fp8Smem {
  float_e4m3_t a[kFp8Stages * kFp8TileBytes];
  float_e4m3_t b[kFp8Stages * kFp8TileBytes];
  bfloat16_t staging[2][2 * 64 * 64];  // per consumer warpgroup: its 64 rows x 128 columns as two 64 x 64 boxes
  float sa[kFp8Stages][kFp8TileM];  // the A scales of the tile's 128 rows for the stage's k-block
  float sb[kFp8Stages][kFp8TileN];  // kRows: [0], the weight block's scale; kExperts: the 128 columns' scales
  uint64_t full[kFp8Stages];
  uint64_t empty[kFp8Stages];
};

constexpr size_t kFp8SmemBytes = sizeof(Fp8Smem) + 1024;  // + room to align the base to 1 KiB (swizzle atoms)

struct Fp8Tile {
  int32_t expert;
  int32_t m0;       // kRows: first row; kExperts: first output row within the expert
  int32_t n0;       // first output column
  int32_t row_end;  // kRows: the expert's end (rows at or past it are not stored)
  int32_t k_begin;  // kExperts: the expert's first row
  int32_t k_tiles;
};

// The tile sequence, walked identically by every role (each CTA asks for increasing tile indices).
// kRows: (row block, column tile), column tiles innermost; kExperts: (expert, row tile, column tile).
template <Fp8Schedule S>
struct Fp8Walker {
  const Fp8GemmArgs& args;
  int32_t n_tiles;
  int32_t m_tiles = 0;
  uint32_t total;
  int32_t expert = 0;
  int32_t expert_block = 0;

  __device__ static int32_t blocks(int32_t rows) { return (rows + kFp8TileM - 1) / kFp8TileM; }

  __device__ explicit Fp8Walker(const Fp8GemmArgs& a) : args(a) {
    n_tiles = a.n / kFp8TileN;
    if constexpr (S == Fp8Schedule::kRows) {
      int64_t row_blocks = 0;
      for (int32_t e = 0; e < a.num_experts; ++e) row_blocks += blocks(a.expert_offsets[e + 1] - a.expert_offsets[e]);
      total = uint32_t(row_blocks * n_tiles);
    } else {
      m_tiles = a.m / kFp8TileM;
      total = uint32_t(int64_t(a.num_experts) * m_tiles * n_tiles);
    }
  }

  __device__ Fp8Tile at(uint32_t t) {
    if constexpr (S == Fp8Schedule::kRows) {
      const int32_t block = int32_t(t / uint32_t(n_tiles));
      const int32_t n_tile = int32_t(t % uint32_t(n_tiles));
      int32_t b = blocks(args.expert_offsets[expert + 1] - args.expert_offsets[expert]);
      while (block >= expert_block + b) {
        expert_block += b;
        ++expert;
        b = blocks(args.expert_offsets[expert + 1] - args.expert_offsets[expert]);
      }
      const int32_t begin = args.expert_offsets[expert];
      return {expert, begin + (block - expert_block) * kFp8TileM, n_tile * kFp8TileN, args.expert_offsets[expert + 1],
              0, args.k / kFp8TileK};
    } else {
      const uint32_t per_expert = uint32_t(m_tiles * n_tiles);
      const int32_t e = int32_t(t / per_expert);
      const int32_t r = int32_t(t % per_expert);
      const int32_t begin = args.expert_offsets[e];
      int32_t rows = args.expert_offsets[e + 1] - begin;
      if (args.expert_rows != nullptr) rows = max(min(rows, args.expert_rows[e]), 0);
      return {e, (r / n_tiles) * kFp8TileM, (r % n_tiles) * kFp8TileN, 0, begin, blocks(rows)};
    }
  }
};

template <int Stages>
struct Fp8RingPos {
  int stage = 0;
  uint32_t phase = 0;
  __device__ void step() {
    if (++stage == Stages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// 4 bytes (or zeros, when bytes == 0) into shared memory by cp.async.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

// One arrival on `bar` once this thread's earlier cp.async have landed (counted in the barrier's expected arrivals).
__device__ __forceinline__ void cp_async_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// The 128B-swizzled ring of one operand: (128 rows, 128 of K, stage), exactly as TMA writes a 128 x 128 box.
CUTE_HOST_DEVICE constexpr auto fp8_ring_layout() {
  return tile_to_shape(GMMA::Layout_K_SW128_Atom<float_e4m3_t>{},
                       Shape<Int<kFp8TileM>, Int<kFp8TileK>, Int<kFp8Stages>>{});
}

template <Fp8Schedule S>
__device__ __forceinline__ void fp8_tma_producer(const Fp8Params& p, Fp8Smem& smem) {
  const Fp8GemmArgs& args = p.args;
  prefetch_tensormap(&p.tma_a);
  prefetch_tensormap(&p.tma_b);
  Fp8Walker<S> walker(args);
  Fp8RingPos<kFp8Stages> pos;
  for (uint32_t t = blockIdx.x; t < walker.total; t += gridDim.x) {
    const Fp8Tile tile = walker.at(t);
    for (int32_t kt = 0; kt < tile.k_tiles; ++kt) {
      cutlass::arch::ClusterBarrier::wait(&smem.empty[pos.stage], pos.phase ^ 1);
      uint64_t* bar = &smem.full[pos.stage];
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(bar, 2 * kFp8TileBytes);
      float_e4m3_t* sa = smem.a + pos.stage * kFp8TileBytes;
      float_e4m3_t* sb = smem.b + pos.stage * kFp8TileBytes;
      if constexpr (S == Fp8Schedule::kRows) {
        const int32_t k0 = kt * kFp8TileK;
        tma_load(&p.tma_a, bar, sa, k0, tile.m0, 0);
        tma_load(&p.tma_b, bar, sb, k0, tile.n0, tile.expert);
      } else {
        const int32_t r0 = tile.k_begin + kt * kFp8TileK;
        tma_load(&p.tma_a, bar, sa, r0, tile.m0, 0);
        tma_load(&p.tma_b, bar, sb, r0, tile.n0, 0);
      }
      pos.step();
    }
  }
}

// Warp 1 of the producer warpgroup: each k-block's scales into the stage, by cp.async, each lane's arrival on the
// stage's full barrier triggered when its copies have landed.
template <Fp8Schedule S>
__device__ __forceinline__ void fp8_scale_producer(const Fp8Params& p, Fp8Smem& smem, int lane) {
  const Fp8GemmArgs& args = p.args;
  Fp8Walker<S> walker(args);
  Fp8RingPos<kFp8Stages> pos;
  for (uint32_t t = blockIdx.x; t < walker.total; t += gridDim.x) {
    const Fp8Tile tile = walker.at(t);
    for (int32_t kt = 0; kt < tile.k_tiles; ++kt) {
      cutlass::arch::ClusterBarrier::wait(&smem.empty[pos.stage], pos.phase ^ 1);
      const uint32_t sa = smem_addr(&smem.sa[pos.stage][0]);
      const uint32_t sb = smem_addr(&smem.sb[pos.stage][0]);
      if constexpr (S == Fp8Schedule::kRows) {
        // a_scale [k/128, num_rows]: the tile's 128 rows of k-block kt, 4 per lane (rows past the tensor: zeros).
        const float* src = args.a_scale + int64_t(kt) * args.num_rows;
        CUTE_UNROLL
        for (int i = 0; i < 4; ++i) {
          const int32_t r = tile.m0 + lane + 32 * i;
          const bool in = r < args.num_rows;
          cp_async_4(sa + 4 * (lane + 32 * i), src + (in ? r : 0), in ? 4 : 0);
        }
        if (lane == 0) {
          const int32_t kb = args.k / kFp8TileK;
          const float* s = args.b_scale + (int64_t(tile.expert) * (args.n / kFp8TileN) + tile.n0 / kFp8TileN) * kb + kt;
          cp_async_4(sb, s, 4);
        }
      } else {
        // a_scale [num_rows/128, m], b_scale [num_rows/128, n]: 128 contiguous scales each, 16 bytes per lane.
        const int64_t block = tile.k_begin / kFp8TileK + kt;
        cp_async_16(sa + 16 * lane, args.a_scale + block * args.m + tile.m0 + 4 * lane, 16);
        cp_async_16(sb + 16 * lane, args.b_scale + block * args.n + tile.n0 + 4 * lane, 16);
      }
      cp_async_arrive_noinc(&smem.full[pos.stage]);
      pos.step();
    }
  }
}

template <Fp8Schedule S>
__device__ __forceinline__ void fp8_consumers(const Fp8Params& p, Fp8Smem& smem) {
  const Fp8GemmArgs& args = p.args;
  const int ct = int(threadIdx.x) - 128;
  const int wg = ct / 128;
  const int wtid = ct % 128;
  using Atom = SM90_64x128x32_F32E4M3E4M3_SS_TN<>;
  auto tiled_mma = make_tiled_mma(Atom{}, Layout<Shape<_2, _1, _1>>{});
  auto thr_mma = tiled_mma.get_slice(ct);
  Tensor sA = make_tensor(make_smem_ptr(smem.a), fp8_ring_layout());
  Tensor sB = make_tensor(make_smem_ptr(smem.b), fp8_ring_layout());
  Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));  // (MMA, 1, 4, stage) descriptors
  Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB));
  // Value i of a thread: row frag_row + 8 * ((i >> 1) & 1) of its warpgroup's 64, column frag_col + 8 * (i >> 2) +
  // (i & 1) of the tile's 128.
  Tensor part = partition_fragment_C(tiled_mma, Shape<Int<kFp8TileM>, Int<kFp8TileN>>{});
  Tensor acc = partition_fragment_C(tiled_mma, Shape<Int<kFp8TileM>, Int<kFp8TileN>>{});
  CUTE_STATIC_ASSERT_V(size(acc) == Int<64>{});
  const int frag_row = 16 * (wtid / 32) + (wtid % 32) / 4;
  const int frag_col = 2 * (wtid % 4);
  const int my_row = wg * 64 + frag_row;  // of the tile's 128 (+ 8 for the odd value pairs)

  Fp8Walker<S> walker(args);
  Fp8RingPos<kFp8Stages> pos;
  for (uint32_t t = blockIdx.x; t < walker.total; t += gridDim.x) {
    const Fp8Tile tile = walker.at(t);
    float row_weight[2] = {1.0f, 1.0f};
    if (S == Fp8Schedule::kRows && args.row_weight != nullptr) {
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int64_t r = int64_t(tile.m0) + my_row + 8 * h;
        row_weight[h] = r < tile.row_end ? args.row_weight[r] : 0.0f;
      }
    }
    clear(acc);
    for (int32_t kt = 0; kt < tile.k_tiles; ++kt) {
      const int stage = pos.stage;
      cutlass::arch::ClusterTransactionBarrier::wait(&smem.full[stage], pos.phase);
      warpgroup_fence_operand(part);
      warpgroup_arrive();
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), part);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      // The scales, read while the wgmma run.
      float row_scale[2];
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) row_scale[h] = smem.sa[stage][my_row + 8 * h];
      if constexpr (S == Fp8Schedule::kRows) {
        const float sb = smem.sb[stage][0];
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) row_scale[h] *= sb;
        warpgroup_wait<0>();
        warpgroup_fence_operand(part);
        __syncwarp();
        if (threadIdx.x % 32 == 0) arrive_count(&smem.empty[stage], 1);
        CUTE_UNROLL
        for (int i = 0; i < size(acc); ++i) acc(i) += part(i) * row_scale[(i >> 1) & 1];
      } else {
        float2 col_scale[16];
        CUTE_UNROLL
        for (int j = 0; j < 16; ++j) {
          col_scale[j] = *reinterpret_cast<const float2*>(&smem.sb[stage][frag_col + 8 * j]);
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(part);
        __syncwarp();
        if (threadIdx.x % 32 == 0) arrive_count(&smem.empty[stage], 1);
        CUTE_UNROLL
        for (int i = 0; i < size(acc); ++i) {
          const float2 c = col_scale[i >> 2];
          acc(i) += part(i) * (row_scale[(i >> 1) & 1] * ((i & 1) ? c.y : c.x));
        }
      }
      pos.step();
    }
    int64_t out_row0;  // the thread's first output row
    int32_t rows_left;  // rows of the thread's first row onwards that are stored
    if constexpr (S == Fp8Schedule::kRows) {
      out_row0 = int64_t(tile.m0) + my_row;
      rows_left = int32_t(min(int64_t(tile.row_end), args.num_rows) - out_row0);
    } else {
      out_row0 = int64_t(tile.expert) * args.m + tile.m0 + my_row;
      rows_left = kFp8TileM;
    }
    // Whether all of the warpgroup's 64 rows are its expert's (always, with the layer's offsets, multiples of 128;
    // the rows past an expert whose end is not on a tile are another's and must not be stored).
    const bool whole_rows = S == Fp8Schedule::kExperts || int64_t(tile.m0) + wg * 64 + 64 <= tile.row_end;
    if (!args.out_fp32 && whole_rows) {
      // The warpgroup's 64 rows into its two staging boxes (once the previous tile's stores have read them), then one
      // thread's TMA stores, which clip rows past the tensor.
      const uint32_t slots = smem_addr(smem.staging[wg]);
      if (wtid == 0) store_wait_read();
      named_barrier<128>(wg + 1);
      const uint32_t at = slots + frag_row * 128 + frag_col * 2;
      const uint32_t swizzle = uint32_t(frag_row & 7) << 4;
      CUTE_UNROLL
      for (int i = 0; i < size(acc); i += 2) {
        const float w = row_weight[(i >> 1) & 1];
        const __nv_bfloat162 v = __floats2bfloat162_rn(acc(i) * w, acc(i + 1) * w);
        st_shared(at + pair_offset(i, swizzle), *reinterpret_cast<const uint32_t*>(&v));
      }
      fence_proxy_async_shared();
      named_barrier<128>(wg + 1);
      if (wtid == 0) {
        const int32_t row0 = int32_t(out_row0 - frag_row);
        tma_store(&p.tma_out, slots, tile.n0, row0);
        tma_store(&p.tma_out, slots + kBoxBytes, tile.n0 + 64, row0);
        store_commit();
      }
      continue;
    }
    // fp32, or an expert's partial last rows: pairs of adjacent columns straight from registers.
    CUTE_UNROLL
    for (int i = 0; i < size(acc); i += 2) {
      const int h = (i >> 1) & 1;
      if (8 * h >= rows_left) continue;
      const int64_t at = (out_row0 + 8 * h) * args.n + tile.n0 + frag_col + 8 * (i >> 2);
      const float v0 = acc(i) * row_weight[h];
      const float v1 = acc(i + 1) * row_weight[h];
      if (args.out_fp32) {
        float2* to = reinterpret_cast<float2*>(static_cast<float*>(args.out) + at);
        if (args.accumulate) {  // one CTA owns the tile: a plain read-add-write, deterministic
          const float2 was = *to;
          *to = make_float2(was.x + v0, was.y + v1);
        } else {
          *to = make_float2(v0, v1);
        }
      } else {
        *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(args.out) + at) = __floats2bfloat162_rn(v0, v1);
      }
    }
  }
  // The staging boxes must outlive the TMA stores that read them.
  if (wtid == 0) store_wait_read();
}

template <Fp8Schedule S>
__global__ void __launch_bounds__(kFp8Threads, 1) fp8_gemm_kernel(const __grid_constant__ Fp8Params p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  auto& smem = *reinterpret_cast<Fp8Smem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  if (threadIdx.x == 0) {
    for (int s = 0; s < kFp8Stages; ++s) {
      // The TMA thread's arrival and the scale warp's 32 (cp.async completions).
      cutlass::arch::ClusterTransactionBarrier::init(&smem.full[s], 1 + 32);
      cutlass::arch::ClusterBarrier::init(&smem.empty[s], 8);  // one arrival per consumer warp
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    cutlass::arch::warpgroup_reg_dealloc<kFp8ProducerRegs>();
    if (threadIdx.x == 0) {
      fp8_tma_producer<S>(p, smem);
    } else if (threadIdx.x / 32 == 1) {
      fp8_scale_producer<S>(p, smem, threadIdx.x % 32);
    }
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<kFp8ConsumerRegs>();
  fp8_consumers<S>(p, smem);
#endif
}

}  // namespace primemoe::sm90
