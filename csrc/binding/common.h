// What the binding's areas share: error messages (PRIMEMOE_CHECK), the argument checks of
// more than one area, the device error record, and the routing layout ep_dispatch reuses.
// The only torch-facing layer: below it, kernels and launchers take raw pointers and a stream.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kernels/error_record.cuh"
#include "kernels/row_ops.cuh"

namespace primemoe {

// Messages are assembled with std::to_string: streaming an integer into TORCH_CHECK's
// ostringstream from this library crashed the process on the H200 image (torch 2.11).
inline std::string piece(const std::string& s) { return s; }
inline std::string piece(const char* s) { return s; }
inline std::string piece(at::ScalarType t) { return c10::toString(t); }
template <typename T>
  requires std::is_integral_v<T>
std::string piece(T v) {
  return std::to_string(v);
}
std::string piece(at::IntArrayRef a);
template <typename... Args>
std::string message(const Args&... args) {
  return (std::string() + ... + piece(args));
}

#define PRIMEMOE_CHECK(cond, ...) TORCH_CHECK(cond, ::primemoe::message(__VA_ARGS__))

// ---------------------------------------------------------------- device errors

std::string describe_error(const ErrorRecord& rec);
// Raises the pending error of `device`, if any (dispatch_layout calls it, see layout_ops.cpp).
void raise_pending_error(int device);
// The host-mapped error record of t's device.
ErrorRecord* error_record_for(const at::Tensor& t);
void check_cuda(cudaError_t err, const char* what);
// Device indices past int are no device (cast, one could name device 0).
bool is_device_index(int64_t device);
// PRIMEMOE_WAIT_TIMEOUT_S (default 60), read at every launch so a process can change it between calls.
uint64_t wait_timeout_ns();

// ---------------------------------------------------------------- argument checks

// 16-byte aligned data on CUDA: the kernels move rows in 16-byte vectors and TMA boxes.
void check_aligned(const at::Tensor& t, const char* name);
// A contiguous, aligned bf16 [rows, H].
void check_rows(const at::Tensor& t, const char* name);
// A contiguous int32 tensor of `dims` dimensions.
void check_index(const at::Tensor& t, const char* name, int64_t dims);
void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* name);
// kNone without a tensor, else its float32 / bfloat16 type (contiguous).
ScaleType scale_type_of(const std::optional<at::Tensor>& s, const char* name);

// ---------------------------------------------------------------- _check_args: the checks of Python's CPU kernels

// An op's arguments as its CPU kernel (python/primemoe/_cpu.py) hands them to _check_args: its tensor arguments, then
// its int and bool arguments, each in schema order.
struct OpArgs {
  std::vector<std::optional<at::Tensor>> tensors;
  std::vector<int64_t> ints;
  const char* op;

  const at::Tensor& tensor(size_t i) const;  // a required tensor
  const std::optional<at::Tensor>& optional(size_t i) const { return tensors[i]; }
  int64_t integer(size_t i) const { return ints[i]; }
};
using ArgCheck = void (*)(const OpArgs& args);

// Makes `check` (the argument check the op's CUDA impl runs) the one _check_args runs for `op`, which takes
// `tensors` tensor and `ints` int/bool arguments. One static instance per op, beside its impls.
struct ArgCheckRegistration {
  ArgCheckRegistration(const char* op, size_t tensors, size_t ints, ArgCheck check);
};

// ---------------------------------------------------------------- the routing layout

using LayoutResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// dispatch_layout on the current stream of topk_idx's device; slot_valid: [num_slots] bool that the
// kernel fills with slot_to_row >= 0, or null. Raises a pending device error first.
LayoutResult launch_layout(const at::Tensor& topk_idx, int64_t num_experts, int64_t expert_begin, int64_t num_local,
                           int64_t row_align, bool* slot_valid);

}  // namespace primemoe
