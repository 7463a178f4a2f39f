// Expert-grouped BF16 GEMMs of the MoE layer on Hopper: one persistent, warp-specialised kernel family (a producer
// warpgroup feeding two wgmma consumer warpgroups, csrc/gemm/sm90/) whose tile scheduler walks the routing layout's
// device-side expert offsets. Layering: the caller fills GroupedGemmArgs, choose_gemm_config (pure host heuristics)
// returns the GemmConfig, launch_grouped_gemm picks the kernel built for that config.
//
// Row space: the expert-major rows of dispatch_layout with row_align = kGemmRowAlign (64), padding rows zero. kRows
// walks each expert's rows in 128-row tiles; an expert's last tile may have 64 rows (a half tile), so no tile
// straddles two experts.
//
//   kRows    out[r, :] = A[r, :] (K) x B[e(r)]         M = routed rows, per-expert B
//   kExperts out[e]    = A[rows of e]^T x B[rows of e] K = routed rows, per-expert out
//
// The producer's wait hook (RowsReadyHook) is where the expert-parallel path plugs in: before loading an expert's
// first rows it waits for that expert's arrival counter, so GEMM tiles start as soon as their rows have landed.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../kernels/error_record.cuh"

namespace primemoe {

constexpr int32_t kGemmRowAlign = 64;   // expert row alignment: the height of a half tile
constexpr int32_t kGemmTileM = 128;     // tile height
constexpr int32_t kGemmTileN = 256;     // output columns per tile (two 128-column halves)
constexpr int32_t kGemmTileK = 64;
constexpr int kMaxDevices = 64;         // per-device caches of the host side

enum class GemmSchedule : int32_t { kRows = 0, kExperts = 1 };

enum class GemmEpilogue : int32_t {
  kStore = 0,           // out = bf16(acc)
  kSwiGLU = 1,          // FC1: halves are gate / up; out = bf16(silu(g) * u), h = [g | u] if kept
  kSwiGLUBackward = 2,  // FC2 dgrad: acc = da; writes dh = d[g | u] (weighted), aw = w * a, <da, a> partials
};

// Output columns a tile writes: FC1's 256 accumulator columns are 128 gate and the 128 matching up
// columns, which make 128 activation columns.
constexpr int32_t gemm_tile_n(GemmEpilogue e) { return e == GemmEpilogue::kSwiGLU ? 128 : kGemmTileN; }

// Producer-side wait before an expert's first rows are loaded: counters[e] >= *epoch * per_epoch.
struct RowsReadyHook {
  const uint64_t* counters = nullptr;  // null: rows are already in memory
  const int64_t* epoch = nullptr;
  uint64_t per_epoch = 0;
  int32_t rank = 0;
  uint64_t timeout_ns = 0;
};

// kRows + kStore, optional: the result rows are published per 64-row block as their stores land, for a kernel that
// runs alongside and reads them (the expert-parallel combine, launched programmatically dependent on this GEMM).
// counts[b] += 1 per column tile of block b done; the tile that brings it to `cols` resets it and sets flags[b] =
// *epoch (release). The GEMM lets its dependent start at once and leaves it `consumer_sms` SMs.
struct RowsDone {
  uint64_t* flags = nullptr;  // null: nothing published
  int32_t* counts = nullptr;
  const int64_t* epoch = nullptr;
  int32_t cols = 0;           // column tiles per row block: n / kGemmTileN
  int32_t consumer_sms = 0;
};

struct GroupedGemmArgs {
  GemmSchedule schedule;
  GemmEpilogue epilogue;
  // kRows: a = rows [num_rows, k] (K-major); b = weights [E, n, k] (b_k_major) or [E, k, n].
  // kExperts: a = rows [num_rows, m], b = rows [num_rows, n]; both reduced over each expert's rows.
  const void* a;
  const void* b;
  bool b_k_major;
  int64_t num_rows;  // allocated rows of the row operands and outputs (>= expert_offsets[E])
  // kRows: output rows past expert_offsets[E] are written as zeros; false leaves them unwritten (for callers that
  // read only the routed rows: the layer, whose buffers are sized for the worst case).
  bool zero_unrouted;
  int32_t m;         // kExperts only: output rows per expert
  int32_t n;         // output columns (kSwiGLU: of the activation, i.e. half of b's rows)
  int32_t k;         // kRows only: reduction length
  int32_t num_experts;
  const int32_t* expert_offsets;  // [E + 1], multiples of kGemmRowAlign
  // kExperts, optional: [E] routed rows of each expert (the layout's counts). The reduction then stops at the last
  // 64-row k-slice holding a routed row: the padding rows after it are zeros (as every producer of the layout
  // leaves them), so no output changes and up to a k-slice of work per expert is saved.
  const int32_t* expert_rows;
  void* out;                      // kRows: [num_rows, n]; kExperts: [E, m, n]; bf16 (kSwiGLUBackward: aw)
  // kExperts + kStore, optional: instead of `out`, accumulate[e, m, n] += the fp32 result (a weight's fp32 main
  // gradient). One CTA owns each output tile and adds it once, so the sum is deterministic; experts without rows
  // add nothing.
  float* accumulate;
  // kSwiGLU: out_h = [num_rows, 2n] pre-activations or null.
  // kRows + kStore: row_weight [num_rows] fp32 or null; out row r is scaled by row_weight[r] (FC2's
  //   routing weight, so the combine only sums).
  // kSwiGLUBackward: in_h = [num_rows, 2n] pre-activations, row_weight [num_rows] fp32 (0 on padding),
  //   out = aw [num_rows, n], out_dh [num_rows, 2n], out_dot [num_rows, n / kGemmTileN] fp32.
  void* out_h;
  const void* in_h;
  const float* row_weight;
  void* out_dh;
  float* out_dot;
  RowsReadyHook hook;
  // Zero at launch where GemmConfig::claim_tiles is set (the tile claim counter), else unused. Set by the caller
  // (a dispatch zeroes it), the heuristics take the claimed order.
  int32_t* tile_counter;
  // > 0: launched programmatically dependent on the kernel before it on the stream (the dispatch's rows kernel, on
  // this many SMs): it starts while that kernel runs and ends only after it. The claimed tile order launches every
  // CTA (those on the dispatch's SMs start late and claim fewer tiles), the static one only the SMs left. Only with
  // the hook, whose waits order its reads of the rows after their writes.
  int32_t overlap_sms;
  RowsDone done;
  ErrorRecord* error;
  int32_t num_sms;
};

// The host heuristics' choices for one launch (choose_gemm_config), kernel template parameters (the built kernels:
// csrc/gemm/instantiations/variants.cuh). Both tile orders give the same bits; 192-row tiles sum their tail rows in
// another order than half tiles do. The choice depends on the problem alone, so every result is deterministic.
struct GemmConfig {
  // kRows: CTAs claim tiles from GroupedGemmArgs::tile_counter instead of taking every grid-th: the CTAs stay near
  // each other in the sequence, so the experts they touch at once fit L2 when an expert's weights are large.
  bool claim_tiles = false;
  // kRows: an expert whose rows are an odd multiple of 64 above 128 starts with one 192-row tile instead of ending
  // with a 64-row one (whose k-slices wait on the weight slice, not on the tensor cores): the slice serves 192 rows.
  bool merge_tails = false;
};

// The variants that have the claimed tile order: the row GEMMs but FC2 dgrad, whose register-tight epilogue it
// slows (spills, or slower without them).
constexpr bool gemm_claims_tiles(GemmSchedule s, GemmEpilogue e) {
  return s == GemmSchedule::kRows && e != GemmEpilogue::kSwiGLUBackward;
}

// The variants that have 192-row tiles: FC1 and FC2 (K-major weights; two staging boxes per consumer warpgroup hold
// the tail rows' A slices, one per stage). With MN-major weights (FC1 dgrad) ptxas serialised the wgmma (C7514).
constexpr bool gemm_merges_tails(GemmSchedule s, GemmEpilogue e, bool b_k_major) {
  return s == GemmSchedule::kRows && e != GemmEpilogue::kSwiGLUBackward && b_k_major;
}

// The heuristics: the claimed order where an expert's weights exceed 8 MiB (Qwen3-235B's; at Qwen3-30B's the static
// order is level or faster) and there are more tiles than CTAs, or where the caller gives the counter (a dispatch
// zeroed it: the CTAs that start late, on SMs the dispatch held, take fewer tiles); 192-row tiles where the claimed
// order pays, outside the rows-ready hook (the expert-parallel path is not measured with them).
GemmConfig choose_gemm_config(const GroupedGemmArgs& args);

// Whether a kernel is built for this variant and config (the generated list csrc/gemm/instantiations/variants.cuh).
bool gemm_config_built(const GroupedGemmArgs& args, const GemmConfig& config);

// Whether the kernel family covers this problem on this device (sm_90 built in, sizes tile-aligned).
bool grouped_gemm_supported(const GroupedGemmArgs& args, int device, const char** why);

// Whether the kernels cover every GEMM of an MoE layer with these sizes on this device (else *why).
bool moe_gemms_supported(int device, int64_t hidden, int64_t intermediate, const char** why);

// cudaErrorInvalidValue when config.claim_tiles is set without a tile_counter; cudaErrorNotSupported when no kernel
// is built for the config (gemm_config_built).
cudaError_t launch_grouped_gemm(const GroupedGemmArgs& args, const GemmConfig& config, cudaStream_t stream);

// Loads every built kernel on the current device now (CUDA loads a kernel lazily at its first launch, and that load
// waits for the kernels running then: a first launch beside a kernel that spins on peers could wait for it).
cudaError_t preload_grouped_gemm_kernels();

}  // namespace primemoe
