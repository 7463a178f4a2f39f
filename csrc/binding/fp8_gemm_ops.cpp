// The blockwise FP8 expert GEMMs: fp8_expert_gemm (FC1, FC2, both dgrads) and fp8_expert_wgrad(_accumulate) (both
// weight gradients). Each CUDA impl is checks, then Fp8GemmArgs, then the launcher (gemm/fp8_gemm.cuh). The CPU kernels
// are python/primemoe/_fp8_ops.py.

#include <optional>

#include "common.h"
#include "gemm/fp8_gemm.cuh"

namespace primemoe {
namespace {

void check_fp8(const Tensor& t, const char* name, int64_t dims) {
  PRIMEMOE_CHECK(t.dim() == dims, name, ": expected a ", dims, "-D tensor, got ", t.sizes());
  PRIMEMOE_CHECK(t.scalar_type() == ScalarType::Float8_e4m3fn, name, ": expected float8_e4m3fn, got ", t.scalar_type());
  PRIMEMOE_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
  check_aligned(t, name);
}

void check_scale(const Tensor& s, const char* name, IntArrayRef shape, const Tensor& like) {
  PRIMEMOE_CHECK(s.scalar_type() == ScalarType::Float, name, ": expected float32, got ", s.scalar_type());
  PRIMEMOE_CHECK(s.is_contiguous(), name, ": expected a contiguous tensor");
  PRIMEMOE_CHECK(same_shape(s.sizes(), shape), name, ": expected shape ", shape, ", got ", s.sizes());
  check_same_device(s, like, name);
}

void check_fp8_offsets(const Tensor& offsets, const Tensor& like, int64_t num_experts) {
  check_index(offsets, "expert_offsets", 1);
  PRIMEMOE_CHECK(num_experts < 0 || offsets.numel() == num_experts + 1, "expert_offsets: expected ", num_experts + 1,
                 " entries (one per expert + 1), got ", offsets.numel());
  PRIMEMOE_CHECK(offsets.numel() >= 2, "expert_offsets: expected at least one expert");
  check_same_device(offsets, like, "expert_offsets");
}

// a [R, K] with a_scale [K/128, R]; b [E, N, K] with b_scale [E, N/128, K/128]; row_weight [R] fp32.
void check_fp8_gemm_args(const Tensor& a, const Tensor& a_scale, const Tensor& b, const Tensor& b_scale,
                         const Tensor& offsets, const std::optional<Tensor>& row_weight) {
  check_fp8(a, "a", 2);
  check_fp8(b, "b", 3);
  check_same_device(b, a, "b");
  const int64_t R = a.size(0);
  const int64_t K = a.size(1);
  const int64_t E = b.size(0);
  const int64_t N = b.size(1);
  PRIMEMOE_CHECK(b.size(2) == K, "b: expected [E, N, ", K, "] (K from a), got ", b.sizes());
  PRIMEMOE_CHECK(K % kFp8TileK == 0 && K > 0, "a: expected a positive multiple of ", kFp8TileK,
                 " columns (1x128 tiles), got ", K);
  PRIMEMOE_CHECK(N % kFp8TileN == 0 && N > 0, "b: expected a positive multiple of ", kFp8TileN,
                 " output rows N (128x128 blocks), got ", N);
  check_scale(a_scale, "a_scale", {K / kFp8TileK, R}, a);
  check_scale(b_scale, "b_scale", {E, N / kFp8TileN, K / kFp8TileK}, a);
  check_fp8_offsets(offsets, a, E);
  if (row_weight.has_value()) {
    PRIMEMOE_CHECK(row_weight->dim() == 1 && row_weight->numel() == R &&
                       row_weight->scalar_type() == ScalarType::Float && row_weight->is_contiguous(),
                   "row_weight: expected a contiguous float32 vector of ", R, " entries");
    check_same_device(*row_weight, a, "row_weight");
  }
}

// a_t [M, R] with a_scale [R/128, M]; b_t [N, R] with b_scale [R/128, N]; expert_rows [E] int32.
void check_fp8_wgrad_args(const Tensor& a_t, const Tensor& a_scale, const Tensor& b_t, const Tensor& b_scale,
                          const Tensor& offsets, const std::optional<Tensor>& expert_rows) {
  check_fp8(a_t, "a_t", 2);
  check_fp8(b_t, "b_t", 2);
  check_same_device(b_t, a_t, "b_t");
  const int64_t M = a_t.size(0);
  const int64_t R = a_t.size(1);
  const int64_t N = b_t.size(0);
  PRIMEMOE_CHECK(b_t.size(1) == R, "b_t: expected [N, ", R, "] (the rows of a_t), got ", b_t.sizes());
  PRIMEMOE_CHECK(R % kFp8TileK == 0, "a_t: expected a multiple of ", kFp8TileK,
                 " rows along its last dim (128x1 tiles), got ", R);
  PRIMEMOE_CHECK(M % kFp8TileM == 0 && M > 0, "a_t: expected a positive multiple of ", kFp8TileM, " rows M, got ", M);
  PRIMEMOE_CHECK(N % kFp8TileN == 0 && N > 0, "b_t: expected a positive multiple of ", kFp8TileN, " rows N, got ", N);
  check_scale(a_scale, "a_scale", {R / kFp8TileK, M}, a_t);
  check_scale(b_scale, "b_scale", {R / kFp8TileK, N}, a_t);
  check_fp8_offsets(offsets, a_t, -1);
  if (!expert_rows.has_value()) return;
  check_index(*expert_rows, "expert_rows", 1);
  PRIMEMOE_CHECK(expert_rows->numel() == offsets.numel() - 1, "expert_rows: expected one count per expert (",
                 offsets.numel() - 1, "), got ", expert_rows->numel());
  check_same_device(*expert_rows, a_t, "expert_rows");
}

void run_fp8_gemm(const Fp8GemmArgs& g, const Tensor& like, const char* what) {
  const char* why = "";
  PRIMEMOE_CHECK(fp8_gemm_supported(g, like.get_device_index(), &why), "primemoe: ", what, ": ", why);
  check_cuda(launch_fp8_gemm(g, current_stream(like)), what);
}

Tensor fp8_expert_gemm_cuda(const Tensor& a, const Tensor& a_scale, const Tensor& b, const Tensor& b_scale,
                            const Tensor& offsets, const std::optional<Tensor>& row_weight, bool out_fp32) {
  check_fp8_gemm_args(a, a_scale, b, b_scale, offsets, row_weight);
  const DeviceGuard guard(a.get_device_index());
  auto out = empty_like_device(a, {a.size(0), b.size(1)}, out_fp32 ? ScalarType::Float : ScalarType::BFloat16);
  if (a.size(0) == 0) return out;
  Fp8GemmArgs g{};
  g.schedule = Fp8Schedule::kRows;
  g.a = a.data_ptr();
  g.a_scale = data_of<float>(a_scale);
  g.b = b.data_ptr();
  g.b_scale = data_of<float>(b_scale);
  g.num_rows = a.size(0);
  g.n = static_cast<int32_t>(b.size(1));
  g.k = static_cast<int32_t>(a.size(1));
  g.num_experts = static_cast<int32_t>(b.size(0));
  g.expert_offsets = data_of<int32_t>(offsets);
  g.row_weight = row_weight.has_value() ? data_of<float>(*row_weight) : nullptr;
  g.out = out.data_ptr();
  g.out_fp32 = out_fp32;
  g.num_sms = gemm_sms(a.get_device_index());
  run_fp8_gemm(g, a, "fp8_expert_gemm");
  return out;
}

// The weight-gradient launch's arguments: out[e] (fp32 or bf16) = a_t[:, rows of e] x b_t[:, rows of e]^T.
Fp8GemmArgs fp8_wgrad_args(const Tensor& a_t, const Tensor& a_scale, const Tensor& b_t, const Tensor& b_scale,
                           const Tensor& offsets, const std::optional<Tensor>& expert_rows, const Tensor& out,
                           bool out_fp32) {
  Fp8GemmArgs g{};
  g.schedule = Fp8Schedule::kExperts;
  g.a = a_t.data_ptr();
  g.a_scale = data_of<float>(a_scale);
  g.b = b_t.data_ptr();
  g.b_scale = data_of<float>(b_scale);
  g.num_rows = a_t.size(1);
  g.m = static_cast<int32_t>(a_t.size(0));
  g.n = static_cast<int32_t>(b_t.size(0));
  g.num_experts = static_cast<int32_t>(offsets.numel() - 1);
  g.expert_offsets = data_of<int32_t>(offsets);
  g.expert_rows = expert_rows.has_value() ? data_of<int32_t>(*expert_rows) : nullptr;
  g.out = out.data_ptr();
  g.out_fp32 = out_fp32;
  g.num_sms = gemm_sms(a_t.get_device_index());
  return g;
}

Tensor fp8_expert_wgrad_cuda(const Tensor& a_t, const Tensor& a_scale, const Tensor& b_t, const Tensor& b_scale,
                             const Tensor& offsets, const std::optional<Tensor>& expert_rows, bool out_fp32) {
  check_fp8_wgrad_args(a_t, a_scale, b_t, b_scale, offsets, expert_rows);
  const DeviceGuard guard(a_t.get_device_index());
  const int64_t E = offsets.numel() - 1;
  auto out = empty_like_device(a_t, {E, a_t.size(0), b_t.size(0)}, out_fp32 ? ScalarType::Float : ScalarType::BFloat16);
  if (a_t.size(1) == 0) return torch::stable::zero_(out);
  run_fp8_gemm(fp8_wgrad_args(a_t, a_scale, b_t, b_scale, offsets, expert_rows, out, out_fp32), a_t,
               "fp8_expert_wgrad");
  return out;
}

// main_grad[e] += the fp32 weight gradient of expert e (gradient-accumulation fusion), from the GEMM's registers.
void check_fp8_wgrad_accumulate_args(const Tensor& a_t, const Tensor& a_scale, const Tensor& b_t,
                                     const Tensor& b_scale, const Tensor& offsets,
                                     const std::optional<Tensor>& expert_rows, const Tensor& main_grad) {
  check_fp8_wgrad_args(a_t, a_scale, b_t, b_scale, offsets, expert_rows);
  check_main_grad(main_grad, offsets.numel() - 1, a_t.size(0), b_t.size(0), a_t);
}

void fp8_expert_wgrad_accumulate_cuda(const Tensor& a_t, const Tensor& a_scale, const Tensor& b_t,
                                      const Tensor& b_scale, const Tensor& offsets,
                                      const std::optional<Tensor>& expert_rows, Tensor& main_grad) {
  check_fp8_wgrad_accumulate_args(a_t, a_scale, b_t, b_scale, offsets, expert_rows, main_grad);
  if (a_t.size(1) == 0) return;  // adds nothing
  const DeviceGuard guard(a_t.get_device_index());
  Fp8GemmArgs g = fp8_wgrad_args(a_t, a_scale, b_t, b_scale, offsets, expert_rows, main_grad, true);
  g.accumulate = true;
  run_fp8_gemm(g, a_t, "fp8_expert_wgrad_accumulate");
}

// The checks the CPU kernels (python/primemoe/_fp8_ops.py) run through _check_args.
const ArgCheckRegistration fp8_gemm_check("fp8_expert_gemm", 6, 1, [](const OpArgs& a) {
  check_fp8_gemm_args(a.tensor(0), a.tensor(1), a.tensor(2), a.tensor(3), a.tensor(4), a.optional(5));
});
const ArgCheckRegistration fp8_wgrad_check("fp8_expert_wgrad", 6, 1, [](const OpArgs& a) {
  check_fp8_wgrad_args(a.tensor(0), a.tensor(1), a.tensor(2), a.tensor(3), a.tensor(4), a.optional(5));
});
const ArgCheckRegistration fp8_wgrad_accumulate_check("fp8_expert_wgrad_accumulate", 7, 0, [](const OpArgs& a) {
  check_fp8_wgrad_accumulate_args(a.tensor(0), a.tensor(1), a.tensor(2), a.tensor(3), a.tensor(4), a.optional(5),
                                  a.tensor(6));
});

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(primemoe, CUDA, m) {
  m.impl("fp8_expert_gemm", TORCH_BOX(&fp8_expert_gemm_cuda));
  m.impl("fp8_expert_wgrad", TORCH_BOX(&fp8_expert_wgrad_cuda));
  m.impl("fp8_expert_wgrad_accumulate", TORCH_BOX(&fp8_expert_wgrad_accumulate_cuda));
}

}  // namespace primemoe
