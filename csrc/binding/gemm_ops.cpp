// The expert GEMMs over the routing layout: expert_gemm, fc1_swiglu, fc2_dgrad_swiglu, expert_wgrad(_accumulate),
// expert_gemm_unsupported, and the test-only _gemm_force_config. Each CUDA impl is checks, then
// GroupedGemmArgs, then the engine's launcher (gemm/grouped_gemm.cuh).

#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "common.h"
#include "gemm/grouped_gemm.cuh"

namespace primemoe {
namespace {

void check_offsets(const Tensor& offsets, const Tensor& like, int64_t num_experts) {
  check_index(offsets, "expert_offsets", 1);
  PRIMEMOE_CHECK(offsets.numel() == num_experts + 1, "expert_offsets: expected ", num_experts + 1,
                 " entries (one per expert + 1), got ", offsets.numel());
  PRIMEMOE_CHECK(offsets.device() == like.device(), "expert_offsets: expected it on the operands' device");
}

void check_weights3(const Tensor& w, const char* name) {
  PRIMEMOE_CHECK(w.dim() == 3, name, ": expected a 3-D tensor [E, out, in], got ", w.sizes());
  PRIMEMOE_CHECK(w.scalar_type() == ScalarType::BFloat16, name, ": expected bfloat16, got ", w.scalar_type());
  PRIMEMOE_CHECK(w.is_contiguous(), name, ": expected a contiguous tensor");
  check_aligned(w, name);
}

// zero_unrouted (kRows): output rows past the routed ones are written as zeros, else left unwritten.
GroupedGemmArgs gemm_args(GemmSchedule schedule, GemmEpilogue epilogue, const Tensor& a, const Tensor& b,
                          bool b_k_major, int64_t m, int64_t n, int64_t k, const Tensor& offsets, const Tensor& out,
                          bool zero_unrouted) {
  GroupedGemmArgs g{};
  g.schedule = schedule;
  g.epilogue = epilogue;
  g.a = a.data_ptr();
  g.b = b.data_ptr();
  g.b_k_major = b_k_major;
  g.num_rows = a.size(0);
  g.zero_unrouted = zero_unrouted;
  g.m = static_cast<int32_t>(m);
  g.n = static_cast<int32_t>(n);
  g.k = static_cast<int32_t>(k);
  g.num_experts = static_cast<int32_t>(offsets.numel() - 1);
  g.expert_offsets = data_of<int32_t>(offsets);
  g.out = out.data_ptr();
  g.num_sms = gemm_sms(a.get_device_index());
  return g;
}

// Set by _gemm_force_config (tests): the config of this thread's next launches instead of the heuristics'.
thread_local std::optional<GemmConfig> forced_config;

void gemm_force_config_op(int64_t claim_tiles, int64_t merge_tails) {
  if (claim_tiles == -1 && merge_tails == -1) {
    forced_config.reset();
    return;
  }
  PRIMEMOE_CHECK((claim_tiles == 0 || claim_tiles == 1) && (merge_tails == 0 || merge_tails == 1),
                 "_gemm_force_config: expected claim_tiles and merge_tails both 0 or 1 (both -1 clears), got ",
                 claim_tiles, " and ", merge_tails);
  GemmConfig config{};
  config.claim_tiles = claim_tiles == 1;
  config.merge_tails = merge_tails == 1;
  forced_config = config;
}

void run_gemm(const GroupedGemmArgs& g, const Tensor& like, const char* what) {
  const char* why = "";
  PRIMEMOE_CHECK(grouped_gemm_supported(g, like.get_device_index(), &why), "primemoe: ", what, ": ", why);
  const GemmConfig config = forced_config.has_value() ? *forced_config : choose_gemm_config(g);
  PRIMEMOE_CHECK(gemm_config_built(g, config), "primemoe: ", what, ": no kernel is built for GemmConfig{claim_tiles=",
                 int(config.claim_tiles), ", merge_tails=", int(config.merge_tails), "} (",
                 forced_config.has_value() ? "forced by _gemm_force_config" : "chosen by choose_gemm_config", ")");
  GroupedGemmArgs args = g;
  Tensor counter;  // the claimed tile order's counter, zeroed on the stream (graph-capturable)
  if (config.claim_tiles && args.tile_counter == nullptr) {
    counter = zeros_like_device(like, {1}, ScalarType::Int);
    args.tile_counter = data_of<int32_t>(counter);
  }
  check_cuda(launch_grouped_gemm(args, config, current_stream(like)), what);
}

// rows [R, K] x w[e] for each expert's rows: w is [E, N, K] (w_kn = false) or [E, K, N].
void check_row_gemm_args(const Tensor& rows, const Tensor& w, const Tensor& offsets, bool w_kn) {
  check_rows(rows, "rows");
  check_weights3(w, "w");
  check_same_device(w, rows, "w");
  check_offsets(offsets, rows, w.size(0));
  const int64_t k = w_kn ? w.size(1) : w.size(2);
  PRIMEMOE_CHECK(rows.size(1) == k, "rows: expected ", k, " columns (w's reduction size), got ", rows.size(1));
}

void check_row_weight(const std::optional<Tensor>& row_weight, const Tensor& rows) {
  if (!row_weight.has_value()) return;
  PRIMEMOE_CHECK(row_weight->dim() == 1 && row_weight->numel() == rows.size(0) &&
                     row_weight->scalar_type() == ScalarType::Float && row_weight->is_contiguous(),
                 "row_weight: expected a contiguous float32 vector of ", rows.size(0), " entries");
  check_same_device(*row_weight, rows, "row_weight");
}

// done_* (GroupedGemmArgs::done): all three or none; one flag and one count per 64-row block of the rows.
void check_done_args(const Tensor& rows, const std::optional<Tensor>& flags, const std::optional<Tensor>& counts,
                     const std::optional<Tensor>& epoch, int64_t done_sms) {
  PRIMEMOE_CHECK(done_sms >= 0, "done_sms: expected >= 0, got ", done_sms);
  if (!flags.has_value() && !counts.has_value() && !epoch.has_value()) {
    PRIMEMOE_CHECK(done_sms == 0, "done_sms: only with done_flags");
    return;
  }
  PRIMEMOE_CHECK(flags.has_value() && counts.has_value() && epoch.has_value(),
                 "done_flags, done_counts, done_epoch: give all three or none");
  const int64_t blocks = rows.size(0) / kGemmRowAlign + 1;
  PRIMEMOE_CHECK(flags->scalar_type() == ScalarType::Long && flags->is_contiguous() && flags->numel() >= blocks,
                 "done_flags: expected a contiguous int64 tensor of at least ", blocks, " flags (one per 64 rows)");
  PRIMEMOE_CHECK(counts->scalar_type() == ScalarType::Int && counts->is_contiguous() && counts->numel() >= blocks,
                 "done_counts: expected a contiguous int32 tensor of at least ", blocks, " counts (one per 64 rows)");
  PRIMEMOE_CHECK(epoch->scalar_type() == ScalarType::Long && epoch->numel() == 1,
                 "done_epoch: expected a 1-element int64 tensor");
  for (const auto& [t, name] : {std::pair{&*flags, "done_flags"}, std::pair{&*counts, "done_counts"},
                                std::pair{&*epoch, "done_epoch"}}) {
    check_same_device(*t, rows, name);
  }
  if (rows.is_cuda()) {
    const int64_t sms = gemm_sms(rows.get_device_index());
    PRIMEMOE_CHECK(done_sms < sms, "done_sms: ", done_sms, " SMs for the reader leave none of the GEMMs' ", sms);
  }
}

void check_expert_gemm_args(const Tensor& rows, const Tensor& w, const Tensor& offsets, bool w_kn,
                            const std::optional<Tensor>& row_weight, const std::optional<Tensor>& done_flags,
                            const std::optional<Tensor>& done_counts, const std::optional<Tensor>& done_epoch,
                            int64_t done_sms) {
  check_row_gemm_args(rows, w, offsets, w_kn);
  check_row_weight(row_weight, rows);
  check_done_args(rows, done_flags, done_counts, done_epoch, done_sms);
  if (done_flags.has_value()) {
    const int64_t n = w_kn ? w.size(2) : w.size(1);
    PRIMEMOE_CHECK(n % kGemmTileN == 0, "done_flags: published results need output columns in whole tiles of ",
                   kGemmTileN, ", got ", n);
  }
}

Tensor expert_gemm_cuda(const Tensor& rows, const Tensor& w, const Tensor& offsets, bool w_kn,
                        const std::optional<Tensor>& row_weight, bool zero_unrouted,
                        const std::optional<Tensor>& done_flags, const std::optional<Tensor>& done_counts,
                        const std::optional<Tensor>& done_epoch, int64_t done_sms) {
  check_expert_gemm_args(rows, w, offsets, w_kn, row_weight, done_flags, done_counts, done_epoch, done_sms);
  const DeviceGuard guard(rows.get_device_index());
  const int64_t n = w_kn ? w.size(2) : w.size(1);
  auto out = empty_like_device(rows, {rows.size(0), n});
  if (rows.size(0) == 0) return out;
  auto g = gemm_args(GemmSchedule::kRows, GemmEpilogue::kStore, rows, w, !w_kn, 0, n, rows.size(1), offsets, out,
                     zero_unrouted);
  g.row_weight = row_weight.has_value() ? data_of<float>(*row_weight) : nullptr;
  if (done_flags.has_value()) {
    g.done.flags = reinterpret_cast<uint64_t*>(data_of<int64_t>(*done_flags));
    g.done.counts = data_of<int32_t>(*done_counts);
    g.done.epoch = data_of<int64_t>(*done_epoch);
    g.done.cols = static_cast<int32_t>(n / kGemmTileN);
    g.done.consumer_sms = static_cast<int32_t>(done_sms);
  }
  run_gemm(g, rows, "expert_gemm");
  return out;
}

// The optional wait hook: before loading expert e's rows, the GEMM's producer waits until
// rows_ready[e] >= epoch[0] * per_epoch (the EP workspace's arrival counters); with overlap_sms > 0
// (GroupedGemmArgs::overlap_sms) the GEMM runs alongside the dispatch, which keeps that many of the GEMMs' SMs.
void check_hook(const std::optional<Tensor>& rows_ready, const std::optional<Tensor>& epoch, const Tensor& w,
                int64_t per_epoch, int64_t overlap_sms, const Tensor& rows) {
  PRIMEMOE_CHECK(overlap_sms >= 0, "overlap_sms: expected >= 0, got ", overlap_sms);
  PRIMEMOE_CHECK(overlap_sms == 0 || rows_ready.has_value(),
                 "overlap_sms: only with rows_ready (the wait that orders the GEMM's reads after the dispatch's writes)");
  if (overlap_sms > 0 && rows.is_cuda()) {
    const int64_t sms = gemm_sms(rows.get_device_index());
    PRIMEMOE_CHECK(overlap_sms < sms, "overlap_sms: the dispatch's ", overlap_sms, " SMs leave none of the GEMMs' ",
                   sms, " (primemoe.get_num_sms)");
  }
  if (!rows_ready.has_value()) {
    PRIMEMOE_CHECK(!epoch.has_value(), "epoch: only meaningful together with rows_ready");
    return;
  }
  PRIMEMOE_CHECK(epoch.has_value(), "epoch: required with rows_ready");
  for (const auto& [t, name] : {std::pair{*rows_ready, "rows_ready"}, std::pair{*epoch, "epoch"}}) {
    PRIMEMOE_CHECK(t.scalar_type() == ScalarType::Long && t.dim() == 1 && t.is_contiguous(), name,
                   ": expected a contiguous int64 vector");
    PRIMEMOE_CHECK(t.device() == w.device(), name, ": expected it on the operands' device");
  }
  PRIMEMOE_CHECK(rows_ready->numel() == w.size(0), "rows_ready: expected one counter per expert (",
                 w.size(0), "), got ", rows_ready->numel());
  PRIMEMOE_CHECK(epoch->numel() == 1, "epoch: expected one element, got ", epoch->numel());
  PRIMEMOE_CHECK(per_epoch >= 1, "per_epoch: expected >= 1, got ", per_epoch);
}

void check_fc1_args(const Tensor& rows, const Tensor& w1, const Tensor& offsets,
                    const std::optional<Tensor>& rows_ready, const std::optional<Tensor>& epoch, int64_t per_epoch,
                    const std::optional<Tensor>& tile_counter, int64_t overlap_sms) {
  check_row_gemm_args(rows, w1, offsets, false);
  PRIMEMOE_CHECK(w1.size(1) % 2 == 0, "w1: expected an even number of rows [gate; up], got ", w1.size(1));
  check_hook(rows_ready, epoch, w1, per_epoch, overlap_sms, rows);
  if (tile_counter.has_value()) {
    PRIMEMOE_CHECK(rows_ready.has_value(), "tile_counter: only meaningful together with rows_ready");
    PRIMEMOE_CHECK(tile_counter->scalar_type() == ScalarType::Int && tile_counter->numel() == 1 &&
                       tile_counter->is_contiguous(),
                   "tile_counter: expected a 1-element int32 tensor (the Buffer's, zeroed by its dispatch)");
    check_same_device(*tile_counter, rows, "tile_counter");
  }
}

void set_rows_ready(GroupedGemmArgs& g, const std::optional<Tensor>& rows_ready, const std::optional<Tensor>& epoch,
                    int64_t per_epoch, int64_t rank, int64_t overlap_sms, const Tensor& rows) {
  if (!rows_ready.has_value()) return;
  g.hook.counters = reinterpret_cast<const uint64_t*>(data_of<int64_t>(*rows_ready));
  g.hook.epoch = data_of<int64_t>(*epoch);
  g.hook.per_epoch = static_cast<uint64_t>(per_epoch);
  g.hook.rank = static_cast<int32_t>(rank);
  g.hook.timeout_ns = wait_timeout_ns();
  g.error = error_record_for(rows);  // where a timed-out wait is reported
  g.overlap_sms = static_cast<int32_t>(overlap_sms);
}

std::tuple<Tensor, Tensor> fc1_swiglu_cuda(const Tensor& rows, const Tensor& w1, const Tensor& offsets, bool keep_fc1,
                                           const std::optional<Tensor>& rows_ready, const std::optional<Tensor>& epoch,
                                           int64_t per_epoch, int64_t rank, bool zero_unrouted,
                                           const std::optional<Tensor>& tile_counter, int64_t overlap_sms) {
  check_fc1_args(rows, w1, offsets, rows_ready, epoch, per_epoch, tile_counter, overlap_sms);
  const DeviceGuard guard(rows.get_device_index());
  const int64_t inter = w1.size(1) / 2;
  auto a = empty_like_device(rows, {rows.size(0), inter});
  auto h = empty_like_device(rows, {keep_fc1 ? rows.size(0) : 0, 2 * inter});
  if (rows.size(0) == 0) return {a, h};
  auto g = gemm_args(GemmSchedule::kRows, GemmEpilogue::kSwiGLU, rows, w1, true, 0, inter, rows.size(1), offsets, a,
                     zero_unrouted);
  g.out_h = keep_fc1 ? h.data_ptr() : nullptr;
  set_rows_ready(g, rows_ready, epoch, per_epoch, rank, overlap_sms, rows);
  // The dispatch zeroed this counter: no fill kernel between it and this GEMM.
  if (tile_counter.has_value()) g.tile_counter = data_of<int32_t>(*tile_counter);
  run_gemm(g, rows, "fc1_swiglu");
  return {a, h};
}

void check_fc2_dgrad_args(const Tensor& dy_rows, const Tensor& w2, const Tensor& h, const Tensor& row_weight,
                          const Tensor& offsets, const std::optional<Tensor>& rows_ready,
                          const std::optional<Tensor>& epoch, int64_t per_epoch, int64_t overlap_sms) {
  check_row_gemm_args(dy_rows, w2, offsets, true);
  check_hook(rows_ready, epoch, w2, per_epoch, overlap_sms, dy_rows);
  check_rows(h, "h");
  check_same_device(h, dy_rows, "h");
  const int64_t inter = w2.size(2);
  PRIMEMOE_CHECK(h.size(0) == dy_rows.size(0) && h.size(1) == 2 * inter, "h: expected [", dy_rows.size(0), ", ",
                 2 * inter, "], got ", h.sizes());
  check_row_weight(row_weight, dy_rows);
  PRIMEMOE_CHECK(inter % kGemmTileN == 0, "w2: the intermediate size must be a multiple of ", kGemmTileN, ", got ",
                 inter);
}

// dh = d[gate | up] of silu(gate) * up times the row weight, aw = weight * a (FC2's wgrad operand),
// dot[:, p] = <da, a> over activation columns [256 p, 256 p + 256) (summed into d_topk_weights).
std::tuple<Tensor, Tensor, Tensor> fc2_dgrad_swiglu_cuda(const Tensor& dy_rows, const Tensor& w2, const Tensor& h,
                                                         const Tensor& row_weight, const Tensor& offsets,
                                                         bool zero_unrouted, const std::optional<Tensor>& rows_ready,
                                                         const std::optional<Tensor>& epoch, int64_t per_epoch,
                                                         int64_t rank, int64_t overlap_sms) {
  check_fc2_dgrad_args(dy_rows, w2, h, row_weight, offsets, rows_ready, epoch, per_epoch, overlap_sms);
  const DeviceGuard guard(dy_rows.get_device_index());
  const int64_t rows = dy_rows.size(0);
  const int64_t inter = w2.size(2);
  auto dh = empty_like_device(dy_rows, {rows, 2 * inter});
  auto aw = empty_like_device(dy_rows, {rows, inter});
  auto dot = empty_like_device(dy_rows, {rows, inter / kGemmTileN}, ScalarType::Float);
  if (rows == 0) return {dh, aw, dot};
  auto g = gemm_args(GemmSchedule::kRows, GemmEpilogue::kSwiGLUBackward, dy_rows, w2, false, 0, inter,
                     dy_rows.size(1), offsets, aw, zero_unrouted);
  g.in_h = h.data_ptr();
  g.row_weight = data_of<float>(row_weight);
  g.out_dh = dh.data_ptr();
  g.out_dot = data_of<float>(dot);
  set_rows_ready(g, rows_ready, epoch, per_epoch, rank, overlap_sms, dy_rows);
  run_gemm(g, dy_rows, "fc2_dgrad_swiglu");
  return {dh, aw, dot};
}

// out[e] = a_rows[rows of e]^T b_rows[rows of e]: the weight gradient, summed over each expert's rows.
// expert_rows: the layout's routed rows per expert, or none. The kernel then skips 64-row k-slices of
// padding, which must be zeros as the layout leaves them: wrong counts would give wrong results, so they
// are the layout's own.
void check_wgrad_args(const Tensor& a_rows, const Tensor& b_rows, const Tensor& offsets,
                      const std::optional<Tensor>& expert_rows) {
  check_rows(a_rows, "a_rows");
  check_rows(b_rows, "b_rows");
  check_same_device(b_rows, a_rows, "b_rows");
  PRIMEMOE_CHECK(a_rows.size(0) == b_rows.size(0), "b_rows: expected ", a_rows.size(0), " rows, got ",
                 b_rows.size(0));
  check_index(offsets, "expert_offsets", 1);
  PRIMEMOE_CHECK(offsets.numel() >= 2, "expert_offsets: expected at least one expert");
  check_same_device(offsets, a_rows, "expert_offsets");
  if (!expert_rows.has_value()) return;
  check_index(*expert_rows, "expert_rows", 1);
  PRIMEMOE_CHECK(expert_rows->numel() == offsets.numel() - 1, "expert_rows: expected one count per expert (",
                 offsets.numel() - 1, "), got ", expert_rows->numel());
  check_same_device(*expert_rows, a_rows, "expert_rows");
}

Tensor expert_wgrad_cuda(const Tensor& a_rows, const Tensor& b_rows, const Tensor& offsets,
                         const std::optional<Tensor>& expert_rows) {
  check_wgrad_args(a_rows, b_rows, offsets, expert_rows);
  const DeviceGuard guard(a_rows.get_device_index());
  auto out = empty_like_device(a_rows, {offsets.numel() - 1, a_rows.size(1), b_rows.size(1)});
  if (a_rows.size(0) == 0) return torch::stable::zero_(out);
  auto g = gemm_args(GemmSchedule::kExperts, GemmEpilogue::kStore, a_rows, b_rows, false, a_rows.size(1),
                     b_rows.size(1), 0, offsets, out, true);
  g.expert_rows = expert_rows.has_value() ? data_of<int32_t>(*expert_rows) : nullptr;
  run_gemm(g, a_rows, "expert_wgrad");
  return out;
}

// main_grad[e] += a_rows[rows of e]^T b_rows[rows of e] in fp32 (a weight's fp32 main gradient, Megatron's
// gradient-accumulation fusion): the weight gradient is never rounded to bf16 nor materialised.
void check_wgrad_accumulate_args(const Tensor& a_rows, const Tensor& b_rows, const Tensor& offsets,
                                 const std::optional<Tensor>& expert_rows, const Tensor& main_grad) {
  check_wgrad_args(a_rows, b_rows, offsets, expert_rows);
  check_main_grad(main_grad, offsets.numel() - 1, a_rows.size(1), b_rows.size(1), a_rows);
}

void expert_wgrad_accumulate_cuda(const Tensor& a_rows, const Tensor& b_rows, const Tensor& offsets,
                                  const std::optional<Tensor>& expert_rows, Tensor& main_grad) {
  check_wgrad_accumulate_args(a_rows, b_rows, offsets, expert_rows, main_grad);
  if (a_rows.size(0) == 0) return;  // adds nothing
  const DeviceGuard guard(a_rows.get_device_index());
  auto g = gemm_args(GemmSchedule::kExperts, GemmEpilogue::kStore, a_rows, b_rows, false, a_rows.size(1),
                     b_rows.size(1), 0, offsets, main_grad, true);
  g.out = nullptr;
  g.accumulate = data_of<float>(main_grad);
  g.expert_rows = expert_rows.has_value() ? data_of<int32_t>(*expert_rows) : nullptr;
  run_gemm(g, a_rows, "expert_wgrad_accumulate");
}

// Empty when the expert GEMM kernels cover an MoE of this size on `device`, else why not.
std::string expert_gemm_unsupported_op(int64_t device, int64_t hidden, int64_t intermediate) {
  const char* why = "";
  return moe_gemms_supported(static_cast<int>(device), hidden, intermediate, &why) ? "" : why;
}

// The checks the CPU kernels (python/primemoe/_cpu.py) run through _check_args.
const ArgCheckRegistration expert_gemm_check("expert_gemm", 7, 3, [](const OpArgs& a) {
  check_expert_gemm_args(a.tensor(0), a.tensor(1), a.tensor(2), a.integer(0) != 0, a.optional(3), a.optional(4),
                         a.optional(5), a.optional(6), a.integer(2));
});
const ArgCheckRegistration fc1_check("fc1_swiglu", 6, 5, [](const OpArgs& a) {
  check_fc1_args(a.tensor(0), a.tensor(1), a.tensor(2), a.optional(3), a.optional(4), a.integer(1), a.optional(5),
                 a.integer(4));
});
const ArgCheckRegistration fc2_dgrad_check("fc2_dgrad_swiglu", 7, 4, [](const OpArgs& a) {
  check_fc2_dgrad_args(a.tensor(0), a.tensor(1), a.tensor(2), a.tensor(3), a.tensor(4), a.optional(5), a.optional(6),
                       a.integer(1), a.integer(3));
});
const ArgCheckRegistration wgrad_check("expert_wgrad", 4, 0, [](const OpArgs& a) {
  check_wgrad_args(a.tensor(0), a.tensor(1), a.tensor(2), a.optional(3));
});
const ArgCheckRegistration wgrad_accumulate_check("expert_wgrad_accumulate", 5, 0, [](const OpArgs& a) {
  check_wgrad_accumulate_args(a.tensor(0), a.tensor(1), a.tensor(2), a.optional(3), a.tensor(4));
});

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(primemoe, CUDA, m) {
  m.impl("expert_gemm", TORCH_BOX(&expert_gemm_cuda));
  m.impl("fc1_swiglu", TORCH_BOX(&fc1_swiglu_cuda));
  m.impl("fc2_dgrad_swiglu", TORCH_BOX(&fc2_dgrad_swiglu_cuda));
  m.impl("expert_wgrad", TORCH_BOX(&expert_wgrad_cuda));
  m.impl("expert_wgrad_accumulate", TORCH_BOX(&expert_wgrad_accumulate_cuda));
}

STABLE_TORCH_LIBRARY_IMPL(primemoe, CompositeImplicitAutograd, m) {
  m.impl("expert_gemm_unsupported", TORCH_BOX(&expert_gemm_unsupported_op));
  m.impl("_gemm_force_config", TORCH_BOX(&gemm_force_config_op));
}

}  // namespace primemoe
