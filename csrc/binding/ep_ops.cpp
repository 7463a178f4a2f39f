// The expert-parallel runtime: NVSHMEM bootstrap, the symmetric workspace (its layout from
// runtime/ep_workspace.cuh), ep_dispatch and ep_combine.

#include <string>

#include "common.h"
#include "gemm/fp8_gemm.cuh"
#include "gemm/grouped_gemm.cuh"
#include "kernels/dispatch_layout.cuh"
#include "runtime/ep_kernels.cuh"
#include "runtime/ep_workspace.cuh"
#include "runtime/nvshmem_runtime.cuh"

namespace primemoe {
// The combine waits per block of the rows the GEMM publishes per warpgroup share.
static_assert(kEpResultBlockRows == kGemmRowAlign, "one result flag per 64-row block of the GEMM");
namespace {

Tensor nvshmem_unique_id_op() {
  auto id = torch::stable::empty({static_cast<int64_t>(nvshmem_unique_id_size())}, ScalarType::Byte, std::nullopt,
                                 torch::stable::Device(torch::headeronly::DeviceType::CPU));
  PRIMEMOE_CHECK(nvshmem_make_unique_id(id.data_ptr()) == 0, "nvshmem: could not create a unique id");
  return id;
}

void nvshmem_init_op(const Tensor& unique_id, int64_t rank, int64_t world) {
  PRIMEMOE_CHECK(unique_id.scalar_type() == ScalarType::Byte && unique_id.is_cpu() &&
                     unique_id.numel() == static_cast<int64_t>(nvshmem_unique_id_size()),
                 "unique_id: expected the uint8 CPU tensor made by _nvshmem_unique_id");
  PRIMEMOE_CHECK(world >= 1 && rank >= 0 && rank < world, "rank: expected 0 <= rank < world, got rank ", rank,
                 " of ", world);
  PRIMEMOE_CHECK(!nvshmem_is_initialized(), "nvshmem: already initialised in this process");
  const auto contiguous = torch::stable::contiguous(unique_id);
  const int status = nvshmem_bootstrap(contiguous.data_ptr(), static_cast<int>(rank), static_cast<int>(world));
  PRIMEMOE_CHECK(status == 0, "nvshmem: initialisation failed with status ", status, " on rank ", rank, " of ", world,
                 " (NVSHMEM_DEBUG=INFO shows why; without InfiniBand set NVSHMEM_REMOTE_TRANSPORT=none)");
}

bool nvshmem_initialized_op() { return nvshmem_is_initialized(); }

// Loads the kernels a Buffer's layer launches on the current device now, not at their first launch (CUDA's lazy
// loading makes that launch wait for the kernels running then, which may spin on peers). Best effort: a kernel with
// no image for this device is not one the layer launches here.
void preload_kernels_op() {
  (void)preload_ep_kernels();
  (void)preload_grouped_gemm_kernels();
  (void)preload_fp8_gemm_kernels();
  (void)cudaGetLastError();
}

void nvshmem_finalize_op() {
  if (nvshmem_is_initialized()) nvshmem_shutdown();
}

// Collective (a small symmetric allocation): whether some peer is not reachable by load/store from here.
bool nvshmem_peers_need_put_op() {
  PRIMEMOE_CHECK(nvshmem_is_initialized(), "nvshmem: call _nvshmem_init before probing the peers");
  const int status = nvshmem_peers_need_put();
  PRIMEMOE_CHECK(status >= 0, "nvshmem: could not allocate 16 bytes of symmetric memory to probe the peers");
  return status == 1;
}

EpConfig ep_config(int64_t rank, int64_t world, int64_t max_tokens, int64_t hidden, int64_t top_k,
                   int64_t local_experts, int64_t row_align, bool put_peers, bool force_put, int64_t recv_capacity) {
  PRIMEMOE_CHECK(world >= 1 && rank >= 0 && rank < world, "rank: expected 0 <= rank < world");
  PRIMEMOE_CHECK(max_tokens >= 1 && hidden >= 8 && hidden % 8 == 0 && top_k >= 1 && local_experts >= 1 &&
                     row_align >= 1,
                 "ep: expected positive sizes and a hidden size that is a multiple of 8");
  PRIMEMOE_CHECK(world * local_experts <= kLayoutMaxLocalExperts, "ep: at most ", kLayoutMaxLocalExperts,
                 " experts in all, got ", world * local_experts);
  PRIMEMOE_CHECK(put_peers || !force_put, "ep: force_put needs the put staging region (put_peers=True)");
  EpConfig c{static_cast<int32_t>(rank),       static_cast<int32_t>(world),  static_cast<int32_t>(max_tokens),
             static_cast<int32_t>(hidden),     static_cast<int32_t>(top_k),  static_cast<int32_t>(local_experts),
             static_cast<int32_t>(row_align),  put_peers,                    force_put,
             recv_capacity};
  // A rank's own slots always fit: the put staging region is indexed by send row and sized like the receive rows.
  PRIMEMOE_CHECK(recv_capacity == 0 || recv_capacity >= c.max_slots(), "max_recv_rows: expected 0 (the worst case) "
                 "or at least max_tokens * top_k = ", c.max_slots(), ", got ", recv_capacity);
  PRIMEMOE_CHECK(c.max_recv_rows() < (int64_t(1) << 31), "ep: max_tokens * top_k * world exceeds 32-bit row indices");
  return c;
}

// One line per region of ep_regions, "name element offset d0,d1,...", then "arrivals_per_epoch n" (what an expert's
// arrival counter gains per dispatch) and "total bytes": python/primemoe/buffer.py takes the typed views of the
// workspace and the GEMM wait hook's target from here.
std::string ep_workspace_layout_op(int64_t world, int64_t max_tokens, int64_t hidden, int64_t top_k,
                                   int64_t local_experts, int64_t row_align, bool put_peers, int64_t recv_capacity) {
  const auto regions = ep_regions(
      ep_config(0, world, max_tokens, hidden, top_k, local_experts, row_align, put_peers, false, recv_capacity));
  std::string out;
  for (const EpRegion& r : regions) {
    out += std::string(r.name) + " " + ep_element_name(r.type) + " " + std::to_string(r.offset) + " ";
    for (int32_t d = 0; d < r.dims; ++d) out += (d ? "," : "") + std::to_string(r.shape[d]);
    out += "\n";
  }
  out += "arrivals_per_epoch " + std::to_string(ep_arrivals_per_epoch(world)) + "\n";
  return out + "total " + std::to_string(ep_total_bytes(regions)) + "\n";
}

Tensor ep_workspace_alloc_op(int64_t nbytes) {
  PRIMEMOE_CHECK(nvshmem_is_initialized(), "nvshmem: call _nvshmem_init before allocating the workspace");
  PRIMEMOE_CHECK(nbytes > 0, "nbytes: expected > 0");
  void* ptr = nvshmem_alloc_symmetric(static_cast<size_t>(nbytes));
  PRIMEMOE_CHECK(ptr != nullptr, "nvshmem: could not allocate ", nbytes,
                 " bytes of symmetric memory (raise NVSHMEM_SYMMETRIC_SIZE)");
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaMemset(ptr, 0, static_cast<size_t>(nbytes)), "cudaMemset");
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  // The Buffer frees it collectively through _ep_workspace_free; the tensor never owns it.
  const torch::stable::Device cuda(torch::headeronly::DeviceType::CUDA, device);
  return torch::stable::from_blob(ptr, {nbytes}, {1}, cuda, ScalarType::Byte);
}

void ep_workspace_free_op(const Tensor& workspace) {
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  nvshmem_free_symmetric(workspace.data_ptr());
}

EpScratch ep_scratch(uint8_t* ws, const EpLayout& l, const EpConfig& c) {
  // The rows of the scratch region (ep_regions), in EpScratch's order.
  int32_t* base = reinterpret_cast<int32_t*>(ws + l.scratch);
  const int64_t row = ep_send_order_entries(c.world, c.local_experts) + 1;
  int32_t* pads = base + 5 * row;
  return {base, base + row, base + 2 * row, base + 3 * row, base + 4 * row, pads, pads + c.local_experts,
          reinterpret_cast<int32_t*>(ws + l.tile_counter)};
}

void check_workspace(const Tensor& ws, const Tensor& epoch, const EpConfig& c, const EpLayout& l) {
  PRIMEMOE_CHECK(ws.is_cuda() && ws.scalar_type() == ScalarType::Byte && ws.numel() >= static_cast<int64_t>(l.total),
                 "workspace: expected the Buffer's uint8 CUDA workspace of at least ", static_cast<int64_t>(l.total),
                 " bytes");
  PRIMEMOE_CHECK(nvshmem_is_initialized(), "nvshmem: not initialised (the workspace comes from a primemoe.Buffer)");
  // Without the staging region a peer that needs puts could not be written at all.
  PRIMEMOE_CHECK(c.put_peers || nvshmem_all_peers_mapped(ws.data_ptr()),
                 "workspace: not NVSHMEM symmetric memory, or some peer is not reachable by load/store and "
                 "put_peers is false");
  PRIMEMOE_CHECK(epoch.is_cuda() && epoch.scalar_type() == ScalarType::Long && epoch.numel() == 1,
                 "epoch: expected a 1-element int64 CUDA tensor");
}

std::tuple<Tensor, Tensor, Tensor> ep_dispatch_cuda(Tensor& workspace, Tensor& epoch, const Tensor& x,
                                                    const Tensor& topk_idx, const Tensor& topk_weights, int64_t rank,
                                                    int64_t world, int64_t max_tokens, int64_t local_experts,
                                                    int64_t row_align, int64_t num_sms, bool wait_arrivals,
                                                    bool put_peers, bool force_put, bool copy_rows,
                                                    int64_t recv_capacity) {
  check_rows(x, "x");
  const EpConfig c = ep_config(rank, world, max_tokens, x.size(1), topk_idx.size(1), local_experts, row_align,
                               put_peers, force_put, recv_capacity);
  const EpLayout l = ep_layout(c);
  check_workspace(workspace, epoch, c, l);
  PRIMEMOE_CHECK(x.size(0) <= max_tokens, "x: ", x.size(0), " tokens exceed the buffer's max_tokens_per_rank ",
                 max_tokens, " (nothing was sent: the other ranks' dispatch times out waiting for this rank and "
                 "reports it)");
  PRIMEMOE_CHECK(same_shape(topk_weights.sizes(), topk_idx.sizes()), "topk_weights: expected the shape of topk_idx");
  PRIMEMOE_CHECK(num_sms >= 1, "num_sms: expected >= 1");
  const int64_t experts = world * local_experts;
  auto slot_valid = empty_like_device(topk_idx, topk_idx.sizes(), ScalarType::Bool);
  // The send-side layout goes into the workspace: the rows kernel reads it while the GEMM after it runs, whose
  // outputs the caching allocator could otherwise place in these tensors' memory as soon as this call returns. Its
  // slot_to_row (-1 for the slots not routed) becomes combine_map, which the rows kernel completes.
  uint8_t* ws = data_of<uint8_t>(workspace);
  const LayoutInto send{reinterpret_cast<int32_t*>(ws + l.send_counts), reinterpret_cast<int32_t*>(ws + l.send_offsets),
                        reinterpret_cast<int32_t*>(ws + l.send_row_to_slot),
                        reinterpret_cast<int32_t*>(ws + l.combine_map)};
  launch_layout(topk_idx, experts, 0, experts, 1, data_of<bool>(slot_valid), &send);
  const DeviceGuard guard(x.get_device_index());
  auto expert_counts = empty_like_device(x, {local_experts}, ScalarType::Int);
  auto expert_offsets = empty_like_device(x, {local_experts + 1}, ScalarType::Int);
  EpDispatchArgs a{};
  a.cfg = c;
  a.layout = l;
  a.workspace = data_of<uint8_t>(workspace);
  a.epoch = data_of<int64_t>(epoch);
  a.x = x.data_ptr();
  a.topk_idx = topk_idx.data_ptr();
  a.idx_is_int64 = topk_idx.scalar_type() == ScalarType::Long;
  a.topk_weights = topk_weights.data_ptr();
  a.weight_type = scale_type_of(topk_weights, "topk_weights");
  a.num_tokens = x.size(0);
  a.send_counts = send.counts;
  a.send_offsets = send.offsets;
  a.send_row_to_slot = send.row_to_slot;
  a.scratch = ep_scratch(a.workspace, l, c);
  a.expert_counts = data_of<int32_t>(expert_counts);
  a.expert_offsets = data_of<int32_t>(expert_offsets);
  a.num_blocks = static_cast<int32_t>(num_sms);
  a.wait_arrivals = wait_arrivals;
  a.copy_rows = copy_rows;
  a.timeout_ns = wait_timeout_ns();
  a.error = error_record_for(x);
  check_cuda(launch_ep_dispatch(a, current_stream(x)), "ep_dispatch");
  return {expert_counts, expert_offsets, slot_valid};
}

void ep_combine_cuda(Tensor& workspace, Tensor& epoch, const Tensor& rows, const std::optional<Tensor>& row_scalars,
                     const Tensor& expert_offsets, int64_t rank, int64_t world, int64_t max_tokens, int64_t hidden,
                     int64_t top_k, int64_t local_experts, int64_t row_align, int64_t num_sms, bool put_peers,
                     bool force_put, bool published, bool send, bool wait, int64_t recv_capacity) {
  const EpConfig c = ep_config(rank, world, max_tokens, hidden, top_k, local_experts, row_align, put_peers,
                               force_put, recv_capacity);
  const EpLayout l = ep_layout(c);
  check_workspace(workspace, epoch, c, l);
  check_rows(rows, "rows");
  PRIMEMOE_CHECK(rows.size(0) >= c.max_recv_rows() && rows.size(1) == hidden, "rows: expected [",
                 c.max_recv_rows(), ", ", hidden, "] in the receive layout, got ", rows.sizes());
  check_index(expert_offsets, "expert_offsets", 1);
  PRIMEMOE_CHECK(expert_offsets.numel() == local_experts + 1, "expert_offsets: expected ", local_experts + 1,
                 " entries");
  if (row_scalars.has_value()) {
    PRIMEMOE_CHECK(row_scalars->scalar_type() == ScalarType::Float && row_scalars->is_contiguous() &&
                       row_scalars->numel() >= c.max_recv_rows(),
                   "row_scalars: expected a contiguous float32 tensor with one value per receive row");
  }
  PRIMEMOE_CHECK(num_sms >= 1, "num_sms: expected >= 1");
  const DeviceGuard guard(rows.get_device_index());
  EpCombineArgs a{};
  a.cfg = c;
  a.layout = l;
  a.workspace = data_of<uint8_t>(workspace);
  a.epoch = data_of<int64_t>(epoch);
  a.rows = rows.data_ptr();
  a.row_scalars = row_scalars.has_value() ? data_of<float>(*row_scalars) : nullptr;
  // published: `rows` comes from the GEMM launched just before, which publishes its row blocks in result_flags.
  a.result_flags = published ? reinterpret_cast<const uint64_t*>(a.workspace + l.result_flags) : nullptr;
  a.expert_offsets = data_of<int32_t>(expert_offsets);
  a.scratch = ep_scratch(a.workspace, l, c);
  a.num_blocks = static_cast<int32_t>(num_sms);
  a.timeout_ns = wait_timeout_ns();
  a.error = error_record_for(rows);
  check_cuda(launch_ep_combine(a, send, wait, current_stream(rows)), "ep_combine");
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(primemoe, CUDA, m) {
  m.impl("ep_dispatch", TORCH_BOX(&ep_dispatch_cuda));
  m.impl("ep_combine", TORCH_BOX(&ep_combine_cuda));
}

// Host-side ops (no kernel of their own): registered for every backend.
STABLE_TORCH_LIBRARY_IMPL(primemoe, CompositeImplicitAutograd, m) {
  m.impl("_nvshmem_unique_id", TORCH_BOX(&nvshmem_unique_id_op));
  m.impl("_nvshmem_init", TORCH_BOX(&nvshmem_init_op));
  m.impl("_nvshmem_finalize", TORCH_BOX(&nvshmem_finalize_op));
  m.impl("_nvshmem_initialized", TORCH_BOX(&nvshmem_initialized_op));
  m.impl("_preload_kernels", TORCH_BOX(&preload_kernels_op));
  m.impl("_nvshmem_peers_need_put", TORCH_BOX(&nvshmem_peers_need_put_op));
  m.impl("_ep_workspace_layout", TORCH_BOX(&ep_workspace_layout_op));
  m.impl("_ep_workspace_alloc", TORCH_BOX(&ep_workspace_alloc_op));
  m.impl("_ep_workspace_free", TORCH_BOX(&ep_workspace_free_op));
}

}  // namespace primemoe
