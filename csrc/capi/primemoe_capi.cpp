// The C API (primemoe_capi.h) over the launchers of csrc/kernels and csrc/gemm. Each call: struct version check,
// argument checks (host arithmetic only, no CUDA: an invalid call returns before touching the runtime), the C++
// argument struct, the launcher, and its cudaError_t mapped to a status. Nothing throws out of here.
#include "primemoe_capi.h"

#include <cuda_runtime.h>

#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <utility>

#include "gemm/fp8_gemm.cuh"
#include "gemm/grouped_gemm.cuh"
#include "kernels/bf16_vec.cuh"  // kBf16Vec: the row kernels' 16-byte unit
#include "kernels/dispatch_layout.cuh"
#include "kernels/error_record.cuh"
#include "kernels/fp8_rows.cuh"
#include "kernels/quantize.cuh"
#include "kernels/row_ops.cuh"

namespace primemoe {
namespace {

static_assert(PRIMEMOE_GEMM_ROW_ALIGN == kGemmRowAlign && PRIMEMOE_GEMM_TILE_N == kGemmTileN &&
                  PRIMEMOE_GEMM_TILE_K == kGemmTileK && PRIMEMOE_FP8_TILE == kFp8Tile &&
                  PRIMEMOE_FP8_TILE == kFp8TileM && PRIMEMOE_FP8_TILE == kFp8TileN && PRIMEMOE_FP8_TILE == kFp8TileK &&
                  PRIMEMOE_LAYOUT_MAX_LOCAL_EXPERTS == kLayoutMaxLocalExperts,
              "primemoe_capi.h's constants differ from the kernels'");
static_assert(sizeof(primemoe_error_record) == sizeof(ErrorRecord) &&
                  offsetof(primemoe_error_record, code) == offsetof(ErrorRecord, code) &&
                  offsetof(primemoe_error_record, index0) == offsetof(ErrorRecord, index0) &&
                  offsetof(primemoe_error_record, index1) == offsetof(ErrorRecord, index1),
              "primemoe_error_record must have ErrorRecord's layout");
static_assert(PRIMEMOE_DEVICE_ERROR_BAD_EXPERT_ID == kBadExpertId && PRIMEMOE_DEVICE_ERROR_WAIT_TIMEOUT == kWaitTimeout &&
                  PRIMEMOE_DEVICE_ERROR_RECV_OVERFLOW == kRecvOverflow,
              "device error codes differ");
// Version 1.0's struct sizes (LP64): a change here is an ABI change (a new major version, or fields at the end
// with the older sizes still accepted by check_struct).
static_assert(sizeof(void*) != 8 ||
                  (sizeof(primemoe_dispatch_layout_args) == 104 && sizeof(primemoe_gather_rows_args) == 80 &&
                   sizeof(primemoe_combine_args) == 56 && sizeof(primemoe_slot_dot_args) == 48 &&
                   sizeof(primemoe_quantize_1x128_args) == 64 && sizeof(primemoe_quantize_128x1_args) == 64 &&
                   sizeof(primemoe_quantize_128x128_args) == 48 && sizeof(primemoe_fp8_swiglu_quant_args) == 56 &&
                   sizeof(primemoe_fp8_swiglu_backward_args) == 96 && sizeof(primemoe_grouped_gemm_args) == 184 &&
                   sizeof(primemoe_fp8_gemm_args) == 104),
              "a primemoe_capi.h struct changed size: bump the C API version");

// ---- per-thread error details ------------------------------------------------------------------------------------

thread_local char t_message[512] = "";
thread_local int32_t t_cuda_error = 0;

void clear_error() {
  t_message[0] = '\0';
  t_cuda_error = 0;
}

primemoe_status fail(primemoe_status status, const char* fn, const char* fmt, ...) {
  int used = std::snprintf(t_message, sizeof(t_message), "%s: ", fn);
  if (used < 0 || used >= int(sizeof(t_message))) used = 0;
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(t_message + used, sizeof(t_message) - size_t(used), fmt, ap);
  va_end(ap);
  return status;
}

// A launcher's (or runtime call's) result. The launchers answer cudaErrorInvalidValue for sizes outside their
// contract and cudaErrorNotSupported for a variant that is not built.
primemoe_status from_cuda(cudaError_t err, const char* fn) {
  if (err == cudaSuccess) return PRIMEMOE_STATUS_SUCCESS;
  t_cuda_error = int32_t(err);
  const char* name = cudaGetErrorName(err);
  if (err == cudaErrorInvalidValue) {
    return fail(PRIMEMOE_STATUS_INVALID_ARGUMENT, fn, "rejected by the launcher or the runtime (%s)", name);
  }
  if (err == cudaErrorNotSupported) return fail(PRIMEMOE_STATUS_NOT_SUPPORTED, fn, "not supported (%s)", name);
  return fail(PRIMEMOE_STATUS_CUDA_ERROR, fn, "%s: %s", name, cudaGetErrorString(err));
}

// ---- argument checks (no CUDA) -----------------------------------------------------------------------------------

// One check failed: its message. The checks below return false and leave the message in t_message.
struct Checker {
  const char* fn;
  primemoe_status status = PRIMEMOE_STATUS_SUCCESS;

  bool require(bool ok, const char* fmt, ...) {
    if (ok || status != PRIMEMOE_STATUS_SUCCESS) return ok && status == PRIMEMOE_STATUS_SUCCESS;
    int used = std::snprintf(t_message, sizeof(t_message), "%s: ", fn);
    if (used < 0 || used >= int(sizeof(t_message))) used = 0;
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(t_message + used, sizeof(t_message) - size_t(used), fmt, ap);
    va_end(ap);
    status = PRIMEMOE_STATUS_INVALID_ARGUMENT;
    return false;
  }
  // A pointer that must be set unless its tensor is empty.
  bool pointer(const void* p, bool nonempty, const char* name) {
    return require(p != nullptr || !nonempty, "%s: expected a device pointer, got NULL", name);
  }
  bool aligned(const void* p, const char* name) {
    return require((reinterpret_cast<uintptr_t>(p) & 15) == 0, "%s: expected 16-byte aligned data", name);
  }
  bool boolean(int32_t v, const char* name) { return require(v == 0 || v == 1, "%s: expected 0 or 1, got %d", name, v); }
  bool ok() const { return status == PRIMEMOE_STATUS_SUCCESS; }
};

// The struct pointer and its version. Sizes a later minor version accepts go here (each older struct_size).
template <typename T>
primemoe_status check_struct(const T* args, const char* fn) {
  if (args == nullptr) return fail(PRIMEMOE_STATUS_INVALID_ARGUMENT, fn, "args: expected a pointer, got NULL");
  if (args->struct_size != sizeof(T)) {
    return fail(PRIMEMOE_STATUS_VERSION_MISMATCH, fn,
                "struct_size %u is not this library's %zu (C API %d.%d.%d): set it with PRIMEMOE_ARGS_INIT",
                unsigned(args->struct_size), sizeof(T), PRIMEMOE_CAPI_VERSION_MAJOR, PRIMEMOE_CAPI_VERSION_MINOR,
                PRIMEMOE_CAPI_VERSION_PATCH);
  }
  return PRIMEMOE_STATUS_SUCCESS;
}

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

bool scale_type(int32_t dtype, bool allow_none, ScaleType* out) {
  switch (dtype) {
    case PRIMEMOE_DTYPE_NONE: *out = ScaleType::kNone; return allow_none;
    case PRIMEMOE_DTYPE_FLOAT32: *out = ScaleType::kFloat32; return true;
    case PRIMEMOE_DTYPE_BFLOAT16: *out = ScaleType::kBFloat16; return true;
    default: return false;
  }
}

#ifdef PRIMEMOE_CAPI_HAVE_GEMM
// The device's SM count when the caller passes 0.
cudaError_t resolve_sms(int32_t requested, int32_t* out) {
  if (requested > 0) {
    *out = requested;
    return cudaSuccess;
  }
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(out, cudaDevAttrMultiProcessorCount, device);
  return err;
}
#endif

// Every C API entry point: clears the thread's error, runs body, turns an escaped exception into a status.
template <typename F>
primemoe_status guarded(const char* fn, F&& body) {
  clear_error();
  try {
    return body();
  } catch (...) {
    return fail(PRIMEMOE_STATUS_INTERNAL_ERROR, fn, "unexpected C++ exception");
  }
}

// ---- grouped GEMM ----------------------------------------------------------------------------------------------

primemoe_status check_grouped_gemm(const primemoe_grouped_gemm_args* a, const char* fn, GroupedGemmArgs* g) {
  if (primemoe_status s = check_struct(a, fn)) return s;
  Checker c{fn};
  c.require(a->schedule == PRIMEMOE_GEMM_ROWS || a->schedule == PRIMEMOE_GEMM_EXPERTS,
            "schedule: expected PRIMEMOE_GEMM_ROWS or PRIMEMOE_GEMM_EXPERTS, got %d", a->schedule);
  c.require(a->epilogue >= PRIMEMOE_EPILOGUE_STORE && a->epilogue <= PRIMEMOE_EPILOGUE_SWIGLU_BACKWARD,
            "epilogue: expected a primemoe_gemm_epilogue, got %d", a->epilogue);
  c.boolean(a->b_k_major, "b_k_major");
  c.boolean(a->zero_unrouted, "zero_unrouted");
  if (!c.ok()) return c.status;
  const auto schedule = static_cast<GemmSchedule>(a->schedule);
  const auto epilogue = static_cast<GemmEpilogue>(a->epilogue);
  const bool rows = schedule == GemmSchedule::kRows;
  const int32_t tile_n = gemm_tile_n(epilogue);
  c.require(a->num_experts >= 1, "num_experts: expected >= 1, got %d", a->num_experts);
  c.require(a->num_rows >= 0 && a->num_rows <= kInt32Max, "num_rows: expected 0 .. 2^31 - 1, got %lld",
            static_cast<long long>(a->num_rows));
  c.require(a->n > 0 && a->n % tile_n == 0, "n: expected a positive multiple of %d, got %d", tile_n, a->n);
  if (rows) {
    c.require(a->k > 0 && a->k % kGemmTileK == 0, "k: expected a positive multiple of %d, got %d", kGemmTileK, a->k);
  } else {
    c.require(a->m > 0 && a->m % 128 == 0, "m: expected a positive multiple of 128, got %d", a->m);
    c.require(epilogue == GemmEpilogue::kStore, "epilogue: PRIMEMOE_GEMM_EXPERTS takes PRIMEMOE_EPILOGUE_STORE only");
  }
  c.require(a->num_sms >= 0, "num_sms: expected >= 0 (0: the device's), got %d", a->num_sms);
  const bool work = a->num_rows > 0;
  c.pointer(a->expert_offsets, true, "expert_offsets");
  c.pointer(a->a, work, "a");
  c.pointer(a->b, work, "b");
  c.pointer(a->out, true, "out");
  if (epilogue == GemmEpilogue::kSwiGLUBackward) {
    c.pointer(a->in_h, work, "in_h");
    c.pointer(a->row_weight, work, "row_weight");
    c.pointer(a->out_dh, work, "out_dh");
    c.pointer(a->out_dot, work, "out_dot");
  } else {
    c.require(a->in_h == nullptr && a->out_dh == nullptr && a->out_dot == nullptr,
              "in_h / out_dh / out_dot: only for PRIMEMOE_EPILOGUE_SWIGLU_BACKWARD");
  }
  if (epilogue != GemmEpilogue::kSwiGLU) c.require(a->out_h == nullptr, "out_h: only for PRIMEMOE_EPILOGUE_SWIGLU");
  c.require(a->row_weight == nullptr || (rows && epilogue != GemmEpilogue::kSwiGLU),
            "row_weight: only for PRIMEMOE_GEMM_ROWS with PRIMEMOE_EPILOGUE_STORE or _SWIGLU_BACKWARD");
  if (rows) c.require(a->expert_rows == nullptr, "expert_rows: only for PRIMEMOE_GEMM_EXPERTS");
  c.require((a->hook_counters == nullptr) == (a->hook_epoch == nullptr),
            "hook_counters / hook_epoch: set both or neither");
  if (a->hook_counters != nullptr) {
    c.require(a->hook_per_epoch >= 1, "hook_per_epoch: expected >= 1 with hook_counters");
  }
  for (const auto& [p, name] : {std::pair<const void*, const char*>{a->a, "a"}, {a->b, "b"}, {a->out, "out"},
                                {a->out_h, "out_h"}, {a->in_h, "in_h"}, {a->out_dh, "out_dh"}}) {
    c.aligned(p, name);
  }
  if (!c.ok()) return c.status;

  GroupedGemmArgs& x = *g;
  x = GroupedGemmArgs{};
  x.schedule = schedule;
  x.epilogue = epilogue;
  x.a = a->a;
  x.b = a->b;
  x.b_k_major = a->b_k_major != 0;
  x.num_rows = a->num_rows;
  x.zero_unrouted = a->zero_unrouted != 0;
  x.m = a->m;
  x.n = a->n;
  x.k = a->k;
  x.num_experts = a->num_experts;
  x.expert_offsets = a->expert_offsets;
  x.expert_rows = a->expert_rows;
  x.out = a->out;
  x.out_h = a->out_h;
  x.in_h = a->in_h;
  x.row_weight = a->row_weight;
  x.out_dh = a->out_dh;
  x.out_dot = a->out_dot;
  x.hook.counters = a->hook_counters;
  x.hook.epoch = a->hook_epoch;
  x.hook.per_epoch = a->hook_per_epoch;
  x.hook.rank = a->hook_rank;
  x.hook.timeout_ns = a->hook_timeout_ns;
  x.tile_counter = a->tile_counter;
  x.error = reinterpret_cast<ErrorRecord*>(a->error);
  x.num_sms = a->num_sms;
#ifdef PRIMEMOE_CAPI_HAVE_GEMM
  if (!gemm_config_built(x, GemmConfig{})) {
    return fail(PRIMEMOE_STATUS_NOT_SUPPORTED, fn, "no kernel is built for this schedule / epilogue / b_k_major");
  }
  return PRIMEMOE_STATUS_SUCCESS;
#else
  return fail(PRIMEMOE_STATUS_NOT_SUPPORTED, fn, "this library is built without the GEMM engine (PRIMEMOE_BUILD_GEMM=OFF)");
#endif
}

primemoe_status check_fp8_gemm(const primemoe_fp8_gemm_args* a, const char* fn, Fp8GemmArgs* g) {
  if (primemoe_status s = check_struct(a, fn)) return s;
  Checker c{fn};
  c.require(a->schedule == PRIMEMOE_GEMM_ROWS || a->schedule == PRIMEMOE_GEMM_EXPERTS,
            "schedule: expected PRIMEMOE_GEMM_ROWS or PRIMEMOE_GEMM_EXPERTS, got %d", a->schedule);
  c.require(a->out_dtype == PRIMEMOE_DTYPE_BFLOAT16 || a->out_dtype == PRIMEMOE_DTYPE_FLOAT32,
            "out_dtype: expected PRIMEMOE_DTYPE_BFLOAT16 or PRIMEMOE_DTYPE_FLOAT32, got %d", a->out_dtype);
  if (!c.ok()) return c.status;
  const bool rows = a->schedule == PRIMEMOE_GEMM_ROWS;
  c.require(a->num_experts >= 1, "num_experts: expected >= 1, got %d", a->num_experts);
  c.require(a->num_rows >= 0 && a->num_rows <= kInt32Max, "num_rows: expected 0 .. 2^31 - 1, got %lld",
            static_cast<long long>(a->num_rows));
  c.require(a->n > 0 && a->n % kFp8TileN == 0, "n: expected a positive multiple of %d, got %d", kFp8TileN, a->n);
  if (rows) {
    c.require(a->k > 0 && a->k % kFp8TileK == 0, "k: expected a positive multiple of %d, got %d", kFp8TileK, a->k);
    c.require(a->expert_rows == nullptr, "expert_rows: only for PRIMEMOE_GEMM_EXPERTS");
  } else {
    c.require(a->m > 0 && a->m % kFp8TileM == 0, "m: expected a positive multiple of %d, got %d", kFp8TileM, a->m);
    c.require(a->num_rows % kFp8TileK == 0, "num_rows: expected a multiple of %d for PRIMEMOE_GEMM_EXPERTS, got %lld",
              kFp8TileK, static_cast<long long>(a->num_rows));
    c.require(a->row_weight == nullptr, "row_weight: only for PRIMEMOE_GEMM_ROWS");
  }
  c.require(a->num_sms >= 0, "num_sms: expected >= 0 (0: the device's), got %d", a->num_sms);
  const bool work = a->num_rows > 0;
  c.pointer(a->expert_offsets, true, "expert_offsets");
  c.pointer(a->a, work, "a");
  c.pointer(a->a_scale, work, "a_scale");
  c.pointer(a->b, work, "b");
  c.pointer(a->b_scale, work, "b_scale");
  c.pointer(a->out, true, "out");
  c.aligned(a->a, "a");
  c.aligned(a->b, "b");
  c.aligned(a->out, "out");
  if (!rows) {
    c.aligned(a->a_scale, "a_scale");
    c.aligned(a->b_scale, "b_scale");
  }
  if (!c.ok()) return c.status;

  Fp8GemmArgs& x = *g;
  x = Fp8GemmArgs{};
  x.schedule = rows ? Fp8Schedule::kRows : Fp8Schedule::kExperts;
  x.a = a->a;
  x.a_scale = a->a_scale;
  x.b = a->b;
  x.b_scale = a->b_scale;
  x.num_rows = a->num_rows;
  x.m = a->m;
  x.n = a->n;
  x.k = a->k;
  x.num_experts = a->num_experts;
  x.expert_offsets = a->expert_offsets;
  x.expert_rows = a->expert_rows;
  x.row_weight = a->row_weight;
  x.out = a->out;
  x.out_fp32 = a->out_dtype == PRIMEMOE_DTYPE_FLOAT32;
  x.num_sms = a->num_sms;
#ifdef PRIMEMOE_CAPI_HAVE_GEMM
  return PRIMEMOE_STATUS_SUCCESS;
#else
  return fail(PRIMEMOE_STATUS_NOT_SUPPORTED, fn, "this library is built without the GEMM engine (PRIMEMOE_BUILD_GEMM=OFF)");
#endif
}

}  // namespace
}  // namespace primemoe

using namespace primemoe;

extern "C" {

// ---- library -------------------------------------------------------------------------------------------------------

uint32_t primemoe_capi_version(void) { return PRIMEMOE_CAPI_VERSION; }

uint32_t primemoe_capi_features(void) {
  uint32_t f = 0;
#ifdef PRIMEMOE_CAPI_HAVE_GEMM
  f |= PRIMEMOE_CAPI_FEATURE_GEMM;
#endif
#ifdef PRIMEMOE_HAVE_SM90A
  f |= PRIMEMOE_CAPI_FEATURE_SM90A;
#endif
  return f;
}

const char* primemoe_capi_status_string(primemoe_status status) {
  switch (status) {
    case PRIMEMOE_STATUS_SUCCESS: return "PRIMEMOE_STATUS_SUCCESS: success";
    case PRIMEMOE_STATUS_INVALID_ARGUMENT: return "PRIMEMOE_STATUS_INVALID_ARGUMENT: an argument is outside the contract";
    case PRIMEMOE_STATUS_NOT_SUPPORTED: return "PRIMEMOE_STATUS_NOT_SUPPORTED: no built kernel covers these arguments";
    case PRIMEMOE_STATUS_CUDA_ERROR: return "PRIMEMOE_STATUS_CUDA_ERROR: a CUDA runtime call failed";
    case PRIMEMOE_STATUS_VERSION_MISMATCH: return "PRIMEMOE_STATUS_VERSION_MISMATCH: struct_size unknown to this library";
    case PRIMEMOE_STATUS_INTERNAL_ERROR: return "PRIMEMOE_STATUS_INTERNAL_ERROR: internal error";
  }
  return "PRIMEMOE_STATUS_UNKNOWN: not a primemoe_status";
}

const char* primemoe_capi_last_error(void) { return t_message; }

int32_t primemoe_capi_last_cuda_error(void) { return t_cuda_error; }

// ---- device error record -----------------------------------------------------------------------------------------

primemoe_status primemoe_device_error_record(int32_t device, primemoe_error_record** out) {
  static const char* fn = "primemoe_device_error_record";
  return guarded(fn, [&] {
    if (out == nullptr) return fail(PRIMEMOE_STATUS_INVALID_ARGUMENT, fn, "out: expected a pointer, got NULL");
    if (device < 0) return fail(PRIMEMOE_STATUS_INVALID_ARGUMENT, fn, "device: expected >= 0, got %d", device);
    ErrorRecord* rec = device_error_record(device);
    if (rec == nullptr) return fail(PRIMEMOE_STATUS_CUDA_ERROR, fn, "could not allocate the host-mapped record");
    *out = reinterpret_cast<primemoe_error_record*>(rec);
    return PRIMEMOE_STATUS_SUCCESS;
  });
}

primemoe_status primemoe_take_device_error(int32_t device, primemoe_error_record* out, int32_t* pending) {
  static const char* fn = "primemoe_take_device_error";
  return guarded(fn, [&] {
    if (out == nullptr || pending == nullptr) {
      return fail(PRIMEMOE_STATUS_INVALID_ARGUMENT, fn, "out / pending: expected pointers, got NULL");
    }
    ErrorRecord rec{};
    *pending = take_error(device, &rec) ? 1 : 0;
    *out = primemoe_error_record{rec.claimed, rec.code, rec.value, rec.limit, rec.index0, rec.index1};
    return PRIMEMOE_STATUS_SUCCESS;
  });
}

// ---- routing layout ------------------------------------------------------------------------------------------------

int64_t primemoe_dispatch_layout_max_rows(int64_t num_slots, int32_t num_local, int32_t row_align) {
  if (num_slots < 0 || num_local < 1 || num_local > kLayoutMaxLocalExperts || row_align < 1) return -1;
  return layout_max_rows(num_slots, num_local, row_align);
}

int64_t primemoe_dispatch_layout_workspace_ints(int64_t num_slots, int32_t num_local) {
  if (num_slots < 0 || num_local < 1 || num_local > kLayoutMaxLocalExperts) return -1;
  return layout_workspace_ints(num_slots, num_local);
}

primemoe_status primemoe_dispatch_layout(const primemoe_dispatch_layout_args* a, void* stream) {
  static const char* fn = "primemoe_dispatch_layout";
  return guarded(fn, [&] {
    if (primemoe_status s = check_struct(a, fn)) return s;
    Checker c{fn};
    c.require(a->idx_dtype == PRIMEMOE_DTYPE_INT32 || a->idx_dtype == PRIMEMOE_DTYPE_INT64,
              "idx_dtype: expected PRIMEMOE_DTYPE_INT32 or PRIMEMOE_DTYPE_INT64, got %d", a->idx_dtype);
    c.require(a->num_slots >= 0, "num_slots: expected >= 0, got %lld", static_cast<long long>(a->num_slots));
    c.require(a->top_k >= 1, "top_k: expected >= 1, got %d", a->top_k);
    c.require(a->top_k < 1 || a->num_slots % a->top_k == 0, "num_slots: expected a multiple of top_k (T * K)");
    c.require(a->num_local >= 1 && a->num_local <= kLayoutMaxLocalExperts, "num_local: expected 1 .. %d, got %d",
              kLayoutMaxLocalExperts, a->num_local);
    c.require(a->expert_begin >= 0 && int64_t(a->expert_begin) + a->num_local <= a->num_experts,
              "expert_begin: the local experts [%d, %lld) must lie in [0, num_experts = %d)", a->expert_begin,
              static_cast<long long>(int64_t(a->expert_begin) + a->num_local), a->num_experts);
    c.require(a->row_align >= 1, "row_align: expected >= 1, got %d", a->row_align);
    if (!c.ok()) return c.status;
    c.require(layout_max_rows(a->num_slots, a->num_local, a->row_align) <= kInt32Max,
              "num_slots: too many slots for 32-bit row indices");
    const bool work = a->num_slots > 0;
    c.pointer(a->topk_idx, work, "topk_idx");
    c.pointer(a->expert_counts, true, "expert_counts");
    c.pointer(a->expert_offsets, true, "expert_offsets");
    c.pointer(a->slot_to_row, work, "slot_to_row");
    c.pointer(a->row_to_slot, layout_max_rows(a->num_slots, a->num_local, a->row_align) > 0, "row_to_slot");
    c.pointer(a->workspace, layout_workspace_ints(a->num_slots, a->num_local) > 0, "workspace");
    if (!c.ok()) return c.status;
    DispatchLayoutArgs x{};
    x.topk_idx = a->topk_idx;
    x.idx_is_int64 = a->idx_dtype == PRIMEMOE_DTYPE_INT64;
    x.num_slots = a->num_slots;
    x.top_k = a->top_k;
    x.num_experts = a->num_experts;
    x.expert_begin = a->expert_begin;
    x.num_local = a->num_local;
    x.row_align = a->row_align;
    x.expert_counts = a->expert_counts;
    x.expert_offsets = a->expert_offsets;
    x.slot_to_row = a->slot_to_row;
    x.row_to_slot = a->row_to_slot;
    x.slot_valid = reinterpret_cast<bool*>(a->slot_valid);
    x.workspace = a->workspace;
    x.error = reinterpret_cast<ErrorRecord*>(a->error);
    return from_cuda(launch_dispatch_layout(x, as_stream(stream)), fn);
  });
}

// ---- row ops -------------------------------------------------------------------------------------------------------

primemoe_status primemoe_gather_rows(const primemoe_gather_rows_args* a, void* stream) {
  static const char* fn = "primemoe_gather_rows";
  return guarded(fn, [&] {
    if (primemoe_status s = check_struct(a, fn)) return s;
    Checker c{fn};
    ScaleType st{};
    c.require(scale_type(a->scale_dtype, true, &st),
              "scale_dtype: expected PRIMEMOE_DTYPE_NONE, _FLOAT32 or _BFLOAT16, got %d", a->scale_dtype);
    c.require(a->hidden >= 0 && a->hidden % kBf16Vec == 0, "hidden: expected a multiple of %d, got %d", kBf16Vec,
              a->hidden);
    c.require(a->top_k >= 1, "top_k: expected >= 1, got %d", a->top_k);
    c.require(a->num_rows >= 0 && a->num_tokens >= 0, "num_rows / num_tokens: expected >= 0");
    const bool work = a->num_rows > 0 && a->hidden > 0;
    c.pointer(a->src, work && a->num_tokens > 0, "src");
    c.pointer(a->row_to_slot, a->num_rows > 0, "row_to_slot");
    c.pointer(a->slot_to_row, work && a->num_tokens > 0, "slot_to_row");
    c.pointer(a->dst, work, "dst");
    c.require(st == ScaleType::kNone || a->scale != nullptr || !work, "scale: expected a pointer with scale_dtype");
    c.aligned(a->src, "src");
    c.aligned(a->dst, "dst");
    if (!c.ok()) return c.status;
    GatherRowsArgs x{};
    x.src = a->src;
    x.row_to_slot = a->row_to_slot;
    x.slot_to_row = a->slot_to_row;
    x.scale = st == ScaleType::kNone ? nullptr : a->scale;
    x.scale_type = st;
    x.dst = a->dst;
    x.row_end = a->row_end;
    x.num_rows = a->num_rows;
    x.num_tokens = a->num_tokens;
    x.hidden = a->hidden;
    x.top_k = a->top_k;
    if (a->hidden == 0) return PRIMEMOE_STATUS_SUCCESS;
    return from_cuda(launch_gather_rows(x, as_stream(stream)), fn);
  });
}

primemoe_status primemoe_combine(const primemoe_combine_args* a, void* stream) {
  static const char* fn = "primemoe_combine";
  return guarded(fn, [&] {
    if (primemoe_status s = check_struct(a, fn)) return s;
    Checker c{fn};
    ScaleType wt{};
    c.require(scale_type(a->weight_dtype, true, &wt),
              "weight_dtype: expected PRIMEMOE_DTYPE_NONE, _FLOAT32 or _BFLOAT16, got %d", a->weight_dtype);
    c.require(a->hidden >= 0 && a->hidden % kBf16Vec == 0, "hidden: expected a multiple of %d, got %d", kBf16Vec,
              a->hidden);
    c.require(a->top_k >= 1, "top_k: expected >= 1, got %d", a->top_k);
    c.require(a->num_tokens >= 0, "num_tokens: expected >= 0");
    const bool work = a->num_tokens > 0 && a->hidden > 0;
    c.pointer(a->rows, work, "rows");
    c.pointer(a->slot_to_row, work, "slot_to_row");
    c.pointer(a->y, work, "y");
    c.require(wt == ScaleType::kNone || a->weights != nullptr || !work, "weights: expected a pointer with weight_dtype");
    c.aligned(a->rows, "rows");
    c.aligned(a->y, "y");
    if (!c.ok()) return c.status;
    CombineReduceArgs x{};
    x.rows = a->rows;
    x.slot_to_row = a->slot_to_row;
    x.weights = wt == ScaleType::kNone ? nullptr : a->weights;
    x.weight_type = wt;
    x.y = a->y;
    x.num_tokens = a->num_tokens;
    x.hidden = a->hidden;
    x.top_k = a->top_k;
    if (a->hidden == 0) return PRIMEMOE_STATUS_SUCCESS;
    return from_cuda(launch_combine_reduce(x, as_stream(stream)), fn);
  });
}

primemoe_status primemoe_slot_dot(const primemoe_slot_dot_args* a, void* stream) {
  static const char* fn = "primemoe_slot_dot";
  return guarded(fn, [&] {
    if (primemoe_status s = check_struct(a, fn)) return s;
    Checker c{fn};
    c.require(a->width >= 0 && a->width % kBf16Vec == 0, "width: expected a multiple of %d, got %d", kBf16Vec,
              a->width);
    c.require(a->num_slots >= 0, "num_slots: expected >= 0");
    const bool work = a->num_slots > 0;
    c.pointer(a->a, work && a->width > 0, "a");
    c.pointer(a->b, work && a->width > 0, "b");
    c.pointer(a->slot_to_row, work, "slot_to_row");
    c.pointer(a->out, work, "out");
    c.aligned(a->a, "a");
    c.aligned(a->b, "b");
    if (!c.ok()) return c.status;
    SlotDotArgs x{};
    x.a = a->a;
    x.b = a->b;
    x.slot_to_row = a->slot_to_row;
    x.out = a->out;
    x.num_slots = a->num_slots;
    x.width = a->width;
    return from_cuda(launch_slot_dot(x, as_stream(stream)), fn);
  });
}

// ---- FP8 quantisers ------------------------------------------------------------------------------------------------

primemoe_status primemoe_quantize_1x128(const primemoe_quantize_1x128_args* a, void* stream) {
  static const char* fn = "primemoe_quantize_1x128";
  return guarded(fn, [&] {
    if (primemoe_status s = check_struct(a, fn)) return s;
    Checker c{fn};
    c.boolean(a->pow2, "pow2");
    c.boolean(a->scale_mn_major, "scale_mn_major");
    c.require(a->rows >= 0, "rows: expected >= 0");
    c.require(a->cols >= 0 && a->cols % kFp8Tile == 0, "cols: expected a multiple of %d, got %lld", kFp8Tile,
              static_cast<long long>(a->cols));
    const bool work = a->rows > 0 && a->cols > 0;
    c.pointer(a->x, work, "x");
    c.pointer(a->q, work, "q");
    c.pointer(a->scale, work, "scale");
    c.aligned(a->x, "x");
    c.aligned(a->q, "q");
    if (!c.ok()) return c.status;
    Quantize1x128Args x{a->x, a->q, a->scale, a->rows, a->cols, a->pow2 != 0, a->scale_mn_major != 0, a->rows_end};
    return from_cuda(launch_quantize_1x128(x, as_stream(stream)), fn);
  });
}

primemoe_status primemoe_quantize_128x1(const primemoe_quantize_128x1_args* a, void* stream) {
  static const char* fn = "primemoe_quantize_128x1";
  return guarded(fn, [&] {
    if (primemoe_status s = check_struct(a, fn)) return s;
    Checker c{fn};
    c.boolean(a->pow2, "pow2");
    c.boolean(a->scale_mn_major, "scale_mn_major");
    c.require(a->rows >= 0 && a->rows % kFp8Tile == 0, "rows: expected a multiple of %d, got %lld", kFp8Tile,
              static_cast<long long>(a->rows));
    c.require(a->cols >= 0 && a->cols % 8 == 0, "cols: expected a multiple of 8, got %lld",
              static_cast<long long>(a->cols));
    const bool work = a->rows > 0 && a->cols > 0;
    c.pointer(a->x, work, "x");
    c.pointer(a->q_t, work, "q_t");
    c.pointer(a->scale, work, "scale");
    c.aligned(a->x, "x");
    c.aligned(a->q_t, "q_t");
    if (!c.ok()) return c.status;
    Quantize128x1Args x{a->x, a->q_t, a->scale, a->rows, a->cols, a->pow2 != 0, a->scale_mn_major != 0, a->rows_end};
    return from_cuda(launch_quantize_128x1(x, as_stream(stream)), fn);
  });
}

primemoe_status primemoe_quantize_128x128(const primemoe_quantize_128x128_args* a, void* stream) {
  static const char* fn = "primemoe_quantize_128x128";
  return guarded(fn, [&] {
    if (primemoe_status s = check_struct(a, fn)) return s;
    Checker c{fn};
    c.boolean(a->pow2, "pow2");
    c.require(a->rows >= 0 && a->rows % kFp8Tile == 0, "rows: expected a multiple of %d, got %lld", kFp8Tile,
              static_cast<long long>(a->rows));
    c.require(a->cols >= 0 && a->cols % kFp8Tile == 0, "cols: expected a multiple of %d, got %lld", kFp8Tile,
              static_cast<long long>(a->cols));
    const bool work = a->rows > 0 && a->cols > 0;
    c.pointer(a->w, work, "w");
    c.pointer(a->q, work, "q");
    c.pointer(a->scale, work, "scale");
    c.aligned(a->w, "w");
    c.aligned(a->q, "q");
    if (!c.ok()) return c.status;
    Quantize128x128Args x{a->w, a->q, a->scale, a->rows, a->cols, a->pow2 != 0};
    return from_cuda(launch_quantize_128x128(x, as_stream(stream)), fn);
  });
}

primemoe_status primemoe_fp8_swiglu_quant(const primemoe_fp8_swiglu_quant_args* a, void* stream) {
  static const char* fn = "primemoe_fp8_swiglu_quant";
  return guarded(fn, [&] {
    if (primemoe_status s = check_struct(a, fn)) return s;
    Checker c{fn};
    c.boolean(a->pow2, "pow2");
    c.require(a->rows >= 0, "rows: expected >= 0");
    c.require(a->inter >= 0 && a->inter % kFp8Tile == 0, "inter: expected a multiple of %d, got %lld", kFp8Tile,
              static_cast<long long>(a->inter));
    const bool work = a->rows > 0 && a->inter > 0;
    c.pointer(a->h, work, "h");
    c.pointer(a->a_q, work, "a_q");
    c.pointer(a->a_scale, work, "a_scale");
    c.aligned(a->h, "h");
    c.aligned(a->a_q, "a_q");
    if (!c.ok()) return c.status;
    Fp8SwigluQuantArgs x{a->h, a->a_q, a->a_scale, a->rows_end, a->rows, a->inter, a->pow2 != 0};
    return from_cuda(launch_fp8_swiglu_quant(x, as_stream(stream)), fn);
  });
}

primemoe_status primemoe_fp8_swiglu_backward(const primemoe_fp8_swiglu_backward_args* a, void* stream) {
  static const char* fn = "primemoe_fp8_swiglu_backward";
  return guarded(fn, [&] {
    if (primemoe_status s = check_struct(a, fn)) return s;
    Checker c{fn};
    c.boolean(a->pow2, "pow2");
    c.require(a->rows >= 0, "rows: expected >= 0");
    c.require(a->inter >= 0 && a->inter % kFp8Tile == 0, "inter: expected a multiple of %d, got %lld", kFp8Tile,
              static_cast<long long>(a->inter));
    const bool rows = a->rows > 0;
    const bool work = rows && a->inter > 0;
    c.pointer(a->da, work, "da");
    c.pointer(a->h, work, "h");
    c.pointer(a->row_weight, work, "row_weight");
    c.pointer(a->dh, work, "dh");
    c.pointer(a->dh_q, work, "dh_q");
    c.pointer(a->dh_scale, work, "dh_scale");
    c.pointer(a->aw, work, "aw");
    c.pointer(a->dot, rows, "dot");
    for (const auto& [p, name] : {std::pair<const void*, const char*>{a->da, "da"}, {a->h, "h"}, {a->dh, "dh"},
                                  {a->dh_q, "dh_q"}, {a->aw, "aw"}}) {
      c.aligned(p, name);
    }
    if (!c.ok()) return c.status;
    Fp8SwigluBackwardArgs x{a->da, a->h, a->row_weight, a->dh, a->dh_q, a->dh_scale, a->aw, a->dot,
                            a->rows_end, a->rows, a->inter, a->pow2 != 0};
    return from_cuda(launch_fp8_swiglu_backward(x, as_stream(stream)), fn);
  });
}

// ---- GEMMs -----------------------------------------------------------------------------------------------------------

primemoe_status primemoe_grouped_gemm_supported(const primemoe_grouped_gemm_args* a, int32_t device) {
  static const char* fn = "primemoe_grouped_gemm_supported";
  return guarded(fn, [&] {
    GroupedGemmArgs g{};
    if (primemoe_status s = check_grouped_gemm(a, fn, &g)) return s;
#ifdef PRIMEMOE_CAPI_HAVE_GEMM
    const char* why = "";
    if (!grouped_gemm_supported(g, device, &why)) return fail(PRIMEMOE_STATUS_NOT_SUPPORTED, fn, "%s", why);
#endif
    (void)device;
    return PRIMEMOE_STATUS_SUCCESS;
  });
}

primemoe_status primemoe_grouped_gemm(const primemoe_grouped_gemm_args* a, void* stream) {
  static const char* fn = "primemoe_grouped_gemm";
  return guarded(fn, [&] {
    GroupedGemmArgs g{};
    if (primemoe_status s = check_grouped_gemm(a, fn, &g)) return s;
#ifdef PRIMEMOE_CAPI_HAVE_GEMM
    const cudaStream_t s = as_stream(stream);
    if (g.num_rows == 0) {  // nothing to read: ROWS writes no row, EXPERTS writes zeros
      if (g.schedule == GemmSchedule::kRows) return PRIMEMOE_STATUS_SUCCESS;
      return from_cuda(cudaMemsetAsync(g.out, 0, size_t(g.num_experts) * size_t(g.m) * size_t(g.n) * 2, s), fn);
    }
    int device = 0;
    if (primemoe_status st = from_cuda(cudaGetDevice(&device), fn)) return st;
    const char* why = "";
    if (!grouped_gemm_supported(g, device, &why)) return fail(PRIMEMOE_STATUS_NOT_SUPPORTED, fn, "%s", why);
    if (primemoe_status st = from_cuda(resolve_sms(a->num_sms, &g.num_sms), fn)) return st;
    GemmConfig config = choose_gemm_config(g);
    if (config.claim_tiles && g.tile_counter == nullptr) config = GemmConfig{};  // static order: always built
    if (!gemm_config_built(g, config)) config = GemmConfig{};
    if (config.claim_tiles) {
      if (primemoe_status st = from_cuda(cudaMemsetAsync(g.tile_counter, 0, sizeof(int32_t), s), fn)) return st;
    }
    return from_cuda(launch_grouped_gemm(g, config, s), fn);
#else
    (void)stream;
    return PRIMEMOE_STATUS_INTERNAL_ERROR;  // check_grouped_gemm returned NOT_SUPPORTED
#endif
  });
}

primemoe_status primemoe_fp8_gemm_supported(const primemoe_fp8_gemm_args* a, int32_t device) {
  static const char* fn = "primemoe_fp8_gemm_supported";
  return guarded(fn, [&] {
    Fp8GemmArgs g{};
    if (primemoe_status s = check_fp8_gemm(a, fn, &g)) return s;
#ifdef PRIMEMOE_CAPI_HAVE_GEMM
    const char* why = "";
    if (!fp8_gemm_supported(g, device, &why)) return fail(PRIMEMOE_STATUS_NOT_SUPPORTED, fn, "%s", why);
#endif
    (void)device;
    return PRIMEMOE_STATUS_SUCCESS;
  });
}

primemoe_status primemoe_fp8_gemm(const primemoe_fp8_gemm_args* a, void* stream) {
  static const char* fn = "primemoe_fp8_gemm";
  return guarded(fn, [&] {
    Fp8GemmArgs g{};
    if (primemoe_status s = check_fp8_gemm(a, fn, &g)) return s;
#ifdef PRIMEMOE_CAPI_HAVE_GEMM
    const cudaStream_t s = as_stream(stream);
    if (g.num_rows == 0) {
      if (g.schedule == Fp8Schedule::kRows) return PRIMEMOE_STATUS_SUCCESS;
      const size_t elem = g.out_fp32 ? 4 : 2;
      return from_cuda(cudaMemsetAsync(g.out, 0, size_t(g.num_experts) * size_t(g.m) * size_t(g.n) * elem, s), fn);
    }
    int device = 0;
    if (primemoe_status st = from_cuda(cudaGetDevice(&device), fn)) return st;
    const char* why = "";
    if (!fp8_gemm_supported(g, device, &why)) return fail(PRIMEMOE_STATUS_NOT_SUPPORTED, fn, "%s", why);
    if (primemoe_status st = from_cuda(resolve_sms(a->num_sms, &g.num_sms), fn)) return st;
    return from_cuda(launch_fp8_gemm(g, s), fn);
#else
    (void)stream;
    return PRIMEMOE_STATUS_INTERNAL_ERROR;
#endif
  });
}

}  // extern "C"
