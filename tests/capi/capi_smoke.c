/* Smoke test of the installed C API on a machine without a GPU: the version, the status strings, the pure size
 * helpers, and argument validation, which must answer with a status before any CUDA call (no driver here).
 * Prints one line per check; exits 0 when all pass. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "primemoe_capi.h"

static int failures = 0;

static void check(int ok, const char* what) {
  printf("%s %s\n", ok ? "ok  " : "FAIL", what);
  if (!ok) ++failures;
}

/* A call that must return `want` and leave a message naming `needle`. */
static void expect(primemoe_status got, primemoe_status want, const char* needle, const char* what) {
  const char* msg = primemoe_capi_last_error();
  const int ok = got == want && (needle == NULL || strstr(msg, needle) != NULL);
  printf("%s %s -> %s | %s\n", ok ? "ok  " : "FAIL", what, primemoe_capi_status_string(got), msg);
  if (!ok) ++failures;
}

int main(void) {
  const uint32_t version = primemoe_capi_version();
  printf("primemoe_capi_version %u\n", (unsigned)version);
  printf("primemoe_capi_features %u\n", (unsigned)primemoe_capi_features());
  check(version == PRIMEMOE_CAPI_VERSION, "library version equals the header's");
  check(version / 10000 == PRIMEMOE_CAPI_VERSION_MAJOR, "major version matches");
  check(strncmp(primemoe_capi_status_string(PRIMEMOE_STATUS_INVALID_ARGUMENT), "PRIMEMOE_STATUS_INVALID_ARGUMENT",
                32) == 0, "status string");
  check(strstr(primemoe_capi_status_string((primemoe_status)99), "UNKNOWN") != NULL, "unknown status string");
  check(primemoe_capi_last_error()[0] == '\0', "no error before any failed call");

  /* Pure size helpers (the routing layout's buffers). */
  check(primemoe_dispatch_layout_max_rows(4096 * 8, 128, 64) == 4096 * 8 + 128 * 63, "layout max rows");
  check(primemoe_dispatch_layout_workspace_ints(4096 * 8, 128) > 0, "layout workspace ints");
  check(primemoe_dispatch_layout_max_rows(-1, 128, 64) == -1, "layout max rows rejects num_slots < 0");
  check(primemoe_dispatch_layout_workspace_ints(16, 0) == -1, "layout workspace rejects num_local = 0");

  /* Argument validation: every call below must fail before touching CUDA (the pointers are never read). */
  void* const fake = (void*)(uintptr_t)0x100000; /* 16-byte aligned, never dereferenced */
  void* const stream = NULL;

  expect(primemoe_quantize_1x128(NULL, stream), PRIMEMOE_STATUS_INVALID_ARGUMENT, "args", "quantize_1x128(NULL)");
  {
    primemoe_quantize_1x128_args q = PRIMEMOE_ARGS_INIT(primemoe_quantize_1x128_args);
    q.struct_size -= 8;
    expect(primemoe_quantize_1x128(&q, stream), PRIMEMOE_STATUS_VERSION_MISMATCH, "struct_size",
           "quantize_1x128 with a foreign struct_size");
    q.struct_size = sizeof q;
    q.x = fake;
    q.q = fake;
    q.scale = (float*)fake;
    q.rows = 256;
    q.cols = 100; /* not a multiple of 128 */
    expect(primemoe_quantize_1x128(&q, stream), PRIMEMOE_STATUS_INVALID_ARGUMENT, "cols", "quantize_1x128 cols=100");
    q.cols = 256;
    q.x = (const char*)fake + 8; /* misaligned */
    expect(primemoe_quantize_1x128(&q, stream), PRIMEMOE_STATUS_INVALID_ARGUMENT, "aligned",
           "quantize_1x128 misaligned x");
    q.x = fake;
    q.pow2 = 2;
    expect(primemoe_quantize_1x128(&q, stream), PRIMEMOE_STATUS_INVALID_ARGUMENT, "pow2", "quantize_1x128 pow2=2");
  }
  {
    primemoe_dispatch_layout_args l = PRIMEMOE_ARGS_INIT(primemoe_dispatch_layout_args);
    l.idx_dtype = PRIMEMOE_DTYPE_INT64;
    l.topk_idx = fake;
    l.num_slots = 64;
    l.top_k = 8;
    l.num_experts = 16;
    l.num_local = 0;
    l.row_align = 64;
    expect(primemoe_dispatch_layout(&l, stream), PRIMEMOE_STATUS_INVALID_ARGUMENT, "num_local",
           "dispatch_layout num_local=0");
    l.num_local = 16;
    expect(primemoe_dispatch_layout(&l, stream), PRIMEMOE_STATUS_INVALID_ARGUMENT, "expert_counts",
           "dispatch_layout without outputs");
  }
  {
    primemoe_gather_rows_args g = PRIMEMOE_ARGS_INIT(primemoe_gather_rows_args);
    g.src = fake;
    g.dst = fake;
    g.row_to_slot = (const int32_t*)fake;
    g.slot_to_row = (const int32_t*)fake;
    g.num_rows = 128;
    g.num_tokens = 16;
    g.hidden = 12; /* not a multiple of 8 */
    g.top_k = 2;
    expect(primemoe_gather_rows(&g, stream), PRIMEMOE_STATUS_INVALID_ARGUMENT, "hidden", "gather_rows hidden=12");
    primemoe_combine_args c = PRIMEMOE_ARGS_INIT(primemoe_combine_args);
    c.rows = fake;
    c.slot_to_row = (const int32_t*)fake;
    c.y = fake;
    c.num_tokens = 16;
    c.hidden = 64;
    c.top_k = 2;
    c.weight_dtype = 7;
    expect(primemoe_combine(&c, stream), PRIMEMOE_STATUS_INVALID_ARGUMENT, "weight_dtype", "combine weight_dtype=7");
  }
  {
    primemoe_grouped_gemm_args m = PRIMEMOE_ARGS_INIT(primemoe_grouped_gemm_args);
    m.schedule = PRIMEMOE_GEMM_ROWS;
    m.epilogue = PRIMEMOE_EPILOGUE_STORE;
    m.b_k_major = 1;
    m.a = fake;
    m.b = fake;
    m.out = fake;
    m.expert_offsets = (const int32_t*)fake;
    m.num_rows = 256;
    m.num_experts = 4;
    m.n = 100; /* not a multiple of the tile width */
    m.k = 128;
    expect(primemoe_grouped_gemm(&m, stream), PRIMEMOE_STATUS_INVALID_ARGUMENT, "n:", "grouped_gemm n=100");
    m.n = 256;
    m.epilogue = PRIMEMOE_EPILOGUE_SWIGLU_BACKWARD;
    expect(primemoe_grouped_gemm(&m, stream), PRIMEMOE_STATUS_INVALID_ARGUMENT, "in_h",
           "grouped_gemm SwiGLU backward without in_h");
  }
  {
    primemoe_fp8_gemm_args f = PRIMEMOE_ARGS_INIT(primemoe_fp8_gemm_args);
    f.schedule = PRIMEMOE_GEMM_ROWS;
    f.n = 256;
    f.k = 256;
    f.num_experts = 2;
    expect(primemoe_fp8_gemm(&f, stream), PRIMEMOE_STATUS_INVALID_ARGUMENT, "out_dtype", "fp8_gemm out_dtype unset");
  }
  check(primemoe_capi_last_cuda_error() == 0, "no CUDA error recorded");

  printf("%s: %d failure(s)\n", failures ? "FAILED" : "PASSED", failures);
  return failures ? 1 : 0;
}
