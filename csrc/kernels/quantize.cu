#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <climits>

#include "bf16_vec.cuh"
#include "quantize.cuh"

namespace primemoe {
namespace {

constexpr int kVec = kBf16Vec;
constexpr unsigned kFullMask = 0xffffffffu;

// The routed row count *end (expert_offsets[E], read on the device) clamped to [0, rows].
__device__ __forceinline__ int64_t routed_rows(const int32_t* end, int64_t rows) {
  return max(int64_t(0), min(int64_t(*end), rows));
}

// max |v| over v's 8 values and acc (>= 0).
__device__ __forceinline__ float abs_max(const uint4& v, float acc) { return fmaxf(acc, bf16x8_abs_max(v)); }

// Value j of v in fp32.
__device__ __forceinline__ float element(const uint4& v, int j) {
  return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(&v)[j]);
}

// ---------------------------------------------------------------- 1x128: tiles along the contiguous dimension

// The tiles of a contiguous [rows, cols] tensor are consecutive runs of 128 values: tile t is x[t * 128, +128)
// and its scale scale[t]. 16 lanes take a tile (one 16-byte load each, amax over 4 xor-shuffles, an 8-byte
// store each: a warp reads 512 and writes 256 contiguous bytes); each lane has k1x128Unroll tiles' loads in flight.
constexpr int k1x128Threads = 256;
constexpr int kTileLanes = kFp8Tile / kVec;  // 16
constexpr int k1x128Unroll = 4;
constexpr int k1x128TilesPerStep = k1x128Threads / kTileLanes * k1x128Unroll;  // 64 per block and step

// kMnMajor: a.scale_mn_major (a template argument, so that the default layout's kernel has no divisions).
template <bool kMnMajor>
__global__ void __launch_bounds__(k1x128Threads, 4) quantize_1x128_kernel(Quantize1x128Args a) {
  // With rows_end, only the tiles of the rows before it (a prefix of the tiles).
  const int64_t row_tiles = a.cols / kFp8Tile;
  const int64_t tiles = (a.rows_end == nullptr ? a.rows : routed_rows(a.rows_end, a.rows)) * row_tiles;
  const int group = threadIdx.x / kTileLanes, part = threadIdx.x % kTileLanes;
  const uint4* __restrict__ x = static_cast<const uint4*>(a.x);
  uint2* __restrict__ q = static_cast<uint2*>(a.q);
  // The loop bound is uniform over the block: every lane runs every shuffle.
  for (int64_t base = int64_t(blockIdx.x) * k1x128TilesPerStep; base < tiles;
       base += int64_t(gridDim.x) * k1x128TilesPerStep) {
    uint4 v[k1x128Unroll];
#pragma unroll
    for (int u = 0; u < k1x128Unroll; ++u) {
      const int64_t tile = base + u * (k1x128Threads / kTileLanes) + group;
      v[u] = tile < tiles ? __ldg(x + tile * kTileLanes + part) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < k1x128Unroll; ++u) {
      const int64_t tile = base + u * (k1x128Threads / kTileLanes) + group;
      float amax = abs_max(v[u], 0.0f);
#pragma unroll
      for (int off = kTileLanes / 2; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, off));
      const float m = fp8_multiplier(amax, a.pow2);
      if (tile < tiles) {
        q[tile * kTileLanes + part] = fp8x8_quantize(v[u], m);
        if (part == 0) {
          // MN-major: tile t of row r at scale[t * rows + r].
          const int64_t at = kMnMajor ? tile % row_tiles * a.rows + tile / row_tiles : tile;
          a.scale[at] = fp8_scale(m);
        }
      }
    }
  }
}

// ---------------------------------------------------------------- 128x128: weight blocks

// One block of threads per 128x128 block: 16 lanes per row (one 16-byte load each), 16 rows per pass, all
// 8 passes' loads in flight; amax over the warp (shuffles) then the 8 warps (shared memory).
constexpr int kBlockThreads = 256;
constexpr int kBlockRowsPerPass = kBlockThreads / kTileLanes;  // 16
constexpr int kBlockPasses = kFp8Tile / kBlockRowsPerPass;       // 8
constexpr int kBlockWarps = kBlockThreads / 32;

__global__ void __launch_bounds__(kBlockThreads, 4) quantize_128x128_kernel(Quantize128x128Args a) {
  __shared__ float warp_max[kBlockWarps];
  const int64_t col_blocks = a.cols / kFp8Tile, blocks = a.rows / kFp8Tile * col_blocks;
  const int64_t row_vecs = a.cols / kVec;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int part = threadIdx.x % kTileLanes, row = threadIdx.x / kTileLanes;
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    // The block's first 16-byte vector, then this thread's.
    const int64_t origin = b / col_blocks * kFp8Tile * row_vecs + b % col_blocks * kTileLanes;
    const int64_t mine = origin + row * row_vecs + part;
    const uint4* __restrict__ w = static_cast<const uint4*>(a.w) + mine;
    uint2* __restrict__ q = static_cast<uint2*>(a.q) + mine;
    uint4 v[kBlockPasses];
#pragma unroll
    for (int p = 0; p < kBlockPasses; ++p) v[p] = __ldg(w + p * kBlockRowsPerPass * row_vecs);
    __nv_bfloat162 pair_max = __float2bfloat162_rn(0.0f);
#pragma unroll
    for (int p = 0; p < kBlockPasses; ++p) pair_max = bf16x8_abs_max2(v[p], pair_max);
    float amax = fmaxf(__low2float(pair_max), __high2float(pair_max));
#pragma unroll
    for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, off));
    if (lane == 0) warp_max[warp] = amax;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kBlockWarps; ++i) amax = fmaxf(amax, warp_max[i]);
    const float m = fp8_multiplier(amax, a.pow2);
    if (threadIdx.x == 0) a.scale[b] = fp8_scale(m);
#pragma unroll
    for (int p = 0; p < kBlockPasses; ++p) q[p * kBlockRowsPerPass * row_vecs] = fp8x8_quantize(v[p], m);
    __syncthreads();  // warp_max is rewritten by the next block
  }
}

// ---------------------------------------------------------------- 128x1: tiles along the rows, transposed output

// One block of threads per 128 rows x 64 columns. Loads: 8 lanes per row segment (128 contiguous bytes), each
// thread 8 columns of 4 consecutive rows. Column amax: over the thread's 4 rows, the warp's 8 row groups
// (shuffles) and the 8 warps (shared memory). Each thread packs its 4 rows' bytes of a column into one word of
// q_t staged in shared memory ([64 columns][128 rows] bytes), which the block then stores as 16-byte vectors:
// 8 lanes per 128 contiguous bytes of a q_t row.
constexpr int kColThreads = 256;
constexpr int kColBlock = 64;                                    // columns per block
constexpr int kColVecs = kColBlock / kVec;                       // 8 threads per row segment
constexpr int kRowGroups = kColThreads / kColVecs;               // 32
constexpr int kGroupRows = kFp8Tile / kRowGroups;                // 4 rows per thread: one 32-bit word
constexpr int kColWarps = kColThreads / 32;
constexpr int kStageWords = kFp8Tile / kGroupRows;               // 32 words per staged q_t row
constexpr int kStoreVecs = kColBlock * kFp8Tile / 16;            // 512 16-byte stores per block
static_assert(kGroupRows == 4 && kStageWords == 32 && kStoreVecs % kColThreads == 0, "tile geometry");

// Word g (rows 4g .. 4g+3) of staged q_t row c. The 16-byte column of words is xor-swizzled by c / 8, so that
// both the word stores (a warp: 8 threads' column groups x 4 row groups) and the 16-byte loads hit 32 banks.
__device__ __forceinline__ int stage_word(int c, int g) { return c * kStageWords + (g ^ ((c / kVec % 8) * 4)); }

__global__ void __launch_bounds__(kColThreads, 4) quantize_128x1_kernel(Quantize128x1Args a) {
  __shared__ float warp_max[kColWarps][kColBlock];
  __shared__ float col_mult[kColBlock];
  __shared__ __align__(16) uint32_t stage[kColBlock * kStageWords];
  // With rows_end, only the row tiles that start before it (a prefix of the blocks).
  const int64_t row_tiles = a.rows / kFp8Tile;
  const int64_t live_tiles =
      a.rows_end == nullptr ? row_tiles : (routed_rows(a.rows_end, a.rows) + kFp8Tile - 1) / kFp8Tile;
  const int64_t col_blocks = (a.cols + kColBlock - 1) / kColBlock, blocks = live_tiles * col_blocks;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int vec = threadIdx.x % kColVecs, group = threadIdx.x / kColVecs;
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const int64_t rb = b / col_blocks, c0 = b % col_blocks * kColBlock;
    // cols is a multiple of 8: a vector is wholly inside or past the last column.
    const bool has_cols = c0 + vec * kVec < a.cols;
    const uint4* __restrict__ x = static_cast<const uint4*>(a.x) +
                                  ((rb * kFp8Tile + group * kGroupRows) * a.cols + c0) / kVec + vec;
    uint4 v[kGroupRows];
#pragma unroll
    for (int i = 0; i < kGroupRows; ++i) v[i] = has_cols ? __ldg(x + i * (a.cols / kVec)) : make_uint4(0, 0, 0, 0);
    // Column maxima in bf16 pairs (columns 2p, 2p + 1 of the vector), over the thread's rows, then the lanes
    // of the same vector (lane % 8 equal).
    __nv_bfloat162 cmax[kVec / 2];
#pragma unroll
    for (int p = 0; p < kVec / 2; ++p) {
      cmax[p] = __habs2(reinterpret_cast<const __nv_bfloat162*>(&v[0])[p]);
#pragma unroll
      for (int i = 1; i < kGroupRows; ++i) {
        cmax[p] = __hmax2(cmax[p], __habs2(reinterpret_cast<const __nv_bfloat162*>(&v[i])[p]));
      }
      cmax[p] = __hmax2(cmax[p], __shfl_xor_sync(kFullMask, cmax[p], 8));
      cmax[p] = __hmax2(cmax[p], __shfl_xor_sync(kFullMask, cmax[p], 16));
    }
    if (lane < kColVecs) {
#pragma unroll
      for (int p = 0; p < kVec / 2; ++p) {
        warp_max[warp][lane * kVec + 2 * p] = __low2float(cmax[p]);
        warp_max[warp][lane * kVec + 2 * p + 1] = __high2float(cmax[p]);
      }
    }
    __syncthreads();
    if (threadIdx.x < kColBlock) {
      float amax = warp_max[0][threadIdx.x];
#pragma unroll
      for (int w = 1; w < kColWarps; ++w) amax = fmaxf(amax, warp_max[w][threadIdx.x]);
      const float m = fp8_multiplier(amax, a.pow2);
      col_mult[threadIdx.x] = m;
      const int64_t c = c0 + threadIdx.x;
      if (c < a.cols) a.scale[a.scale_mn_major ? rb * a.cols + c : c * row_tiles + rb] = fp8_scale(m);
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const int c = vec * kVec + j;
      const float m = col_mult[c];
      stage[stage_word(c, group)] = fp8x2_quantize(element(v[0], j), element(v[1], j), m) |
                                    fp8x2_quantize(element(v[2], j), element(v[3], j), m) << 16;
    }
    __syncthreads();
#pragma unroll
    for (int s = 0; s < kStoreVecs / kColThreads; ++s) {
      const int id = s * kColThreads + threadIdx.x;
      const int c = id / (kFp8Tile / 16), part = id % (kFp8Tile / 16);  // 16 rows of column c
      const uint4 out = *reinterpret_cast<const uint4*>(stage + stage_word(c, part * 4));
      if (c0 + c < a.cols) {
        uint4* q_t = static_cast<uint4*>(a.q_t);
        q_t[((c0 + c) * a.rows + rb * kFp8Tile) / 16 + part] = out;
      }
    }
    __syncthreads();  // the shared buffers are rewritten by the next block
  }
}

// At most INT_MAX blocks of threads; the kernels loop past that.
int grid_of(int64_t blocks) { return static_cast<int>(std::min<int64_t>(blocks, INT_MAX)); }

// The 1x128 kernel strides over its tiles with at most what fills an H200 (132 SMs of 2048 threads).
constexpr int64_t k1x128MaxBlocks = 132 * 2048 / k1x128Threads;

}  // namespace

cudaError_t launch_quantize_1x128(const Quantize1x128Args& a, cudaStream_t stream) {
  if (a.rows < 0 || a.cols < 0 || a.cols % kFp8Tile) return cudaErrorInvalidValue;
  const int64_t tiles = a.rows * (a.cols / kFp8Tile);
  if (tiles == 0) return cudaSuccess;
  const int64_t steps = (tiles + k1x128TilesPerStep - 1) / k1x128TilesPerStep;
  const int grid = grid_of(std::min(steps, k1x128MaxBlocks));
  if (a.scale_mn_major) {
    quantize_1x128_kernel<true><<<grid, k1x128Threads, 0, stream>>>(a);
  } else {
    quantize_1x128_kernel<false><<<grid, k1x128Threads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

cudaError_t launch_quantize_128x1(const Quantize128x1Args& a, cudaStream_t stream) {
  if (a.rows < 0 || a.cols < 0 || a.rows % kFp8Tile || a.cols % kVec) return cudaErrorInvalidValue;
  const int64_t blocks = a.rows / kFp8Tile * ((a.cols + kColBlock - 1) / kColBlock);
  if (blocks == 0) return cudaSuccess;
  quantize_128x1_kernel<<<grid_of(blocks), kColThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_quantize_128x128(const Quantize128x128Args& a, cudaStream_t stream) {
  if (a.rows < 0 || a.cols < 0 || a.rows % kFp8Tile || a.cols % kFp8Tile) return cudaErrorInvalidValue;
  const int64_t blocks = a.rows / kFp8Tile * (a.cols / kFp8Tile);
  if (blocks == 0) return cudaSuccess;
  quantize_128x128_kernel<<<grid_of(blocks), kBlockThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace primemoe
