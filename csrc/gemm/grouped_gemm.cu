// Host side of the grouped GEMM family: checks, TMA descriptors, variant choice, launch.
#include <cuda.h>

#include <atomic>
#include <cstdint>

#include "grouped_gemm_launch.cuh"
#include "host_common.cuh"
#include "instantiations/variants.cuh"  // every built (variant, config)

namespace primemoe {
namespace {

using gemm_host::aligned16;
using gemm_host::compute_capability;
using gemm_host::encode_tiled;

// A 3-D bf16 tensor (inner, outer, layer), inner contiguous, moved in 128-byte swizzled boxes of
// 64 inner elements by box_rows outer rows: 128 for K-major operands, 64 for MN-major ones and the
// epilogue's stores.
cudaError_t make_map(CUtensorMap* map, const void* base, uint64_t inner, uint64_t outer, uint64_t layers,
                     uint32_t box_rows) {
  return gemm_host::make_swizzled_map(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, inner, outer, layers, 64,
                                      box_rows);
}

// kRows: rows of one expert's weight operand (FC1's gate and up projections together).
uint64_t weight_rows(const GroupedGemmArgs& a) {
  return a.epilogue == GemmEpilogue::kSwiGLU ? 2 * uint64_t(a.n) : uint64_t(a.n);
}

// The device and the sizes, without the operands' addresses.
bool shape_supported(GemmSchedule schedule, GemmEpilogue epilogue, int64_t m, int64_t n, int64_t k, int device,
                     const char** why) {
  auto no = [&](const char* reason) {
    if (why != nullptr) *why = reason;
    return false;
  };
#ifndef PRIMEMOE_HAVE_SM90A
  return no("this build has no sm_90a kernels");
#else
  if (compute_capability(device) != 90) return no("the grouped GEMM kernels need an sm_90 GPU");
#endif
  if (encode_tiled() == nullptr) return no("the driver lacks cuTensorMapEncodeTiled");
  if (n <= 0 || n % gemm_tile_n(epilogue) != 0) return no("the output width is not a multiple of the tile width");
  if (schedule == GemmSchedule::kRows && (k <= 0 || k % kGemmTileK != 0)) {
    return no("the reduction length is not a multiple of 64");
  }
  if (schedule == GemmSchedule::kExperts && (m <= 0 || m % 128 != 0)) {
    return no("the per-expert output height is not a multiple of 128");
  }
  return true;
}

// An upper bound of the output tiles the walker makes (kRows: every expert's partial last block counted once more).
int64_t max_output_tiles(const GroupedGemmArgs& a) {
  const int64_t row_tiles = a.schedule == GemmSchedule::kRows ? a.num_rows / kGemmTileM + a.num_experts + 1
                                                                : int64_t(a.num_experts) * (a.m / kGemmTileM);
  return row_tiles * (a.n / gemm_tile_n(a.epilogue));
}

}  // namespace

bool grouped_gemm_supported(const GroupedGemmArgs& a, int device, const char** why) {
  if (!shape_supported(a.schedule, a.epilogue, a.m, a.n, a.k, device, why)) return false;
  if (max_output_tiles(a) >= (int64_t(1) << 31)) {  // the kernels count tiles in 32 bits in places
    if (why != nullptr) *why = "more than 2^31 output tiles";
    return false;
  }
  if (!aligned16(a.a) || !aligned16(a.b) || !aligned16(a.out) || !aligned16(a.out_h) || !aligned16(a.in_h) ||
      !aligned16(a.out_dh)) {
    if (why != nullptr) *why = "operands are not 16-byte aligned";
    return false;
  }
  return true;
}

bool moe_gemms_supported(int device, int64_t hidden, int64_t intermediate, const char** why) {
  using S = GemmSchedule;
  using E = GemmEpilogue;
  const int64_t h = hidden;
  const int64_t i = intermediate;
  return shape_supported(S::kRows, E::kSwiGLU, 0, i, h, device, why) &&             // FC1
         shape_supported(S::kRows, E::kStore, 0, h, i, device, why) &&              // FC2
         shape_supported(S::kRows, E::kSwiGLUBackward, 0, i, h, device, why) &&     // FC2 dgrad
         shape_supported(S::kRows, E::kStore, 0, h, 2 * i, device, why) &&          // FC1 dgrad
         shape_supported(S::kExperts, E::kStore, 2 * i, h, 0, device, why) &&       // w1 wgrad
         shape_supported(S::kExperts, E::kStore, h, i, 0, device, why);             // w2 wgrad
}

namespace {

// Where the claimed order pays: experts' weights above 8 MiB, and more tiles than CTAs (with at most one tile per
// CTA the order cannot matter, so no counter is zeroed).
constexpr uint64_t kClaimTilesAboveWeightBytes = uint64_t(8) << 20;

bool claimed_order_pays(const GroupedGemmArgs& a) {
  return weight_rows(a) * uint64_t(a.k) * 2 > kClaimTilesAboveWeightBytes && max_output_tiles(a) > a.num_sms;
}

}  // namespace

GemmConfig choose_gemm_config(const GroupedGemmArgs& a) {
  GemmConfig config{};
  if (a.schedule != GemmSchedule::kRows) return config;
  const bool claimed = claimed_order_pays(a);
  config.claim_tiles = gemm_claims_tiles(a.schedule, a.epilogue) && (claimed || a.tile_counter != nullptr);
  config.merge_tails = gemm_merges_tails(a.schedule, a.epilogue, a.b_k_major) && claimed && a.hook.counters == nullptr &&
                       a.done.flags == nullptr;
  return config;
}


bool gemm_config_built(const GroupedGemmArgs& a, const GemmConfig& config) {
#define PRIMEMOE_BUILT(S, E, BK, CLAIM, MERGE)                                                           \
  if (a.schedule == GemmSchedule::S && a.epilogue == GemmEpilogue::E && a.b_k_major == BK &&            \
      config.claim_tiles == CLAIM && config.merge_tails == MERGE) {                                     \
    return true;                                                                                         \
  }
  PRIMEMOE_GEMM_VARIANT_LIST(PRIMEMOE_BUILT)
#undef PRIMEMOE_BUILT
  return false;
}

cudaError_t preload_grouped_gemm_kernels() {
  using namespace sm90;
  const GemmParams params{};
  cudaError_t err = cudaSuccess;
#define PRIMEMOE_PRELOAD(S, E, BK, CLAIM, MERGE)                                                           \
  if (err == cudaSuccess) err = launch<GemmSchedule::S, GemmEpilogue::E, BK, CLAIM, MERGE>(params, 0, false, nullptr);
  PRIMEMOE_GEMM_VARIANT_LIST(PRIMEMOE_PRELOAD)
#undef PRIMEMOE_PRELOAD
  return err;
}

cudaError_t launch_grouped_gemm(const GroupedGemmArgs& a, const GemmConfig& config, cudaStream_t stream) {
  using namespace sm90;
  if (config.claim_tiles && a.tile_counter == nullptr) return cudaErrorInvalidValue;
  if (a.overlap_sms > 0 && a.hook.counters == nullptr) return cudaErrorInvalidValue;
  // Published results: the row GEMMs' plain epilogue, whole 64-row blocks (no 192-row tiles).
  if (a.done.flags != nullptr && (a.schedule != GemmSchedule::kRows || a.epilogue != GemmEpilogue::kStore ||
                                  config.merge_tails || a.done.cols != a.n / kGemmTileN)) {
    return cudaErrorInvalidValue;
  }
  if (a.accumulate != nullptr && (a.schedule != GemmSchedule::kExperts || a.epilogue != GemmEpilogue::kStore)) {
    return cudaErrorInvalidValue;
  }
  if (!gemm_config_built(a, config)) return cudaErrorNotSupported;
  GemmParams params{};
  params.args = a;
  const uint64_t rows = uint64_t(a.num_rows);
  const uint64_t experts = uint64_t(a.num_experts);
  cudaError_t err;
  if (a.schedule == GemmSchedule::kRows) {
    const uint64_t b_rows = weight_rows(a);
    err = make_map(&params.tma_a, a.a, a.k, rows, 1, 128);
    if (err == cudaSuccess) err = make_map(&params.tma_a_half, a.a, a.k, rows, 1, 64);
    if (err == cudaSuccess) {
      err = a.b_k_major ? make_map(&params.tma_b, a.b, a.k, b_rows, experts, 128)
                        : make_map(&params.tma_b, a.b, b_rows, a.k, experts, 64);
    }
  } else {
    err = make_map(&params.tma_a, a.a, a.m, rows, 1, 64);
    if (err == cudaSuccess) err = make_map(&params.tma_b, a.b, a.n, rows, 1, 64);
  }
  if (err != cudaSuccess) return err;
  const uint64_t out_rows = a.schedule == GemmSchedule::kRows ? rows : experts * uint64_t(a.m);
  // Accumulating weight gradients are added from registers: no store map.
  if (a.accumulate == nullptr) err = make_map(&params.tma_out, a.out, a.n, out_rows, 1, 64);
  const void* out2 = a.epilogue == GemmEpilogue::kSwiGLU ? a.out_h
                     : a.epilogue == GemmEpilogue::kSwiGLUBackward ? a.out_dh
                                                                    : nullptr;
  if (err == cudaSuccess && out2 != nullptr) err = make_map(&params.tma_out2, out2, 2 * uint64_t(a.n), rows, 1, 64);
  if (err != cudaSuccess) return err;
  // A static order's CTA that waits for an SM the dispatch holds would start its whole share late.
  int sms = a.overlap_sms > 0 && !config.claim_tiles ? a.num_sms - a.overlap_sms : a.num_sms;
  if (a.done.flags != nullptr) sms -= a.done.consumer_sms;  // the dependent that reads the results runs beside it
  const int grid = sms > 0 ? sms : 1;
#define PRIMEMOE_LAUNCH(S, E, BK, CLAIM, MERGE)                                                          \
  if (a.schedule == GemmSchedule::S && a.epilogue == GemmEpilogue::E && a.b_k_major == BK &&            \
      config.claim_tiles == CLAIM && config.merge_tails == MERGE) {                                     \
    return launch<GemmSchedule::S, GemmEpilogue::E, BK, CLAIM, MERGE>(params, grid, a.overlap_sms > 0, stream); \
  }
  PRIMEMOE_GEMM_VARIANT_LIST(PRIMEMOE_LAUNCH)
#undef PRIMEMOE_LAUNCH
  return cudaErrorNotSupported;
}

}  // namespace primemoe
