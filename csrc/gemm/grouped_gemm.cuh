// Expert-grouped BF16 GEMMs of the MoE layer on Hopper: one persistent,
// warp-specialised kernel family (a producer warpgroup feeding two wgmma consumer warpgroups)
// whose tile scheduler walks the routing layout's device-side expert offsets.
//
// Row space: the expert-major rows of dispatch_layout with row_align = kGemmRowAlign (64),
// padding rows zero. kRows walks each expert's rows in 128-row tiles; an expert's last tile
// may have 64 rows (a half tile), so no tile straddles two experts. Where the kernel splits
// half tiles (see grouped_gemm_sm90.cuh), at most 63 padding rows per expert are multiplied
// (a 128-row alignment multiplied ~64 on average); elsewhere a half tile costs a full one.
//
//   kRows    out[r, :] = A[r, :] (K) x B[e(r)]         M = routed rows, per-expert B
//   kExperts out[e]    = A[rows of e]^T x B[rows of e] K = routed rows, per-expert out
//
// The producer's wait hook (RowsReadyHook) is where the expert-parallel path plugs
// in: before loading an expert's first rows it waits for that expert's arrival
// counter, so GEMM tiles start as soon as their rows have landed.
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

struct GroupedGemmArgs {
  GemmSchedule schedule;
  GemmEpilogue epilogue;
  // kRows: a = rows [num_rows, k] (K-major; gathered: the tokens, see a_row_src); b = weights [E, n, k]
  // (b_k_major) or [E, k, n].
  // kExperts: a = rows [num_rows, m], b = rows [num_rows, n]; both reduced over each expert's rows.
  const void* a;
  const void* b;
  bool b_k_major;
  int64_t num_rows;  // allocated rows of the row operands and outputs (>= expert_offsets[E])
  // kRows: output rows past expert_offsets[E] are left unwritten instead of zeroed (for callers that
  // read only the routed rows, e.g. the expert-parallel path, whose buffers are sized for the worst case).
  bool skip_unrouted_rows;
  int32_t m;         // kExperts only: output rows per expert
  int32_t n;         // output columns (kSwiGLU: of the activation, i.e. half of b's rows)
  int32_t k;         // kRows only: reduction length
  int32_t num_experts;
  const int32_t* expert_offsets;  // [E + 1], multiples of kGemmRowAlign
  // kExperts, optional: [E] routed rows of each expert (the layout's counts). The reduction then stops
  // at the last 64-row k-slice holding a routed row: the padding rows after it are zeros (as every
  // producer of the layout leaves them), so no output changes, and up to a k-slice of work per expert
  // (~5% of the weight gradients at ~512 rows per expert) is saved.
  const int32_t* expert_rows;
  void* out;                      // kRows: [num_rows, n]; kExperts: [E, m, n]; bf16 (kSwiGLUBackward: aw)
  // kRows, optional: the gather of routed tokens fused into the A load. Row r of A is then row
  // a_row_src[r] / a_src_div of `a` (the tokens, [*, k]), or zeros where a_row_src[r] < 0.
  const int32_t* a_row_src;
  int32_t a_src_div;
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
  // Zero at launch where GemmConfig::claim_tiles is set (the tile claim counter), else unused.
  int32_t* tile_counter;
  ErrorRecord* error;
  int32_t num_sms;
#ifdef PRIMEMOE_GEMM_TILE_TRACE
  // scripts/tile_trace.cu only (never the library's build): kTileTraceFields timestamps per tile taken, for the
  // first kTileTraceTiles tiles of each CTA.
  uint64_t* tile_trace;
#endif
};

#ifdef PRIMEMOE_GEMM_TILE_TRACE
// Per tile a CTA takes (consumer thread 0): [0] its index | rows << 32 | SM << 48, then %globaltimer ns when it
// was taken, when a 192-row tile's boxes were free (else 0), when its first k-slice had landed, when its mainloop
// was done. The tile after the last one has only [1], the end of the last epilogue.
constexpr int kTileTraceFields = 5;
constexpr int kTileTraceTiles = 256;
// Then per FC1 activation job of consumer warpgroup 0 (its activation warp's lane 0 from [1]): [0] posted (0 for a
// 192-row tile's tail job), [1] started, [2] h's stores have read the boxes, [3] activation written, [4] its store
// has read them (the boxes are free).
constexpr int kTileTraceJobFields = 5;
constexpr int kTileTraceJobs = 512;
constexpr int kTileTraceCtaWords = kTileTraceTiles * kTileTraceFields + kTileTraceJobs * kTileTraceJobFields;
#endif

// Who computes FC1's activation around a 192-row tile (merge_tails): kConsumers, the consumer warpgroups for its
// tail rows and for the tile before it, whose two jobs would hold the boxes that the merged tile's tail slices
// need (its mainloop waited ~9-13 us for them); kTail, for its tail rows only; kWarps, neither (the activation
// warps' jobs). All give the same bits.
enum class MergedActivation { kConsumers, kTail, kWarps };

// The host heuristics' choices for one launch (choose_gemm_config).
struct GemmConfig {
  // kRows: a half tile's k-slices alternate between the consumer warpgroups. Always set since the claimed
  // order (below) removed the case where it lost; a kernel parameter still, folded when a GPU run can check it.
  bool split_half_tiles;
  bool claim_tiles;  // kRows: CTAs claim tiles from GroupedGemmArgs::tile_counter, not every grid-th
  // kRows (gemm_pairs_rows): 2-CTA clusters take row blocks 2q and 2q + 1 of one column tile; where both are one
  // expert's, each CTA loads half of the weight tile and multicasts it to both. With claim_tiles, rank 0 claims pairs.
  bool pair_rows;
  // FC1 (gemm_activation_warps): two producer warps compute the activation from the consumers' pre-activations.
  bool activation_warps;
  // With activation_warps: the producer warpgroup's fourth warp computes the last activation_helper_rows rows (a
  // multiple of 8; 0: none) of every job of both (kActivationHelperRows).
  int32_t activation_helper_rows;
  // kRows (gemm_merges_tails): an expert whose rows are an odd multiple of 64 above 128 starts with one 192-row
  // tile instead of ending with a 64-row one; its k-slices carry the weight slice once for 192 rows. Not with
  // pair_rows; FC1 only with activation_warps.
  bool merge_tails;
  // FC1 with merge_tails: who computes the activation around a 192-row tile.
  MergedActivation merged_activation;
};

// kAuto: the heuristics' tile order; kStatic / kClaimed force one (comparisons and tests; both give the same
// bits). kClaimed applies only to the variants built with it (gemm_claims_tiles).
enum class TileOrder { kAuto, kStatic, kClaimed };

// kAuto: the heuristics' choice of paired row blocks (gemm_pairs_pay); kOff / kOn force it where the variant has
// them (gemm_pairs_rows). Both give the same bits.
enum class PairRows { kAuto, kOff, kOn };

// Who computes FC1's activation where the variant has activation warps (gemm_activation_warps): those warps with
// the helper (the default), without it, or the consumer warpgroups in their epilogue (comparisons). All give the
// same bits (the consumers only on FC1 without 192-row tiles, which need the warps).
enum class Fc1Activation { kWarps, kTwoWarps, kConsumers };

// The rows of each 64-row activation job the helper warp takes: half. 24 (the owners 40, the helper 48 of two jobs
// posted at once) was no faster: FC1 at Qwen3-235B T = 8192 0.3% slower than 32 and level with no helper, five
// rounds back to back on one H200 (benchmarks/RESULTS.md, twenty-eighth session).
constexpr int32_t kActivationHelperRows = 32;

// kAuto: the heuristics' choice of 192-row tail tiles (gemm_merge_pays); kOff / kOn force it where the variant has
// them (gemm_merges_tails) and row blocks are not paired.
enum class MergeTails { kAuto, kOff, kOn };

GemmConfig choose_gemm_config(const GroupedGemmArgs& args, TileOrder order = TileOrder::kAuto,
                              PairRows pairs = PairRows::kAuto, Fc1Activation activation = Fc1Activation::kWarps,
                              MergeTails merge = MergeTails::kAuto,
                              MergedActivation merged_activation = MergedActivation::kConsumers);

// The variants built with the claimed tile order (a gathered A's producer warp walks the tiles, its lane 0 claims).
// Not FC2 dgrad: its epilogue is register-tight, and the claim's registers made ptxas
// spill 136 bytes there, which cost ~12% (H200, Qwen3-30B and -235B at T = 8192 and 16384), four times
// what the order gained. Since the epilogues' shared-memory accesses go by 32-bit address (twelfth
// session) it compiles without a spill, but still measured 1.8-4.1% slower (thirteenth session).
constexpr bool gemm_claims_tiles(GemmSchedule s, GemmEpilogue e) {
  return s == GemmSchedule::kRows && e != GemmEpilogue::kSwiGLUBackward;
}

// The variants built with paired row blocks (GemmConfig::pair_rows): the forward's K-major weights (a gathered A is
// copied into each CTA's own stage; only the weight tile is shared).
// Each weight byte then crosses from L2 once per pair of row blocks instead of once per block. Halving the weight
// loads outright (a timing-only kernel that reused every other stage's weights) took the power-capped back-to-back
// Qwen3-235B T = 8192 FC1 from 3.07 to 2.86 ms and FC2 from 1.57 to 1.37 ms on the H200. Pairs got part of that:
// 2.7% (FC1) and 1.3% (FC2) faster than the static order, but 0.8% and 1.1% slower than the claimed order the
// heuristics pick there, which statically placed pairs gave up; at Qwen3-30B (static order) FC1 -1.0%, FC2 +1.5%.
// Claimed pairs (rank 0's producer claims each pair and passes it to rank 1's, fifteenth session), against the
// unpaired default order (claimed at 235B, static at 30B), back to back: 235B FC1 -0.8..-2.6%, FC2 +1.6..+2.3%,
// 30B FC1 -1.2..0.0%, FC2 -0.8..+2.4% (gemm_pairs_pay).
constexpr bool gemm_pairs_rows(GemmSchedule s, bool b_k_major) {
  return s == GemmSchedule::kRows && b_k_major;
}

// Where the heuristics pair row blocks: FC1 (the SwiGLU epilogue; FC2 is slower at 235B) with weights above 8 MiB
// per expert (the claimed order's, where pairs are level or faster: 235B FC1 -2.2..+0.1%), with more tiles than SMs
// (fewer leave SMs idle whatever the order). At 30B (6 MiB, static order) unpaired FC1 measured 1.4-4.7% faster
// and the forward 0.1-2.3% (H200, back to back, twenty-third session). Not under the rows-ready hook: the
// expert-parallel path has not been measured with pairs. Where FC1 merges tails (gemm_merge_pays, the same sizes
// with the activation warps) the merged tiles win (choose_gemm_config): pairs remain the gathered FC1's.
bool gemm_pairs_pay(const GroupedGemmArgs& args);

// The variants built with activation warps (GemmConfig::activation_warps): FC1, also with a gathered A (its copies
// take the producer warpgroup's first warp, the activation its second and third). The consumers then hand the
// pre-activations over and never compute the activation, which measured 3.9% (Qwen3-235B) / 5.9% (Qwen3-30B) of FC1
// with the tensor cores idle; FC1 -2.5% / -2.8% back to back on the H200 (benchmarks/RESULTS.md, nineteenth
// session).
constexpr bool gemm_activation_warps(GemmSchedule s, GemmEpilogue e) {
  return s == GemmSchedule::kRows && e == GemmEpilogue::kSwiGLU;
}

// The variants built with 192-row tail tiles (GemmConfig::merge_tails): FC2 and FC1 (K-major weights, a
// TMA-loaded A; its two staging boxes per consumer warpgroup, 32 KiB, hold the tail rows' 64-row A slices, one per
// stage). A 64-row tile took as long as a full one at Qwen3-235B (its k-slices wait on the 32 KiB weight slice, not
// on the tensor cores: benchmarks/RESULTS.md, twenty-first session); merged, that slice serves 192 rows in one CTA.
// Each is its expert's first tile (TileWalker). With MN-major weights (FC1 dgrad) ptxas serialised the wgmma (C7514).
constexpr bool gemm_merges_tails(GemmSchedule s, GemmEpilogue e, bool b_k_major, bool gather_a) {
  return s == GemmSchedule::kRows && e != GemmEpilogue::kSwiGLUBackward && b_k_major && !gather_a;
}

// Where the heuristics merge tails: FC1 and FC2 where tiles are claimed (experts' weights above 8 MiB; in the static
// order merged tiles, 1.5 tiles long, unbalanced the CTAs: FC1 +10.6%, FC2 +1.6% at Qwen3-30B T = 16384), outside
// the rows-ready hook (not measured); FC1 then loses its paired row blocks. At Qwen3-235B T = 8192 FC1 measured
// -1.4%, FC2 -2.6%, the forward -0.25% against FC2 alone merged (twenty-fifth session, benchmarks/RESULTS.md).
bool gemm_merge_pays(const GroupedGemmArgs& args);

// Whether the kernel family covers this problem on this device (sm_90 built in, sizes tile-aligned).
bool grouped_gemm_supported(const GroupedGemmArgs& args, int device, const char** why);

// Launches issued as 2-CTA clusters (GemmConfig::pair_rows) on `device` since the process started (captured ones
// included, graph replays not), so that tests can tell a paired launch from the unpaired fallback, whose results
// are the same bits.
int64_t paired_gemm_launches(int device);
void count_paired_gemm_launch(int device);

// Whether the kernels cover every GEMM of an MoE layer with these sizes on this device (else *why).
bool moe_gemms_supported(int device, int64_t hidden, int64_t intermediate, const char** why);

// cudaErrorInvalidValue when config.claim_tiles is set without a tile_counter.
cudaError_t launch_grouped_gemm(const GroupedGemmArgs& args, const GemmConfig& config, cudaStream_t stream);

}  // namespace primemoe
