// What the binding's areas share: error messages (PRIMEMOE_CHECK), the argument checks of
// more than one area, the device error record, and the routing layout ep_dispatch reuses.
// The only torch-facing layer: below it, kernels and launchers take raw pointers and a stream.
//
// Every file of the binding uses PyTorch's stable ABI only (torch/csrc/stable, torch/headeronly, the C shims), built
// with TORCH_TARGET_VERSION = 2.10 (setup.py): one build loads into every torch >= 2.10. Never include ATen, c10 or
// torch/library.h here: their symbols tie the library to the exact torch it was built against.
#pragma once

#include <cuda_runtime.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kernels/error_record.cuh"
#include "kernels/row_ops.cuh"

namespace primemoe {

using Tensor = torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;
using IntArrayRef = torch::headeronly::IntHeaderOnlyArrayRef;
using DeviceGuard = torch::stable::accelerator::DeviceGuard;

// Messages are assembled with std::to_string: streaming an integer into an ostringstream (TORCH_CHECK's, then
// STD_TORCH_CHECK's) from this library crashed the process on the H200 image (torch 2.11).
inline std::string piece(const std::string& s) { return s; }
inline std::string piece(const char* s) { return s; }
inline std::string piece(ScalarType t) { return torch::headeronly::toString(t); }
template <typename T>
  requires std::is_integral_v<T>
std::string piece(T v) {
  return std::to_string(v);
}
std::string piece(IntArrayRef a);
template <typename... Args>
std::string message(const Args&... args) {
  return (std::string() + ... + piece(args));
}

// Raises `msg` as a RuntimeError in Python (the stable ABI carries std::exception across; c10::Error is not stable).
[[noreturn]] void fail(const std::string& msg);

#define PRIMEMOE_CHECK(cond, ...)                                    \
  do {                                                               \
    if (!(cond)) ::primemoe::fail(::primemoe::message(__VA_ARGS__)); \
  } while (0)

// ---------------------------------------------------------------- tensors and devices

// t's data as T*: the caller has checked t's dtype (the checks below).
template <typename T>
T* data_of(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}
inline bool same_shape(IntArrayRef a, IntArrayRef b) { return a.equals(b); }
// The current CUDA stream of t's device (torch's, as c10::cuda::getCurrentCUDAStream(device) gives it).
cudaStream_t current_stream(const Tensor& t);
// The multiprocessor count of `device` (cudaDevAttrMultiProcessorCount, as torch's device properties report it).
int sm_count(int device);
// The SMs the expert GEMMs' persistent grids take on `device`: sm_count, or fewer where set_gemm_sm_budget set fewer
// (primemoe.set_num_sms: SMs left to other work, e.g. communication kernels running beside the GEMMs).
int gemm_sms(int device);
// 0: every SM (the default); n > 0: at most n. Process-wide, as DeepGEMM's set_num_sms.
void set_gemm_sm_budget(int64_t n);
int64_t gemm_sm_budget();
// A new uninitialised tensor of `sizes` on t's device, of t's dtype or `dtype`.
Tensor empty_like_device(const Tensor& t, IntArrayRef sizes, std::optional<ScalarType> dtype = std::nullopt);
// The same, filled with zeros.
Tensor zeros_like_device(const Tensor& t, IntArrayRef sizes, std::optional<ScalarType> dtype = std::nullopt);

// ---------------------------------------------------------------- device errors

std::string describe_error(const ErrorRecord& rec);
// Raises the pending error of `device`, if any (dispatch_layout calls it, see layout_ops.cpp).
void raise_pending_error(int device);
// The host-mapped error record of t's device.
ErrorRecord* error_record_for(const Tensor& t);
void check_cuda(cudaError_t err, const char* what);
// Device indices past int are no device (cast, one could name device 0).
bool is_device_index(int64_t device);
// PRIMEMOE_WAIT_TIMEOUT_S (default 60), read at every launch so a process can change it between calls.
uint64_t wait_timeout_ns();

// ---------------------------------------------------------------- argument checks

// 16-byte aligned data on CUDA: the kernels move rows in 16-byte vectors and TMA boxes.
void check_aligned(const Tensor& t, const char* name);
// A contiguous, aligned bf16 [rows, H].
void check_rows(const Tensor& t, const char* name);
// A contiguous int32 tensor of `dims` dimensions.
void check_index(const Tensor& t, const char* name, int64_t dims);
void check_same_device(const Tensor& a, const Tensor& b, const char* name);
// A weight gradient's fp32 main gradient [experts, m, n]: contiguous, aligned, on `like`'s device.
void check_main_grad(const Tensor& main_grad, int64_t experts, int64_t m, int64_t n, const Tensor& like);
// kNone without a tensor, else its float32 / bfloat16 type (contiguous).
ScaleType scale_type_of(const std::optional<Tensor>& s, const char* name);

// ---------------------------------------------------------------- _check_args: the checks of Python's CPU kernels

// An op's arguments as its CPU kernel (python/primemoe/_cpu.py) hands them to _check_args: its tensor arguments, then
// its int and bool arguments, each in schema order.
struct OpArgs {
  std::vector<std::optional<Tensor>> tensors;
  std::vector<int64_t> ints;
  const char* op;

  const Tensor& tensor(size_t i) const;  // a required tensor
  const std::optional<Tensor>& optional(size_t i) const { return tensors[i]; }
  int64_t integer(size_t i) const { return ints[i]; }
};
using ArgCheck = void (*)(const OpArgs& args);

// Makes `check` (the argument check the op's CUDA impl runs) the one _check_args runs for `op`, which takes
// `tensors` tensor and `ints` int/bool arguments. One static instance per op, beside its impls.
struct ArgCheckRegistration {
  ArgCheckRegistration(const char* op, size_t tensors, size_t ints, ArgCheck check);
};

// ---------------------------------------------------------------- the routing layout

using LayoutResult = std::tuple<Tensor, Tensor, Tensor, Tensor>;

// Where launch_layout writes its four outputs instead of tensors of its own (then returned empty): memory
// that outlives the call, for a kernel that may still read them after the next op's allocations (the expert-parallel
// dispatch, which a GEMM runs alongside).
struct LayoutInto {
  int32_t* counts;
  int32_t* offsets;
  int32_t* row_to_slot;
  int32_t* slot_to_row;
};

// dispatch_layout on the current stream of topk_idx's device; slot_valid: [num_slots] bool that the
// kernel fills with slot_to_row >= 0, or null. Raises a pending device error first.
LayoutResult launch_layout(const Tensor& topk_idx, int64_t num_experts, int64_t expert_begin, int64_t num_local,
                           int64_t row_align, bool* slot_valid, const LayoutInto* into = nullptr);

}  // namespace primemoe
