// Every schema of torch.ops.primemoe. The CUDA and host-side implementations register from one file per area
// (layout_ops, rows_ops, gemm_ops, quant_ops, ep_ops, error_ops); the primitives' CPU kernels
// (python/primemoe/_cpu.py, _quant_ops.py), the layer's ops and the fake kernels from python/primemoe/. Ops named
// with a leading underscore are internal.
//
// Stable ABI (see common.h): the schemas register through STABLE_TORCH_LIBRARY, and the module is built against
// Python's limited API (Py_LIMITED_API, 3.10), so one wheel serves every CPython >= 3.10 and torch >= 2.10.
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030A0000
#endif
#include <Python.h>
#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY(primemoe, m) {
  // ---------------------------------------------------------------- the layer
  m.def(
      "moe_forward(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor w1, Tensor w2, str precision=\"bf16\", "
      "bool keep_fc1=True) -> (Tensor y, Tensor fc1_out)");
  m.def(
      "moe_backward(Tensor dy, Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor w1, Tensor w2, "
      "Tensor? fc1_out, str precision=\"bf16\", Tensor(a!)? w1_main_grad=None, Tensor(b!)? w2_main_grad=None) -> "
      "(Tensor dx, Tensor d_topk_weights, Tensor dw1, Tensor dw2)");
  // The layer over a Buffer (implemented in python/primemoe/layer.py): `buffer` is the Buffer's handle.
  m.def(
      "_ep_moe_forward(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor w1, Tensor w2, int buffer, "
      "str precision=\"bf16\", bool keep_fc1=True, bool save_rows=True) -> (Tensor, Tensor, Tensor)");
  m.def(
      "_ep_moe_backward(Tensor dy, Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor w1, Tensor w2, "
      "Tensor? fc1_out, Tensor saved_rows, int buffer, str precision=\"bf16\", Tensor(a!)? w1_main_grad=None, "
      "Tensor(b!)? w2_main_grad=None) -> (Tensor, Tensor, Tensor, Tensor)");

  // ---------------------------------------------------------------- layout (layout_ops.cpp)
  m.def(
      "dispatch_layout(Tensor topk_idx, int num_experts, int expert_begin, int num_local_experts, int row_align) "
      "-> (Tensor expert_counts, Tensor expert_offsets, Tensor slot_to_row, Tensor row_to_slot)");
  // Rows of dispatch_layout's row_to_slot for these sizes.
  m.def("_layout_max_rows(int num_slots, int local_experts, int row_align) -> int");
  // A size of the C++ layer by name (gemm_row_align, gemm_tile_n, gemm_swiglu_tile_n, layout_max_local_experts).
  m.def("_constant(str name) -> int");
  // The expert GEMMs' SM budget (primemoe.set_num_sms / get_num_sms): 0 = every SM.
  m.def("_set_num_sms(int n) -> ()");
  m.def("_num_sms_budget() -> int");

  // ---------------------------------------------------------------- rows (rows_ops.cpp)
  m.def(
      "gather_rows(Tensor src, Tensor row_to_slot, int top_k, Tensor? scale, Tensor? slot_to_row=None, "
      "Tensor? expert_offsets=None) -> Tensor");
  // slot_to_row: r >= 0 a row of rows, -1 none, r <= -2 row -2 - r of local_rows.
  m.def("combine_reduce(Tensor rows, Tensor slot_to_row, Tensor? weights, Tensor? local_rows=None) -> Tensor");
  m.def("slot_dot(Tensor a, Tensor b, Tensor slot_to_row) -> Tensor");
  // out[i] = values[index[i]] in fp32, 0 where index[i] is not an index of values.
  m.def("gather_scalars(Tensor values, Tensor index) -> Tensor");
  m.def("copy_routed_rows(Tensor rows, Tensor expert_offsets) -> Tensor");
  m.def("zero_unrouted_rows(Tensor(a!) rows, Tensor expert_offsets) -> ()");

  // ---------------------------------------------------------------- expert GEMMs (gemm_ops.cpp)
  // zero_unrouted=False: output rows at or past expert_offsets[-1] are left unwritten (undefined), for
  // callers that read only the routed rows.
  m.def(
      "expert_gemm(Tensor rows, Tensor w, Tensor expert_offsets, bool w_kn, Tensor? row_weight=None, "
      "bool zero_unrouted=True, Tensor(f!)? done_flags=None, Tensor(c!)? done_counts=None, Tensor? done_epoch=None, "
      "int done_sms=0) -> Tensor");
  m.def(
      "fc1_swiglu(Tensor rows, Tensor w1, Tensor expert_offsets, bool keep_fc1, Tensor? rows_ready=None, "
      "Tensor? epoch=None, int per_epoch=1, int rank=0, bool zero_unrouted=True, Tensor(t!)? tile_counter=None, "
      "int overlap_sms=0) -> (Tensor a, Tensor h)");
  m.def(
      "fc2_dgrad_swiglu(Tensor dy_rows, Tensor w2, Tensor h, Tensor row_weight, Tensor expert_offsets, "
      "bool zero_unrouted=True, Tensor? rows_ready=None, Tensor? epoch=None, int per_epoch=1, int rank=0, "
      "int overlap_sms=0) -> (Tensor dh, Tensor aw, Tensor dot)");
  // expert_rows: the layout's routed rows per expert, so that k-slices of padding are skipped (the same
  // result: the layout's padding rows are zeros).
  m.def("expert_wgrad(Tensor a_rows, Tensor b_rows, Tensor expert_offsets, Tensor? expert_rows=None) -> Tensor");
  m.def(
      "expert_wgrad_accumulate(Tensor a_rows, Tensor b_rows, Tensor expert_offsets, Tensor? expert_rows, "
      "Tensor(a!) main_grad) -> ()");
  m.def("expert_gemm_unsupported(int device, int hidden, int intermediate) -> str");
  // Tests only: the GemmConfig of this thread's next GEMM launches (0 or 1 each); -1, -1: the heuristics'.
  m.def("_gemm_force_config(int claim_tiles=-1, int merge_tails=-1) -> ()");

  // ---------------------------------------------------------------- expert parallelism (ep_ops.cpp)
  m.def("_nvshmem_unique_id() -> Tensor");
  m.def("_nvshmem_init(Tensor unique_id, int rank, int world) -> ()");
  m.def("_nvshmem_finalize() -> ()");
  m.def("_nvshmem_initialized() -> bool");
  m.def("_preload_kernels() -> ()");
  m.def("_nvshmem_peers_need_put() -> bool");
  // One line per region, "name element byte_offset d0,d1,...", then "total bytes".
  m.def(
      "_ep_workspace_layout(int world, int max_tokens, int hidden, int top_k, int local_experts, int row_align, "
      "bool put_peers, int recv_capacity=0) -> str");
  m.def("_ep_workspace_alloc(int nbytes) -> Tensor");
  m.def("_ep_workspace_free(Tensor workspace) -> ()");
  m.def(
      "ep_dispatch(Tensor(a!) workspace, Tensor(b!) epoch, Tensor x, Tensor topk_idx, Tensor topk_weights, int rank, "
      "int world, int max_tokens, int local_experts, int row_align, int num_sms, bool wait_arrivals=True, "
      "bool put_peers=False, bool force_put=False, bool copy_rows=True, int recv_capacity=0) -> "
      "(Tensor expert_counts, Tensor expert_offsets, Tensor slot_valid)");
  m.def(
      "ep_combine(Tensor(a!) workspace, Tensor(b!) epoch, Tensor rows, Tensor? row_scalars, Tensor expert_offsets, "
      "int rank, int world, int max_tokens, int hidden, int top_k, int local_experts, int row_align, int num_sms, "
      "bool put_peers=False, bool force_put=False, bool published=False, bool send=True, bool wait=True, "
      "int recv_capacity=0) -> ()");

  // ---------------------------------------------------------------- FP8 quantisation (quant_ops.cpp)
  // Blockwise E4M3, one fp32 dequantisation scale per tile (python/primemoe/fp8.py; pow2: scales rounded up to
  // powers of two): 1x128 tiles along K, x [M, K] -> (q [M, K], s [M, K/128]); 128x1 tiles along M, output
  // transposed, x [M, K] -> (q_t [K, M], s [K, M/128]); 128x128 blocks, w [..., N, K] -> (q, s [..., N/128, K/128]).
  // scale_mn_major: s transposed ([K/128, M] for 1x128, [M/128, K] for 128x1: the layout the FP8 GEMMs load);
  // expert_offsets: rows at or past expert_offsets[-1] (128x1: row tiles past it) are left unwritten.
  m.def(
      "quantize_fp8_1x128(Tensor x, bool pow2=True, bool scale_mn_major=False, Tensor? expert_offsets=None) "
      "-> (Tensor, Tensor)");
  m.def(
      "quantize_fp8_128x1(Tensor x, bool pow2=True, bool scale_mn_major=False, Tensor? expert_offsets=None) "
      "-> (Tensor, Tensor)");
  m.def("quantize_fp8_128x128(Tensor w, bool pow2=True) -> (Tensor, Tensor)");
  // FC1's epilogue in FP8 (reference.moe_fp8, steps 3-4): h [R, 2I] bf16 -> a = bf16(silu(g) * u) quantised 1x128
  // along I: (a_q [R, I] e4m3, a_scale [I/128, R] fp32, MN-major). Rows at or past expert_offsets[-1] unwritten.
  m.def("fp8_swiglu_quant(Tensor h, Tensor expert_offsets, bool pow2=True) -> (Tensor a_q, Tensor a_scale)");
  // FC2 dgrad's epilogue in FP8 (steps 9-11): da [R, I] fp32 (unweighted), h [R, 2I] bf16, row_weight [R] fp32 ->
  // dh [R, 2I] bf16, dh quantised 1x128 (dh_q e4m3, dh_scale [2I/128, R] MN-major), aw = bf16(w * a) [R, I],
  // dot [R] fp32 = <da, a>. Rows at or past expert_offsets[-1] unwritten.
  m.def(
      "fp8_swiglu_backward(Tensor da, Tensor h, Tensor row_weight, Tensor expert_offsets, bool pow2=True) -> "
      "(Tensor dh, Tensor dh_q, Tensor dh_scale, Tensor aw, Tensor dot)");

  // ---------------------------------------------------------------- FP8 expert GEMMs (fp8_gemm_ops.cpp)
  // Blockwise-scaled e4m3 GEMMs, fp32 accumulation promoted per 128-deep K block. Rows: a [R, K] e4m3 with
  // a_scale [K/128, R] (1x128 tiles, MN-major), b [E, N, K] e4m3 with b_scale [E, N/128, K/128] (128x128 blocks):
  // out[r] = row_weight[r] * (a[r] x b[e(r)]^T), bf16 (or fp32) [R, N]; rows at or past expert_offsets[-1]
  // unwritten (the layer's offsets are multiples of 128; any others work, their partial blocks slower).
  m.def(
      "fp8_expert_gemm(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, Tensor expert_offsets, "
      "Tensor? row_weight=None, bool out_fp32=False) -> Tensor");
  // Weight gradients: a_t [M, R] e4m3 with a_scale [R/128, M], b_t [N, R] with b_scale [R/128, N] (128x1 tiles
  // along the rows, transposed, MN-major scales): out[e] = sum over expert e's rows r of a[r]^T b[r], [E, M, N]
  // fp32 (or bf16); expert_offsets multiples of 128 (the scales' row blocks); expert_rows: routed rows per expert
  // (the 128-row tiles past them are skipped: zeros).
  m.def(
      "fp8_expert_wgrad(Tensor a_t, Tensor a_scale, Tensor b_t, Tensor b_scale, Tensor expert_offsets, "
      "Tensor? expert_rows=None, bool out_fp32=True) -> Tensor");
  // main_grad [E, M, N] fp32 += what fp8_expert_wgrad returns in fp32 (gradient-accumulation fusion).
  m.def(
      "fp8_expert_wgrad_accumulate(Tensor a_t, Tensor a_scale, Tensor b_t, Tensor b_scale, Tensor expert_offsets, "
      "Tensor? expert_rows, Tensor(a!) main_grad) -> ()");

  // ---------------------------------------------------------------- argument checks (common.cpp)
  // The argument check of `op`'s CUDA impl, run by its CPU kernel (python/primemoe/_cpu.py): the op's tensor
  // arguments, then its int and bool arguments, in schema order.
  m.def("_check_args(str op, Tensor?[] tensors, int[] ints) -> ()");

  // ---------------------------------------------------------------- device errors (error_ops.cpp)
  m.def("_take_error(int device) -> int[]");
  m.def("_describe_error(int[] record) -> str");
}

// Importing primemoe._C loads this library, whose static initialisers register the ops: the module itself is empty
// (limited API only: PyModule_Create is PyModule_Create2 with the stable ABI's version there).
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
