/* primemoe C API: one call per kernel launch of primemoe's MoE layer (routing layout, row gather / combine,
 * FP8 quantisers, the bf16 grouped GEMM and the blockwise FP8 GEMM on Hopper), over raw device pointers, sizes
 * and a CUDA stream. Plain C (C99 or C++), no torch, for a DeepGEMM fork, TransformerEngine, a JAX FFI handler or
 * any other host code. docs/vendoring.md shows the build (CMake: find_package(primemoe CONFIG), primemoe::capi).
 *
 * Conventions
 *   - Every call returns a primemoe_status. Invalid arguments are reported as PRIMEMOE_STATUS_INVALID_ARGUMENT
 *     before anything touches CUDA (no exception crosses this API); primemoe_capi_last_error() then names the
 *     argument. Problems the built kernels do not cover (e.g. no sm_90a kernels, not a Hopper GPU) are
 *     PRIMEMOE_STATUS_NOT_SUPPORTED; a failing CUDA call is PRIMEMOE_STATUS_CUDA_ERROR
 *     (primemoe_capi_last_cuda_error() gives its cudaError_t).
 *   - Pointers are device pointers (or host-mapped memory) on the current CUDA device unless stated otherwise.
 *     A pointer marked "optional" may be NULL; the others may be NULL only when their tensor is empty.
 *   - `stream` is a cudaStream_t passed as void* (NULL: the legacy default stream). The calls enqueue work and
 *     return: no host synchronisation, nothing allocated, so they may be captured in a CUDA graph.
 *   - The current device is the caller's (cudaSetDevice); the calls never change it.
 *   - Booleans are int32_t (0 / 1). Enumerations are passed in int32_t fields (stable size).
 *   - Every argument struct starts with struct_size, which the caller sets to sizeof the struct it was compiled
 *     with: PRIMEMOE_ARGS_INIT(type) does that and zeroes the rest, e.g.
 *         primemoe_quantize_1x128_args q = PRIMEMOE_ARGS_INIT(primemoe_quantize_1x128_args);
 *     A struct_size the library does not know is PRIMEMOE_STATUS_VERSION_MISMATCH.
 *
 * Versioning: PRIMEMOE_CAPI_VERSION = major * 10000 + minor * 100 + patch. A new major version may change any
 * struct or signature (and the shared library's soname, libprimemoe_capi.so.<major>); a new minor version only
 * adds functions, enumerators, or fields at the end of a struct (older struct_size values stay accepted).
 * Check at run time that (primemoe_capi_version() / 10000) == PRIMEMOE_CAPI_VERSION_MAJOR.
 *
 * Thread safety: calls may be made from several threads; the error details are per thread. */
#ifndef PRIMEMOE_CAPI_H_
#define PRIMEMOE_CAPI_H_

#include <stddef.h>
#include <stdint.h>

#define PRIMEMOE_CAPI_VERSION_MAJOR 1
#define PRIMEMOE_CAPI_VERSION_MINOR 0
#define PRIMEMOE_CAPI_VERSION_PATCH 0
#define PRIMEMOE_CAPI_VERSION \
  (PRIMEMOE_CAPI_VERSION_MAJOR * 10000 + PRIMEMOE_CAPI_VERSION_MINOR * 100 + PRIMEMOE_CAPI_VERSION_PATCH)

#if defined(PRIMEMOE_CAPI_BUILDING) && (defined(__GNUC__) || defined(__clang__))
#define PRIMEMOE_CAPI __attribute__((visibility("default")))
#else
#define PRIMEMOE_CAPI
#endif

/* An argument struct with struct_size set and every other field zero (no -Wmissing-field-initializers warning:
 * a designated initializer in C, a value-initialised object in C++). */
#ifdef __cplusplus
namespace primemoe_capi_detail {
template <typename T>
inline T args_init() {
  T args{};
  args.struct_size = static_cast<uint32_t>(sizeof(T));
  return args;
}
}  /* namespace primemoe_capi_detail */
#define PRIMEMOE_ARGS_INIT(type) (::primemoe_capi_detail::args_init<type>())
#else
#define PRIMEMOE_ARGS_INIT(type) {.struct_size = (uint32_t)sizeof(type)}
#endif

/* Sizes of the kernels' contracts (equal to the C++ constants; the library checks that at compile time). */
#define PRIMEMOE_GEMM_ROW_ALIGN 64          /* expert row alignment of the bf16 grouped GEMM's layout */
#define PRIMEMOE_GEMM_TILE_N 256            /* output columns per bf16 GEMM tile (SwiGLU: 128) */
#define PRIMEMOE_GEMM_TILE_K 64
#define PRIMEMOE_FP8_TILE 128               /* values per FP8 scale; FP8 GEMM tile and k-block size */
#define PRIMEMOE_LAYOUT_MAX_LOCAL_EXPERTS 1024

#ifdef __cplusplus
extern "C" {
#endif

typedef enum primemoe_status {
  PRIMEMOE_STATUS_SUCCESS = 0,
  PRIMEMOE_STATUS_INVALID_ARGUMENT = 1, /* a NULL, size, alignment or enumerator outside the contract */
  PRIMEMOE_STATUS_NOT_SUPPORTED = 2,    /* valid, but no built kernel covers it (device, build, variant) */
  PRIMEMOE_STATUS_CUDA_ERROR = 3,       /* a CUDA runtime call failed: primemoe_capi_last_cuda_error() */
  PRIMEMOE_STATUS_VERSION_MISMATCH = 4, /* struct_size unknown to this library */
  PRIMEMOE_STATUS_INTERNAL_ERROR = 5    /* a bug: please report it with primemoe_capi_last_error() */
} primemoe_status;

typedef enum primemoe_dtype {
  PRIMEMOE_DTYPE_NONE = 0, /* "absent", where a field allows it */
  PRIMEMOE_DTYPE_INT32 = 1,
  PRIMEMOE_DTYPE_INT64 = 2,
  PRIMEMOE_DTYPE_FLOAT32 = 3,
  PRIMEMOE_DTYPE_BFLOAT16 = 4
} primemoe_dtype;

/* Bits of primemoe_capi_features(). */
#define PRIMEMOE_CAPI_FEATURE_GEMM 1u  /* the GEMM engine is built in (else the GEMM calls are NOT_SUPPORTED) */
#define PRIMEMOE_CAPI_FEATURE_SM90A 2u /* built with sm_90a kernels (the GEMMs need them and a Hopper GPU) */

/* ---- library ------------------------------------------------------------------------------------------------ */

/* The library's PRIMEMOE_CAPI_VERSION (not the header's: compare them). Touches no CUDA. */
PRIMEMOE_CAPI uint32_t primemoe_capi_version(void);
/* PRIMEMOE_CAPI_FEATURE_* bits of this build. Touches no CUDA. */
PRIMEMOE_CAPI uint32_t primemoe_capi_features(void);
/* A static string naming the status ("PRIMEMOE_STATUS_INVALID_ARGUMENT: ..."); never NULL. */
PRIMEMOE_CAPI const char* primemoe_capi_status_string(primemoe_status status);
/* Details of this thread's last failed call ("" when none); valid until this thread's next call. */
PRIMEMOE_CAPI const char* primemoe_capi_last_error(void);
/* The cudaError_t of this thread's last PRIMEMOE_STATUS_CUDA_ERROR (0 when none). */
PRIMEMOE_CAPI int32_t primemoe_capi_last_cuda_error(void);

/* ---- device-side error record ------------------------------------------------------------------------------- */

/* Kernels record the first bad datum they meet (without a host sync) into this host-mapped struct. */
typedef struct primemoe_error_record {
  int32_t claimed; /* first writer wins */
  int32_t code;    /* PRIMEMOE_DEVICE_ERROR_*; written last */
  int32_t value;
  int32_t limit;
  int64_t index0;
  int64_t index1;
} primemoe_error_record;

#define PRIMEMOE_DEVICE_ERROR_NONE 0
#define PRIMEMOE_DEVICE_ERROR_BAD_EXPERT_ID 1 /* value = the id, limit = E, index0 = token, index1 = k */
#define PRIMEMOE_DEVICE_ERROR_WAIT_TIMEOUT 2  /* value = awaited rank, limit = waiting rank, index0 = expert/block */
#define PRIMEMOE_DEVICE_ERROR_RECV_OVERFLOW 3 /* value = receiving rank, limit = its receive rows, index0 = rows */

/* *out = the device pointer of `device`'s record (allocated on first use, host-mapped), for the `error` fields. */
PRIMEMOE_CAPI primemoe_status primemoe_device_error_record(int32_t device, primemoe_error_record** out);
/* Copies `device`'s pending record into *out and clears it; *pending = 1 if there was one, else 0. Reads host
 * memory only: synchronise the stream first to see the errors of the work enqueued on it. */
PRIMEMOE_CAPI primemoe_status primemoe_take_device_error(int32_t device, primemoe_error_record* out, int32_t* pending);

/* ---- routing layout (kernels/dispatch_layout.cuh) ----------------------------------------------------------- */

/* Per local expert: routed rows, row-aligned offsets, and the two maps between slots (t * top_k + k) and the
 * expert-major rows. Rows of one expert keep slot order. */
typedef struct primemoe_dispatch_layout_args {
  uint32_t struct_size;
  int32_t idx_dtype;        /* PRIMEMOE_DTYPE_INT32 or PRIMEMOE_DTYPE_INT64 */
  const void* topk_idx;     /* [num_slots] global expert ids, -1 = skipped */
  int64_t num_slots;        /* T * top_k */
  int32_t top_k;            /* >= 1, divides num_slots */
  int32_t num_experts;      /* E (global); ids outside [-1, E) are recorded in `error` and skipped */
  int32_t expert_begin;     /* first local expert's global id */
  int32_t num_local;        /* 1 .. PRIMEMOE_LAYOUT_MAX_LOCAL_EXPERTS, expert_begin + num_local <= E */
  int32_t row_align;        /* >= 1; PRIMEMOE_GEMM_ROW_ALIGN for the bf16 GEMM, PRIMEMOE_FP8_TILE for FP8 */
  int32_t* expert_counts;   /* [num_local] out */
  int32_t* expert_offsets;  /* [num_local + 1] out; the last is the padded total */
  int32_t* slot_to_row;     /* [num_slots] out, -1 where not routed here */
  int32_t* row_to_slot;     /* [primemoe_dispatch_layout_max_rows()] out, -1 on padding */
  uint8_t* slot_valid;      /* optional [num_slots] out, 1-byte booleans */
  int32_t* workspace;       /* [primemoe_dispatch_layout_workspace_ints()] scratch */
  primemoe_error_record* error; /* optional (primemoe_device_error_record) */
} primemoe_dispatch_layout_args;

/* Rows of row_to_slot (the worst case); -1 for arguments outside the contract. Touches no CUDA. */
PRIMEMOE_CAPI int64_t primemoe_dispatch_layout_max_rows(int64_t num_slots, int32_t num_local, int32_t row_align);
/* int32 entries of the workspace; -1 for arguments outside the contract. Touches no CUDA. */
PRIMEMOE_CAPI int64_t primemoe_dispatch_layout_workspace_ints(int64_t num_slots, int32_t num_local);
PRIMEMOE_CAPI primemoe_status primemoe_dispatch_layout(const primemoe_dispatch_layout_args* args, void* stream);

/* ---- row ops (kernels/row_ops.cuh); bf16 rows, hidden a multiple of 8, 16-byte aligned ---------------------- */

/* dst[r] = src[row_to_slot[r] / top_k] * scale[row_to_slot[r]]; rows with slot -1 become 0, except that with
 * row_end the rows at or past *row_end are left unwritten. */
typedef struct primemoe_gather_rows_args {
  uint32_t struct_size;
  int32_t scale_dtype;          /* PRIMEMOE_DTYPE_NONE (no scale), _FLOAT32 or _BFLOAT16 */
  const void* src;              /* [num_tokens, hidden] bf16 */
  const int32_t* row_to_slot;   /* [num_rows] */
  const int32_t* slot_to_row;   /* [num_tokens * top_k], the inverse map (the layout's) */
  const void* scale;            /* [num_tokens * top_k], with scale_dtype != NONE */
  void* dst;                    /* [num_rows, hidden] bf16 */
  const int32_t* row_end;       /* optional: device pointer to the routed row count (expert_offsets[E]) */
  int64_t num_rows;
  int64_t num_tokens;
  int32_t hidden;
  int32_t top_k;
} primemoe_gather_rows_args;

/* y[t] = sum_k weight[t, k] * rows[slot_to_row[t * top_k + k]] over the slots with a row (fixed order, fp32). */
typedef struct primemoe_combine_args {
  uint32_t struct_size;
  int32_t weight_dtype;         /* PRIMEMOE_DTYPE_NONE (weight 1), _FLOAT32 or _BFLOAT16 */
  const void* rows;             /* [R, hidden] bf16 */
  const int32_t* slot_to_row;   /* [num_tokens * top_k] */
  const void* weights;          /* [num_tokens * top_k], with weight_dtype != NONE */
  void* y;                      /* [num_tokens, hidden] bf16 */
  int64_t num_tokens;
  int32_t hidden;
  int32_t top_k;
} primemoe_combine_args;

/* out[s] = <a[slot_to_row[s]], b[slot_to_row[s]]> in fp32, 0 for slots without a row (the routing-weight grad). */
typedef struct primemoe_slot_dot_args {
  uint32_t struct_size;
  int32_t width;                /* D, a multiple of 8 */
  const void* a;                /* [R, width] bf16 */
  const void* b;                /* [R, width] bf16 */
  const int32_t* slot_to_row;   /* [num_slots] */
  float* out;                   /* [num_slots] */
  int64_t num_slots;
} primemoe_slot_dot_args;

PRIMEMOE_CAPI primemoe_status primemoe_gather_rows(const primemoe_gather_rows_args* args, void* stream);
PRIMEMOE_CAPI primemoe_status primemoe_combine(const primemoe_combine_args* args, void* stream);
PRIMEMOE_CAPI primemoe_status primemoe_slot_dot(const primemoe_slot_dot_args* args, void* stream);

/* ---- FP8 (E4M3) quantisers (kernels/quantize.cuh, kernels/fp8_rows.cuh) ------------------------------------- */
/* One fp32 scale per 128 values; q = e4m3(clamp(x * m, +-448)), scale = 1 / m, m = 448 / amax (pow2: rounded
 * down to a power of two). bf16 inputs and e4m3 outputs 16-byte aligned. */

/* 1x128 tiles along the columns: scale [rows, cols / 128], or [cols / 128, rows] with scale_mn_major. */
typedef struct primemoe_quantize_1x128_args {
  uint32_t struct_size;
  int32_t pow2;
  const void* x;                /* [rows, cols] bf16 */
  void* q;                      /* [rows, cols] e4m3 */
  float* scale;
  int64_t rows;
  int64_t cols;                 /* a multiple of 128 */
  int32_t scale_mn_major;
  const int32_t* rows_end;      /* optional: rows at or past *rows_end are left unwritten */
} primemoe_quantize_1x128_args;

/* 128x1 tiles along the rows, transposed output q_t [cols, rows]: scale [cols, rows / 128], or [rows / 128, cols]
 * with scale_mn_major. */
typedef struct primemoe_quantize_128x1_args {
  uint32_t struct_size;
  int32_t pow2;
  const void* x;                /* [rows, cols] bf16 */
  void* q_t;                    /* [cols, rows] e4m3 */
  float* scale;
  int64_t rows;                 /* a multiple of 128 */
  int64_t cols;                 /* a multiple of 8 */
  int32_t scale_mn_major;
  const int32_t* rows_end;      /* optional */
} primemoe_quantize_128x1_args;

/* 128x128 blocks (weights, leading dimensions flattened into rows): scale [rows / 128, cols / 128]. */
typedef struct primemoe_quantize_128x128_args {
  uint32_t struct_size;
  int32_t pow2;
  const void* w;                /* [rows, cols] bf16 */
  void* q;                      /* [rows, cols] e4m3 */
  float* scale;
  int64_t rows;                 /* a multiple of 128 */
  int64_t cols;                 /* a multiple of 128 */
} primemoe_quantize_128x128_args;

/* FC1's SwiGLU on h = [gate | up] rows [rows, 2 * inter], a = bf16(silu(g) * u) quantised 1x128:
 * a_q [rows, inter] e4m3, a_scale [inter / 128, rows]. */
typedef struct primemoe_fp8_swiglu_quant_args {
  uint32_t struct_size;
  int32_t pow2;
  const void* h;
  void* a_q;
  float* a_scale;
  const int32_t* rows_end;      /* optional */
  int64_t rows;
  int64_t inter;                /* a multiple of 128 */
} primemoe_fp8_swiglu_quant_args;

/* FC2 dgrad's SwiGLU backward (kernels/fp8_rows.cuh): dh (bf16 and quantised 1x128), aw = bf16(w * a) and the
 * per-row dot <da, a>. */
typedef struct primemoe_fp8_swiglu_backward_args {
  uint32_t struct_size;
  int32_t pow2;
  const float* da;              /* [rows, inter] fp32 */
  const void* h;                /* [rows, 2 * inter] bf16 */
  const float* row_weight;      /* [rows] */
  void* dh;                     /* [rows, 2 * inter] bf16 */
  void* dh_q;                   /* [rows, 2 * inter] e4m3 */
  float* dh_scale;              /* [2 * inter / 128, rows] */
  void* aw;                     /* [rows, inter] bf16 */
  float* dot;                   /* [rows] */
  const int32_t* rows_end;      /* optional */
  int64_t rows;
  int64_t inter;                /* a multiple of 128 */
} primemoe_fp8_swiglu_backward_args;

PRIMEMOE_CAPI primemoe_status primemoe_quantize_1x128(const primemoe_quantize_1x128_args* args, void* stream);
PRIMEMOE_CAPI primemoe_status primemoe_quantize_128x1(const primemoe_quantize_128x1_args* args, void* stream);
PRIMEMOE_CAPI primemoe_status primemoe_quantize_128x128(const primemoe_quantize_128x128_args* args, void* stream);
PRIMEMOE_CAPI primemoe_status primemoe_fp8_swiglu_quant(const primemoe_fp8_swiglu_quant_args* args, void* stream);
PRIMEMOE_CAPI primemoe_status primemoe_fp8_swiglu_backward(const primemoe_fp8_swiglu_backward_args* args,
                                                           void* stream);

/* ---- bf16 grouped GEMM (gemm/grouped_gemm.cuh) -------------------------------------------------------------- */

typedef enum primemoe_gemm_schedule {
  PRIMEMOE_GEMM_ROWS = 0,    /* out[r, :] = a[r, :] x b[e(r)]; M = routed rows, per-expert weights */
  PRIMEMOE_GEMM_EXPERTS = 1  /* out[e] = a[rows of e]^T x b[rows of e]; reduces over each expert's rows (wgrad) */
} primemoe_gemm_schedule;

typedef enum primemoe_gemm_epilogue {
  PRIMEMOE_EPILOGUE_STORE = 0,           /* out = bf16(acc), optionally scaled per row by row_weight (ROWS) */
  PRIMEMOE_EPILOGUE_SWIGLU = 1,          /* FC1: out = bf16(silu(g) * u), out_h = [g | u] (optional) */
  PRIMEMOE_EPILOGUE_SWIGLU_BACKWARD = 2  /* FC2 dgrad: out = aw, out_dh, out_dot from in_h and row_weight */
} primemoe_gemm_epilogue;

/* The fields of gemm/grouped_gemm.cuh's GroupedGemmArgs (read it for the operand shapes). The rows are the
 * layout's with row_align PRIMEMOE_GEMM_ROW_ALIGN; n a multiple of PRIMEMOE_GEMM_TILE_N (SWIGLU: 128), ROWS: k a
 * multiple of 64, EXPERTS: m a multiple of 128. Operands 16-byte aligned. The built variants: ROWS with every
 * epilogue (STORE with b_k_major 0 or 1, SWIGLU with 1, SWIGLU_BACKWARD with 0), EXPERTS with STORE, b_k_major 0. */
typedef struct primemoe_grouped_gemm_args {
  uint32_t struct_size;
  int32_t schedule;             /* primemoe_gemm_schedule */
  int32_t epilogue;             /* primemoe_gemm_epilogue */
  int32_t b_k_major;            /* ROWS: b is [E, n, k] (1) or [E, k, n] (0) */
  int32_t zero_unrouted;        /* ROWS: write zeros on the rows past expert_offsets[E] (else leave them) */
  int32_t m;                    /* EXPERTS: output rows per expert */
  int32_t n;                    /* output columns (SWIGLU: of the activation, half of b's rows) */
  int32_t k;                    /* ROWS: reduction length */
  int32_t num_experts;
  int32_t num_sms;              /* persistent CTAs; 0: the device's SM count */
  const void* a;                /* bf16 */
  const void* b;                /* bf16 */
  int64_t num_rows;
  const int32_t* expert_offsets;  /* [num_experts + 1], multiples of PRIMEMOE_GEMM_ROW_ALIGN */
  const int32_t* expert_rows;     /* optional (EXPERTS): [num_experts] routed rows, to skip padding k-slices */
  void* out;
  void* out_h;                  /* SWIGLU, optional: [num_rows, 2n] pre-activations */
  const void* in_h;             /* SWIGLU_BACKWARD: [num_rows, 2n] */
  const float* row_weight;      /* ROWS + STORE optional, SWIGLU_BACKWARD required: [num_rows] fp32 */
  void* out_dh;                 /* SWIGLU_BACKWARD: [num_rows, 2n] bf16 */
  float* out_dot;               /* SWIGLU_BACKWARD: [num_rows, n / 256] fp32 */
  /* Optional wait before an expert's first rows are loaded: hook_counters[e] >= *hook_epoch * hook_per_epoch
   * (the expert-parallel runtime's arrival counters); NULL hook_counters: rows are in memory. */
  const uint64_t* hook_counters;
  const int64_t* hook_epoch;
  uint64_t hook_per_epoch;
  uint64_t hook_timeout_ns;
  int32_t hook_rank;
  /* Optional device int32 scratch: with it the launch may take the claimed tile order (this call zeroes it on
   * the stream); without it the static order is used (same results). */
  int32_t* tile_counter;
  primemoe_error_record* error; /* optional: the hook's timeouts */
} primemoe_grouped_gemm_args;

PRIMEMOE_CAPI primemoe_status primemoe_grouped_gemm(const primemoe_grouped_gemm_args* args, void* stream);
/* SUCCESS when the kernels cover these arguments on `device`, else NOT_SUPPORTED / INVALID_ARGUMENT with the
 * reason in primemoe_capi_last_error(). Reads device attributes (CUDA). */
PRIMEMOE_CAPI primemoe_status primemoe_grouped_gemm_supported(const primemoe_grouped_gemm_args* args, int32_t device);

/* ---- blockwise FP8 GEMM (gemm/fp8_gemm.cuh) ----------------------------------------------------------------- */

/* ROWS:    out[r, n] = row_weight[r] * sum_k a[r, k] sa[k/128, r] * b[e(r), n, k] sb[e(r), n/128, k/128]
 * EXPERTS: out[e, m, n] = sum over expert e's rows r of a_t[m, r] sa[r/128, m] * b_t[n, r] sb[r/128, n]
 * e4m3 operands K-major; n (and ROWS: k, EXPERTS: m and num_rows) multiples of 128; 16-byte aligned. */
typedef struct primemoe_fp8_gemm_args {
  uint32_t struct_size;
  int32_t schedule;             /* primemoe_gemm_schedule */
  int32_t out_dtype;            /* PRIMEMOE_DTYPE_BFLOAT16 or PRIMEMOE_DTYPE_FLOAT32 */
  int32_t m;
  int32_t n;
  int32_t k;
  int32_t num_experts;
  int32_t num_sms;              /* 0: the device's SM count */
  const void* a;
  const float* a_scale;         /* ROWS [k/128, num_rows]; EXPERTS [num_rows/128, m] */
  const void* b;
  const float* b_scale;         /* ROWS [E, n/128, k/128]; EXPERTS [num_rows/128, n] */
  int64_t num_rows;
  const int32_t* expert_offsets;  /* [num_experts + 1] */
  const int32_t* expert_rows;     /* optional (EXPERTS) */
  const float* row_weight;        /* optional (ROWS): [num_rows] */
  void* out;                      /* ROWS [num_rows, n]; EXPERTS [E, m, n] */
} primemoe_fp8_gemm_args;

PRIMEMOE_CAPI primemoe_status primemoe_fp8_gemm(const primemoe_fp8_gemm_args* args, void* stream);
PRIMEMOE_CAPI primemoe_status primemoe_fp8_gemm_supported(const primemoe_fp8_gemm_args* args, int32_t device);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif /* PRIMEMOE_CAPI_H_ */
