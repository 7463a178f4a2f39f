// Where the forward's row gather stands against the memory system's ceilings (it moves ~3 TB/s at Qwen3-235B
// T = 8192 against ~4.3 TB/s for a device copy; why is not known). Standalone, no torch: the layer's gather
// (csrc/kernels/row_ops.cu, compiled in: a token per warp, each x row read once and written to its K rows, padding
// rows zeroed after) against other ways to move the same bytes, timed with an L2 flush before every run. The rows
// are laid out by the layer's dispatch_layout kernel (compiled in as well) from uniform top-K routing:
//   gather   the layer's gather_rows
//   rows     a destination row per warp, rows in order: sequential writes, each x row read K times (checked against
//            gather bit for bit, after a poisoned start)
//   memset   the destination bytes written by cudaMemsetAsync: the write-only ceiling
//   copy     x copied to K contiguous replicas: the same bytes read and written, all sequential
// On the GPU machine (scripts/gpu_run.sh gatherbench):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I csrc -o /tmp/gather_bench scripts/gather_bench.cu
//   /tmp/gather_bench
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/dispatch_layout.cu"
#include "kernels/row_ops.cu"

#define CHECK(call)                                                                   \
  do {                                                                                \
    cudaError_t e_ = (call);                                                          \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

constexpr int kThreads = 256;
constexpr int kUnroll = 8;  // 16-byte vectors per lane in flight

struct Problem {
  const uint4* x;          // [T, vecs]
  uint4* dst;              // [R, vecs]
  const int32_t* slot_to_row;  // [T * K]
  const int32_t* row_to_slot;  // [R], -1: padding
  int64_t tokens, rows;
  int vecs, top_k;
};

__device__ __forceinline__ int64_t warp_id() { return (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; }
__device__ __forceinline__ int64_t warp_count() { return int64_t(gridDim.x) * blockDim.x / 32; }

__global__ void __launch_bounds__(kThreads, 4) gather_by_row(Problem p) {
  const int lane = threadIdx.x % 32;
  for (int64_t r = warp_id(); r < p.rows; r += warp_count()) {
    const int32_t slot = p.row_to_slot[r];
    const uint4* src = slot >= 0 ? p.x + int64_t(slot / p.top_k) * p.vecs : nullptr;
    uint4* out = p.dst + r * p.vecs;
    for (int base = 0; base < p.vecs; base += 32 * kUnroll) {
      uint4 buf[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = base + 32 * u + lane;
        buf[u] = src != nullptr && v < p.vecs ? __ldg(src + v) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = base + 32 * u + lane;
        if (v < p.vecs) out[v] = buf[u];
      }
    }
  }
}

__global__ void copy_replicas(const uint4* x, uint4* dst, int64_t n, int replicas) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldg(x + i);
    for (int k = 0; k < replicas; ++k) dst[k * n + i] = v;
  }
}

__global__ void count_mismatches(const uint4* a, const uint4* b, int64_t n, unsigned long long* bad) {
  unsigned long long local = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 u = a[i], v = b[i];
    local += u.x != v.x || u.y != v.y || u.z != v.z || u.w != v.w;
  }
  if (local) atomicAdd(bad, local);
}

struct Shape {
  const char* name;
  int hidden, experts, top_k;
  int64_t tokens;
};

// Routing as the benchmark's inputs make it: K distinct experts per token, uniformly.
std::vector<int32_t> route(const Shape& s) {
  uint64_t state = 0x9e3779b97f4a7c15ull;
  auto next = [&state] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  std::vector<int32_t> expert_of(s.tokens * s.top_k);
  std::vector<int> perm(s.experts);
  for (int64_t t = 0; t < s.tokens; ++t) {
    for (int e = 0; e < s.experts; ++e) perm[e] = e;
    for (int k = 0; k < s.top_k; ++k) {
      const int j = k + int(next() % uint64_t(s.experts - k));
      std::swap(perm[k], perm[j]);
      expert_of[t * s.top_k + k] = perm[k];
    }
  }
  return expert_of;
}

int main() {
  const Shape shapes[] = {{"qwen3-235b-a22b", 4096, 128, 8, 8192}, {"qwen3-30b-a3b", 2048, 128, 8, 16384}};
  const size_t flush_bytes = size_t(256) << 20;
  void* flush = nullptr;
  CHECK(cudaMalloc(&flush, flush_bytes));
  unsigned long long* bad = nullptr;
  CHECK(cudaMalloc(&bad, sizeof(*bad)));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  // GB: the bytes a gather must move at least (x read once, its rows written); rows reads x K times.
  std::printf("%-16s %6s %-9s %9s %9s %8s  %s\n", "shape", "T", "variant", "ms", "GB", "TB/s", "check");
  for (const Shape& s : shapes) {
    // The layer's layout kernel (dispatch_layout, row alignment 64): rows of each expert in slot order.
    const std::vector<int32_t> ids = route(s);
    const int64_t slots = int64_t(ids.size());
    const int64_t max_rows = primemoe::layout_max_rows(slots, s.experts, 64);
    int32_t *ids_dev, *counts, *offsets, *s2r, *r2s, *workspace;
    primemoe::ErrorRecord* error;
    CHECK(cudaMalloc(&ids_dev, slots * 4));
    CHECK(cudaMalloc(&counts, s.experts * 4));
    CHECK(cudaMalloc(&offsets, (s.experts + 1) * 4));
    CHECK(cudaMalloc(&s2r, slots * 4));
    CHECK(cudaMalloc(&r2s, max_rows * 4));
    CHECK(cudaMalloc(&workspace, primemoe::layout_workspace_ints(slots, s.experts) * 4));
    CHECK(cudaMalloc(&error, sizeof(primemoe::ErrorRecord)));
    CHECK(cudaMemset(error, 0, sizeof(primemoe::ErrorRecord)));
    CHECK(cudaMemcpy(ids_dev, ids.data(), slots * 4, cudaMemcpyHostToDevice));
    primemoe::DispatchLayoutArgs layout{ids_dev, false, slots, s.top_k, s.experts, 0, s.experts, 64, counts, offsets,
                                        s2r, r2s, nullptr, workspace, error};
    CHECK(primemoe::launch_dispatch_layout(layout, nullptr));
    int32_t routed_rows = 0;
    CHECK(cudaMemcpy(&routed_rows, offsets + s.experts, 4, cudaMemcpyDeviceToHost));
    const int vecs = s.hidden / 8;
    const int64_t rows = routed_rows;
    const size_t x_bytes = size_t(s.tokens) * s.hidden * 2, dst_bytes = size_t(rows) * s.hidden * 2;
    const size_t replica_bytes = x_bytes * s.top_k;
    std::vector<uint16_t> x_host(size_t(s.tokens) * s.hidden);
    uint64_t st = 12345;
    for (auto& v : x_host) {
      st = st * 6364136223846793005ull + 1442695040888963407ull;
      v = uint16_t(0x3c00 | ((st >> 33) & 0x3ff)) ^ uint16_t((st >> 50) & 0x8000);  // finite, never zero
    }
    uint4 *x, *dst, *ref, *replicas;
    CHECK(cudaMalloc(&x, x_bytes));
    CHECK(cudaMalloc(&dst, dst_bytes));
    CHECK(cudaMalloc(&ref, dst_bytes));
    CHECK(cudaMalloc(&replicas, replica_bytes));
    CHECK(cudaMemcpy(x, x_host.data(), x_bytes, cudaMemcpyHostToDevice));
    Problem p{x, dst, s2r, r2s, s.tokens, rows, vecs, s.top_k};
    primemoe::GatherRowsArgs g{};
    g.src = x;
    g.row_to_slot = r2s;
    g.slot_to_row = s2r;
    g.scale_type = primemoe::ScaleType::kNone;
    g.num_rows = rows;
    g.num_tokens = s.tokens;
    g.hidden = s.hidden;
    g.top_k = s.top_k;
    g.dst = ref;
    CHECK(cudaMemset(ref, 0xff, dst_bytes));
    CHECK(primemoe::launch_gather_rows(g, nullptr));
    CHECK(cudaDeviceSynchronize());
    g.dst = dst;
    const int row_grid = sms * 4;
    struct Variant {
      const char* name;
      size_t bytes;  // read + written
      bool checked;
    };
    const size_t gather_bytes = x_bytes + dst_bytes;
    const Variant variants[] = {{"gather", gather_bytes, false},
                                {"rows", gather_bytes, true},
                                {"memset", dst_bytes, false},
                                {"copy", x_bytes + replica_bytes, false}};
    for (int vi = 0; vi < 4; ++vi) {
      const Variant& v = variants[vi];
      auto run = [&] {
        switch (vi) {
          case 0: CHECK(primemoe::launch_gather_rows(g, nullptr)); break;
          case 1: gather_by_row<<<row_grid, kThreads>>>(p); break;
          case 2: CHECK(cudaMemsetAsync(dst, 0, dst_bytes)); break;
          default: copy_replicas<<<sms * 8, kThreads>>>(x, replicas, int64_t(x_bytes / 16), s.top_k); break;
        }
      };
      std::vector<float> ms;
      for (int it = 0; it < 23; ++it) {
        if (v.checked && it == 0) CHECK(cudaMemset(dst, 0xff, dst_bytes));  // poison: every byte must be written
        CHECK(cudaMemsetAsync(flush, it, flush_bytes));
        CHECK(cudaEventRecord(start));
        run();
        CHECK(cudaEventRecord(stop));
        CHECK(cudaEventSynchronize(stop));
        CHECK(cudaGetLastError());
        float t = 0;
        CHECK(cudaEventElapsedTime(&t, start, stop));
        if (it >= 3) ms.push_back(t);
      }
      std::sort(ms.begin(), ms.end());
      const float med = ms[ms.size() / 2];
      const char* check = "-";
      if (v.checked) {
        CHECK(cudaMemset(bad, 0, sizeof(*bad)));
        count_mismatches<<<sms * 8, kThreads>>>(dst, ref, int64_t(dst_bytes / 16), bad);
        unsigned long long n = 0;
        CHECK(cudaMemcpy(&n, bad, sizeof(n), cudaMemcpyDeviceToHost));
        check = n == 0 ? "same bits" : "MISMATCH";
      }
      std::printf("%-16s %6lld %-9s %9.4f %9.3f %8.2f  %s\n", s.name, static_cast<long long>(s.tokens), v.name, med,
                  v.bytes / 1e9, v.bytes / 1e9 / med, check);
    }
    CHECK(cudaFree(x));
    CHECK(cudaFree(dst));
    CHECK(cudaFree(ref));
    CHECK(cudaFree(replicas));
    for (void* ptr : {static_cast<void*>(ids_dev), static_cast<void*>(counts), static_cast<void*>(offsets),
                      static_cast<void*>(s2r), static_cast<void*>(r2s), static_cast<void*>(workspace),
                      static_cast<void*>(error)}) {
      CHECK(cudaFree(ptr));
    }
  }
  return 0;
}
