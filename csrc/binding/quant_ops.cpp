// Blockwise FP8 quantisation (kernels/quantize.cuh): quantize_fp8_1x128 (activations and gradients, tiles along
// the contiguous dimension), quantize_fp8_128x1 (the wgrad operands: tiles along the rows, output transposed) and
// quantize_fp8_128x128 (weights, leading dimensions flattened). Each returns (q, scale): q float8_e4m3fn, scale
// float32 (the dequantisation scale, one per tile). The 1x128 and 128x1 quantisers take two options: scale_mn_major
// (the scale transposed, the layout the FP8 GEMMs load) and expert_offsets (rows at or past expert_offsets[-1],
// read on the device, left unwritten). fp8_swiglu_quant and fp8_swiglu_backward (kernels/fp8_rows.cuh) are the
// FP8 path's SwiGLU epilogues as row kernels. The CPU kernels are python/primemoe/_quant_ops.py.

#include <optional>
#include <tuple>
#include <vector>

#include "common.h"
#include "kernels/fp8_rows.cuh"
#include "kernels/quantize.cuh"

namespace primemoe {
namespace {

using Quantized = std::tuple<Tensor, Tensor>;

// bf16, contiguous, 16-byte aligned on CUDA (the kernels load 16-byte vectors).
void check_bf16_operand(const Tensor& t, const char* name) {
  PRIMEMOE_CHECK(t.scalar_type() == ScalarType::BFloat16, name, ": expected bfloat16, got ", t.scalar_type());
  PRIMEMOE_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
  check_aligned(t, name);
}

// int32, contiguous, 1-D, at least one expert, on `like`'s device: the device-side row bound is its last entry.
void check_expert_offsets(const Tensor& offsets, const Tensor& like) {
  check_index(offsets, "expert_offsets", 1);
  PRIMEMOE_CHECK(offsets.numel() >= 2, "expert_offsets: expected at least 2 entries (one expert), got ",
                 offsets.numel());
  check_same_device(offsets, like, "expert_offsets");
}

void check_1x128_args(const Tensor& x, const std::optional<Tensor>& offsets) {
  PRIMEMOE_CHECK(x.dim() == 2, "x: expected a 2-D tensor [rows, K], got ", x.sizes());
  check_bf16_operand(x, "x");
  PRIMEMOE_CHECK(x.size(1) % kFp8Tile == 0, "x: expected a multiple of ", kFp8Tile,
                 " columns (1x128 tiles along K), got ", x.size(1));
  if (offsets.has_value()) check_expert_offsets(*offsets, x);
}

void check_128x1_args(const Tensor& x, const std::optional<Tensor>& offsets) {
  PRIMEMOE_CHECK(x.dim() == 2, "x: expected a 2-D tensor [M, K], got ", x.sizes());
  check_bf16_operand(x, "x");
  PRIMEMOE_CHECK(x.size(0) % kFp8Tile == 0, "x: expected a multiple of ", kFp8Tile,
                 " rows (128x1 tiles along M), got ", x.size(0));
  PRIMEMOE_CHECK(x.size(1) % 8 == 0, "x: expected a multiple of 8 columns (16-byte rows), got ", x.size(1));
  if (offsets.has_value()) check_expert_offsets(*offsets, x);
}

// h [R, 2I] bf16 (gate | up halves), I a multiple of 128 (no 1x128 tile of a straddles the halves).
void check_swiglu_h(const Tensor& h) {
  PRIMEMOE_CHECK(h.dim() == 2, "h: expected a 2-D tensor [rows, 2I], got ", h.sizes());
  check_bf16_operand(h, "h");
  PRIMEMOE_CHECK(h.size(1) % (2 * kFp8Tile) == 0, "h: expected 2I columns with I a multiple of ", kFp8Tile,
                 " (1x128 tiles along I), got ", h.size(1));
}

void check_swiglu_quant_args(const Tensor& h, const Tensor& offsets) {
  check_swiglu_h(h);
  check_expert_offsets(offsets, h);
}

void check_swiglu_backward_args(const Tensor& da, const Tensor& h, const Tensor& row_weight, const Tensor& offsets) {
  check_swiglu_h(h);
  const int64_t rows = h.size(0), inter = h.size(1) / 2;
  PRIMEMOE_CHECK(da.dim() == 2 && da.size(0) == rows && da.size(1) == inter, "da: expected shape [", rows, ", ",
                 inter, "] ([rows, I] of h [rows, 2I]), got ", da.sizes());
  PRIMEMOE_CHECK(da.scalar_type() == ScalarType::Float, "da: expected float32, got ", da.scalar_type());
  PRIMEMOE_CHECK(da.is_contiguous(), "da: expected a contiguous tensor");
  check_aligned(da, "da");
  check_same_device(da, h, "da");
  PRIMEMOE_CHECK(row_weight.dim() == 1 && row_weight.numel() == rows, "row_weight: expected shape [", rows,
                 "] (one per row of h), got ", row_weight.sizes());
  PRIMEMOE_CHECK(row_weight.scalar_type() == ScalarType::Float, "row_weight: expected float32, got ",
                 row_weight.scalar_type());
  PRIMEMOE_CHECK(row_weight.is_contiguous(), "row_weight: expected a contiguous tensor");
  check_same_device(row_weight, h, "row_weight");
  check_expert_offsets(offsets, h);
}

void check_128x128_args(const Tensor& w) {
  PRIMEMOE_CHECK(w.dim() >= 2, "w: expected a tensor of at least 2 dimensions [..., N, K], got ", w.sizes());
  check_bf16_operand(w, "w");
  PRIMEMOE_CHECK(w.size(w.dim() - 2) % kFp8Tile == 0 && w.size(w.dim() - 1) % kFp8Tile == 0,
                 "w: expected its last two sizes [N, K] ",
                 "multiples of ", kFp8Tile, " (128x128 blocks), got ", w.sizes());
}

// New tensors of `sizes` on t's device: e4m3 (the quantised values), fp32 (their scales).
Tensor fp8_like(const Tensor& t, IntArrayRef sizes) { return empty_like_device(t, sizes, ScalarType::Float8_e4m3fn); }
Tensor fp32_like(const Tensor& t, IntArrayRef sizes) { return empty_like_device(t, sizes, ScalarType::Float); }

// The device pointer to expert_offsets[-1] (the routed row count), or null.
const int32_t* rows_end_of(const std::optional<Tensor>& offsets) {
  return offsets.has_value() ? data_of<int32_t>(*offsets) + (offsets->numel() - 1) : nullptr;
}

Quantized quantize_1x128_cuda(const Tensor& x, bool pow2, bool scale_mn_major,
                              const std::optional<Tensor>& expert_offsets) {
  check_1x128_args(x, expert_offsets);
  const DeviceGuard guard(x.get_device_index());
  auto q = fp8_like(x, x.sizes());
  auto s = scale_mn_major ? fp32_like(x, {x.size(1) / kFp8Tile, x.size(0)})
                          : fp32_like(x, {x.size(0), x.size(1) / kFp8Tile});
  Quantize1x128Args a{};
  a.x = x.data_ptr();
  a.q = q.data_ptr();
  a.scale = data_of<float>(s);
  a.rows = x.size(0);
  a.cols = x.size(1);
  a.pow2 = pow2;
  a.scale_mn_major = scale_mn_major;
  a.rows_end = rows_end_of(expert_offsets);
  check_cuda(launch_quantize_1x128(a, current_stream(x)), "quantize_fp8_1x128");
  return {q, s};
}

Quantized quantize_128x1_cuda(const Tensor& x, bool pow2, bool scale_mn_major,
                              const std::optional<Tensor>& expert_offsets) {
  check_128x1_args(x, expert_offsets);
  const DeviceGuard guard(x.get_device_index());
  auto q_t = fp8_like(x, {x.size(1), x.size(0)});
  auto s = scale_mn_major ? fp32_like(x, {x.size(0) / kFp8Tile, x.size(1)})
                          : fp32_like(x, {x.size(1), x.size(0) / kFp8Tile});
  Quantize128x1Args a{};
  a.x = x.data_ptr();
  a.q_t = q_t.data_ptr();
  a.scale = data_of<float>(s);
  a.rows = x.size(0);
  a.cols = x.size(1);
  a.pow2 = pow2;
  a.scale_mn_major = scale_mn_major;
  a.rows_end = rows_end_of(expert_offsets);
  check_cuda(launch_quantize_128x1(a, current_stream(x)), "quantize_fp8_128x1");
  return {q_t, s};
}

Quantized quantize_128x128_cuda(const Tensor& w, bool pow2) {
  check_128x128_args(w);
  const DeviceGuard guard(w.get_device_index());
  auto q = fp8_like(w, w.sizes());
  std::vector<int64_t> scale_shape(w.sizes().begin(), w.sizes().end());
  scale_shape[w.dim() - 2] /= kFp8Tile;
  scale_shape[w.dim() - 1] /= kFp8Tile;
  auto s = fp32_like(w, scale_shape);
  Quantize128x128Args a{};
  a.w = w.data_ptr();
  a.q = q.data_ptr();
  a.scale = data_of<float>(s);
  a.cols = w.size(w.dim() - 1);
  a.rows = a.cols == 0 ? 0 : w.numel() / a.cols;
  a.pow2 = pow2;
  check_cuda(launch_quantize_128x128(a, current_stream(w)), "quantize_fp8_128x128");
  return {q, s};
}

// h [R, 2I] -> (a_q [R, I] e4m3, a_scale [I/128, R]); rows at or past expert_offsets[-1] unwritten.
Quantized fp8_swiglu_quant_cuda(const Tensor& h, const Tensor& expert_offsets, bool pow2) {
  check_swiglu_quant_args(h, expert_offsets);
  const DeviceGuard guard(h.get_device_index());
  const int64_t rows = h.size(0), inter = h.size(1) / 2;
  auto a_q = fp8_like(h, {rows, inter});
  auto a_scale = fp32_like(h, {inter / kFp8Tile, rows});
  Fp8SwigluQuantArgs a{};
  a.h = h.data_ptr();
  a.a_q = a_q.data_ptr();
  a.a_scale = data_of<float>(a_scale);
  a.rows_end = rows_end_of(expert_offsets);
  a.rows = rows;
  a.inter = inter;
  a.pow2 = pow2;
  check_cuda(launch_fp8_swiglu_quant(a, current_stream(h)), "fp8_swiglu_quant");
  return {a_q, a_scale};
}

using SwigluBackward = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;

// (dh [R, 2I] bf16, dh_q [R, 2I] e4m3, dh_scale [2I/128, R], aw [R, I] bf16, dot [R] fp32); rows at or past
// expert_offsets[-1] unwritten.
SwigluBackward fp8_swiglu_backward_cuda(const Tensor& da, const Tensor& h, const Tensor& row_weight,
                                        const Tensor& expert_offsets, bool pow2) {
  check_swiglu_backward_args(da, h, row_weight, expert_offsets);
  const DeviceGuard guard(h.get_device_index());
  const int64_t rows = h.size(0), inter = h.size(1) / 2;
  auto dh = empty_like_device(h, {rows, 2 * inter});
  auto dh_q = fp8_like(h, {rows, 2 * inter});
  auto dh_scale = fp32_like(h, {2 * inter / kFp8Tile, rows});
  auto aw = empty_like_device(h, {rows, inter});
  auto dot = fp32_like(h, {rows});
  Fp8SwigluBackwardArgs a{};
  a.da = data_of<float>(da);
  a.h = h.data_ptr();
  a.row_weight = data_of<float>(row_weight);
  a.dh = dh.data_ptr();
  a.dh_q = dh_q.data_ptr();
  a.dh_scale = data_of<float>(dh_scale);
  a.aw = aw.data_ptr();
  a.dot = data_of<float>(dot);
  a.rows_end = rows_end_of(expert_offsets);
  a.rows = rows;
  a.inter = inter;
  a.pow2 = pow2;
  check_cuda(launch_fp8_swiglu_backward(a, current_stream(h)), "fp8_swiglu_backward");
  return {dh, dh_q, dh_scale, aw, dot};
}

// The checks the CPU kernels (python/primemoe/_quant_ops.py) run through _check_args.
// quantize_fp8_1x128 / 128x1: tensors [x, expert_offsets], ints [pow2, scale_mn_major].
const ArgCheckRegistration quantize_1x128_check("quantize_fp8_1x128", 2, 2, [](const OpArgs& a) {
  check_1x128_args(a.tensor(0), a.optional(1));
});
const ArgCheckRegistration quantize_128x1_check("quantize_fp8_128x1", 2, 2, [](const OpArgs& a) {
  check_128x1_args(a.tensor(0), a.optional(1));
});
const ArgCheckRegistration quantize_128x128_check("quantize_fp8_128x128", 1, 1,
                                                  [](const OpArgs& a) { check_128x128_args(a.tensor(0)); });
// fp8_swiglu_quant: tensors [h, expert_offsets], ints [pow2].
const ArgCheckRegistration swiglu_quant_check("fp8_swiglu_quant", 2, 1, [](const OpArgs& a) {
  check_swiglu_quant_args(a.tensor(0), a.tensor(1));
});
// fp8_swiglu_backward: tensors [da, h, row_weight, expert_offsets], ints [pow2].
const ArgCheckRegistration swiglu_backward_check("fp8_swiglu_backward", 4, 1, [](const OpArgs& a) {
  check_swiglu_backward_args(a.tensor(0), a.tensor(1), a.tensor(2), a.tensor(3));
});

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(primemoe, CUDA, m) {
  m.impl("quantize_fp8_1x128", TORCH_BOX(&quantize_1x128_cuda));
  m.impl("quantize_fp8_128x1", TORCH_BOX(&quantize_128x1_cuda));
  m.impl("quantize_fp8_128x128", TORCH_BOX(&quantize_128x128_cuda));
  m.impl("fp8_swiglu_quant", TORCH_BOX(&fp8_swiglu_quant_cuda));
  m.impl("fp8_swiglu_backward", TORCH_BOX(&fp8_swiglu_backward_cuda));
}

}  // namespace primemoe
