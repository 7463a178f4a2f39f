// Blockwise FP8 quantisation (kernels/quantize.cuh): quantize_fp8_1x128 (activations and gradients, tiles along
// the contiguous dimension), quantize_fp8_128x1 (the wgrad operands: tiles along the rows, output transposed) and
// quantize_fp8_128x128 (weights, leading dimensions flattened). Each returns (q, scale): q float8_e4m3fn, scale
// float32 (the dequantisation scale, one per tile). The CPU kernels are python/primemoe/_quant_ops.py.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "common.h"
#include "kernels/quantize.cuh"

namespace primemoe {
namespace {

using Quantized = std::tuple<at::Tensor, at::Tensor>;

// bf16, contiguous, 16-byte aligned on CUDA (the kernels load 16-byte vectors).
void check_bf16_operand(const at::Tensor& t, const char* name) {
  PRIMEMOE_CHECK(t.scalar_type() == at::kBFloat16, name, ": expected bfloat16, got ", t.scalar_type());
  PRIMEMOE_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
  check_aligned(t, name);
}

void check_1x128_args(const at::Tensor& x) {
  PRIMEMOE_CHECK(x.dim() == 2, "x: expected a 2-D tensor [rows, K], got ", x.sizes());
  check_bf16_operand(x, "x");
  PRIMEMOE_CHECK(x.size(1) % kFp8Tile == 0, "x: expected a multiple of ", kFp8Tile,
                 " columns (1x128 tiles along K), got ", x.size(1));
}

void check_128x1_args(const at::Tensor& x) {
  PRIMEMOE_CHECK(x.dim() == 2, "x: expected a 2-D tensor [M, K], got ", x.sizes());
  check_bf16_operand(x, "x");
  PRIMEMOE_CHECK(x.size(0) % kFp8Tile == 0, "x: expected a multiple of ", kFp8Tile,
                 " rows (128x1 tiles along M), got ", x.size(0));
  PRIMEMOE_CHECK(x.size(1) % 8 == 0, "x: expected a multiple of 8 columns (16-byte rows), got ", x.size(1));
}

void check_128x128_args(const at::Tensor& w) {
  PRIMEMOE_CHECK(w.dim() >= 2, "w: expected a tensor of at least 2 dimensions [..., N, K], got ", w.sizes());
  check_bf16_operand(w, "w");
  PRIMEMOE_CHECK(w.size(-2) % kFp8Tile == 0 && w.size(-1) % kFp8Tile == 0, "w: expected its last two sizes [N, K] ",
                 "multiples of ", kFp8Tile, " (128x128 blocks), got ", w.sizes());
}

at::TensorOptions fp8_like(const at::Tensor& t) { return t.options().dtype(at::kFloat8_e4m3fn); }
at::TensorOptions fp32_like(const at::Tensor& t) { return t.options().dtype(at::kFloat); }

Quantized quantize_1x128_cuda(const at::Tensor& x, bool pow2, bool scale_mn_major,
                              const std::optional<at::Tensor>& expert_offsets) {
  check_1x128_args(x);
  PRIMEMOE_CHECK(!scale_mn_major && !expert_offsets.has_value(), "quantize_fp8_1x128: not implemented yet");
  const c10::cuda::CUDAGuard guard(x.device());
  auto q = at::empty(x.sizes(), fp8_like(x));
  auto s = at::empty({x.size(0), x.size(1) / kFp8Tile}, fp32_like(x));
  Quantize1x128Args a{};
  a.x = x.data_ptr();
  a.q = q.data_ptr();
  a.scale = s.data_ptr<float>();
  a.rows = x.size(0);
  a.cols = x.size(1);
  a.pow2 = pow2;
  check_cuda(launch_quantize_1x128(a, c10::cuda::getCurrentCUDAStream()), "quantize_fp8_1x128");
  return {q, s};
}

Quantized quantize_128x1_cuda(const at::Tensor& x, bool pow2, bool scale_mn_major,
                              const std::optional<at::Tensor>& expert_offsets) {
  check_128x1_args(x);
  PRIMEMOE_CHECK(!scale_mn_major && !expert_offsets.has_value(), "quantize_fp8_128x1: not implemented yet");
  const c10::cuda::CUDAGuard guard(x.device());
  auto q_t = at::empty({x.size(1), x.size(0)}, fp8_like(x));
  auto s = at::empty({x.size(1), x.size(0) / kFp8Tile}, fp32_like(x));
  Quantize128x1Args a{};
  a.x = x.data_ptr();
  a.q_t = q_t.data_ptr();
  a.scale = s.data_ptr<float>();
  a.rows = x.size(0);
  a.cols = x.size(1);
  a.pow2 = pow2;
  check_cuda(launch_quantize_128x1(a, c10::cuda::getCurrentCUDAStream()), "quantize_fp8_128x1");
  return {q_t, s};
}

Quantized quantize_128x128_cuda(const at::Tensor& w, bool pow2) {
  check_128x128_args(w);
  const c10::cuda::CUDAGuard guard(w.device());
  auto q = at::empty(w.sizes(), fp8_like(w));
  std::vector<int64_t> scale_shape(w.sizes().begin(), w.sizes().end());
  scale_shape[w.dim() - 2] /= kFp8Tile;
  scale_shape[w.dim() - 1] /= kFp8Tile;
  auto s = at::empty(scale_shape, fp32_like(w));
  Quantize128x128Args a{};
  a.w = w.data_ptr();
  a.q = q.data_ptr();
  a.scale = s.data_ptr<float>();
  a.cols = w.size(-1);
  a.rows = a.cols == 0 ? 0 : w.numel() / a.cols;
  a.pow2 = pow2;
  check_cuda(launch_quantize_128x128(a, c10::cuda::getCurrentCUDAStream()), "quantize_fp8_128x128");
  return {q, s};
}

// The checks the CPU kernels (python/primemoe/_quant_ops.py) run through _check_args.
const ArgCheckRegistration quantize_1x128_check("quantize_fp8_1x128", 2, 2,
                                                [](const OpArgs& a) { check_1x128_args(a.tensor(0)); });
const ArgCheckRegistration quantize_128x1_check("quantize_fp8_128x1", 2, 2,
                                                [](const OpArgs& a) { check_128x1_args(a.tensor(0)); });
const ArgCheckRegistration quantize_128x128_check("quantize_fp8_128x128", 1, 1,
                                                  [](const OpArgs& a) { check_128x128_args(a.tensor(0)); });

}  // namespace

TORCH_LIBRARY_IMPL(primemoe, CUDA, m) {
  m.impl("quantize_fp8_1x128", &quantize_1x128_cuda);
  m.impl("quantize_fp8_128x1", &quantize_128x1_cuda);
  m.impl("quantize_fp8_128x128", &quantize_128x128_cuda);
}

}  // namespace primemoe
