// Where a forward GEMM's time goes, tile by tile: the engine's FC1 or FC2 on the benchmark's routing layout
// (uniform top-K, each expert padded to 64 rows), built with -DPRIMEMOE_GEMM_TILE_TRACE so that consumer thread 0
// of every CTA stamps each tile (grouped_gemm.cuh, kTileTraceFields). Prints, per tile height (128, a 192-row
// merged tile, a 64-row half, a tile with no k-slice), the medians of: taken -> first k-slice landed (for a
// merged tile split at the moment its staging boxes were free), the mainloop, and mainloop end -> next tile
// taken (epilogue and handoff); then the span of the launch and how long SMs wait at its start and end; for FC1,
// the medians of warpgroup 0's activation jobs: posted -> started -> h stored -> activation written -> boxes free.
// The GPU is kept busy with untraced launches for --secs first, so that the traced one runs power-capped as the
// benchmark's do. No torch: scripts/gpu_run.sh tiletrace builds it with the engine's host and instantiation files.
//   tile_trace [--shape 235b|30b] [--tokens T] [--gemm fc1|fc2] [--merge auto|0|1 ...] [--secs S] [--csv FILE]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gemm/grouped_gemm.cuh"

#ifndef PRIMEMOE_GEMM_TILE_TRACE
#error "build with -DPRIMEMOE_GEMM_TILE_TRACE"
#endif

using namespace primemoe;

#define CHECK(x)                                                                                          \
  do {                                                                                                    \
    const cudaError_t err_ = (x);                                                                         \
    if (err_ != cudaSuccess) {                                                                            \
      std::fprintf(stderr, "%s: %s (line %d)\n", #x, cudaGetErrorString(err_), __LINE__);                 \
      std::exit(1);                                                                                       \
    }                                                                                                     \
  } while (0)

// Uniform values in [-scale, scale) from a hash of the index: never zeros, no host copy.
__global__ void fill_random(__nv_bfloat16* p, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t z = (seed ^ 0x2545F4914F6CDD1Dull) + uint64_t(i) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    p[i] = __float2bfloat16((float(z >> 40) * (2.0f / 16777216.0f) - 1.0f) * scale);
  }
}

struct Options {
  int64_t hidden = 4096, inter = 1536, experts = 128, top_k = 8, tokens = 8192;
  bool fc1 = true;
  std::vector<std::string> merges{"auto"};
  double secs = 1.0;
  std::string csv;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--shape") {
      const std::string s = value();
      if (s == "30b") {
        o.hidden = 2048;
        o.inter = 768;
      } else if (s != "235b") {
        std::fprintf(stderr, "--shape: 235b or 30b\n");
        std::exit(2);
      }
    } else if (a == "--tokens") {
      o.tokens = std::atoll(value().c_str());
    } else if (a == "--gemm") {
      const std::string g = value();
      if (g != "fc1" && g != "fc2") {
        std::fprintf(stderr, "--gemm: fc1 or fc2\n");
        std::exit(2);
      }
      o.fc1 = g == "fc1";
    } else if (a == "--merge") {
      o.merges.clear();
      while (i + 1 < argc && argv[i + 1][0] != '-') o.merges.push_back(argv[++i]);
    } else if (a == "--secs") {
      o.secs = std::atof(value().c_str());
    } else if (a == "--csv") {
      o.csv = value();
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      std::exit(2);
    }
  }
  if (o.tokens <= 0 || o.merges.empty()) {
    std::fprintf(stderr, "--tokens > 0 and at least one --merge value\n");
    std::exit(2);
  }
  return o;
}

struct Stamp {
  uint32_t index, rows, sm;
  uint64_t taken, boxes, first, main, end;  // end: the next tile taken
};

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// FC1's activation jobs (warpgroup 0's, every CTA): medians of posted -> started -> h stored -> activation
// written -> boxes free, and of the whole.
void summarise_jobs(const std::vector<uint64_t>& words, int ctas) {
  std::vector<double> phase[5];
  for (int c = 0; c < ctas; ++c) {
    const uint64_t* j = words.data() + size_t(c) * kTileTraceCtaWords + kTileTraceTiles * kTileTraceFields;
    for (int n = 0; n < kTileTraceJobs && j[n * kTileTraceJobFields + 4] != 0; ++n) {
      const uint64_t* f = j + n * kTileTraceJobFields;
      for (int p = 1; p <= 4; ++p) {
        if (f[p - 1] != 0) phase[p - 1].push_back((f[p] - f[p - 1]) * 1e-3);
      }
      if (f[0] != 0) phase[4].push_back((f[4] - f[0]) * 1e-3);
    }
  }
  if (phase[1].empty()) return;
  std::printf("  activation jobs (warpgroup 0): %zu; medians, us: posted -> started %.2f, h stored %.2f, activation"
              " %.2f, its store %.2f; posted -> boxes free %.2f\n", phase[1].size(), median(phase[0]),
              median(phase[1]), median(phase[2]), median(phase[3]), median(phase[4]));
}

void summarise(const std::vector<std::vector<Stamp>>& ctas, float launch_ms) {
  uint64_t t0 = ~0ull, t1 = 0;
  for (const auto& c : ctas) {
    if (c.empty()) continue;
    t0 = std::min(t0, c.front().taken);
    t1 = std::max(t1, c.back().end);
  }
  struct Class {
    const char* name;
    std::vector<double> wait, boxes, main, epilogue, total;
  } classes[4] = {{"128 rows"}, {"192 merged"}, {"64 half"}, {"no k-slice"}};
  std::vector<double> start_idle, end_idle;
  for (const auto& c : ctas) {
    if (c.empty()) continue;
    start_idle.push_back((c.front().taken - t0) * 1e-3);
    end_idle.push_back((t1 - c.back().end) * 1e-3);
    for (const Stamp& s : c) {
      Class& k = s.first == 0 ? classes[3] : s.rows > 128 ? classes[1] : s.rows == 128 ? classes[0] : classes[2];
      k.total.push_back((s.end - s.taken) * 1e-3);
      if (s.first == 0) continue;
      if (s.boxes != 0) {
        k.boxes.push_back((s.boxes - s.taken) * 1e-3);
        k.wait.push_back((s.first - s.boxes) * 1e-3);
      } else {
        k.wait.push_back((s.first - s.taken) * 1e-3);
      }
      k.main.push_back((s.main - s.first) * 1e-3);
      k.epilogue.push_back((s.end - s.main) * 1e-3);
    }
  }
  std::printf("  launch %.3f ms (events); traced span %.1f us over %zu CTAs\n", launch_ms, (t1 - t0) * 1e-3,
              start_idle.size());
  std::printf("  %-11s %6s %9s %9s %9s %9s %9s %9s   (medians, us)\n", "tile", "count", "boxes", "wait", "main",
              "epilogue", "total", "sum ms");
  for (const Class& k : classes) {
    if (k.total.empty()) continue;
    double sum = 0.0;
    for (double v : k.total) sum += v;
    std::printf("  %-11s %6zu %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f\n", k.name, k.total.size(), median(k.boxes),
                median(k.wait), median(k.main), median(k.epilogue), median(k.total), sum * 1e-3);
  }
  double start_sum = 0.0, end_sum = 0.0;
  for (double v : start_idle) start_sum += v;
  for (double v : end_idle) end_sum += v;
  std::printf("  SMs idle before their first tile: mean %.2f us, max %.2f; after their last: mean %.2f us, max %.2f\n",
              start_sum / start_idle.size(), *std::max_element(start_idle.begin(), start_idle.end()),
              end_sum / end_idle.size(), *std::max_element(end_idle.begin(), end_idle.end()));
}

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  int device = 0, sms = 0;
  CHECK(cudaGetDevice(&device));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t E = o.experts, K = o.top_k, T = o.tokens;

  // The layout: each token's K experts uniformly at random without repeats (the benchmark's route() of normal
  // logits picks a uniform K-subset too), each expert's rows padded to kGemmRowAlign, rows allocated as the layer
  // does (T K + E (align - 1)), so that the launch also zeroes the rows past the routed ones.
  std::mt19937_64 gen(1234);
  std::vector<int32_t> counts(E, 0), ids(E);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) ids[e] = int32_t(e);
    for (int64_t k = 0; k < K; ++k) {
      std::uniform_int_distribution<int64_t> pick(k, E - 1);
      std::swap(ids[k], ids[pick(gen)]);
      ++counts[ids[k]];
    }
  }
  std::vector<int32_t> offsets(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) {
    offsets[e + 1] = offsets[e] + (counts[e] + kGemmRowAlign - 1) / kGemmRowAlign * kGemmRowAlign;
  }
  const int64_t rows = T * K + E * (kGemmRowAlign - 1);
  const int64_t n = o.fc1 ? o.inter : o.hidden;      // output columns (FC1: of the activation)
  const int64_t k = o.fc1 ? o.hidden : o.inter;      // reduction
  const int64_t b_rows = o.fc1 ? 2 * o.inter : o.hidden;
  std::printf("%s, H %lld I %lld E %lld K %lld, T %lld: %d routed + padded rows of %lld allocated, %d SMs\n",
              o.fc1 ? "FC1" : "FC2", (long long)o.hidden, (long long)o.inter, (long long)E, (long long)K,
              (long long)T, offsets[E], (long long)rows, sms);

  __nv_bfloat16 *a = nullptr, *b = nullptr, *out = nullptr, *out_h = nullptr;
  float* row_weight = nullptr;
  int32_t *d_offsets = nullptr, *counter = nullptr;
  uint64_t* trace = nullptr;
  CHECK(cudaMalloc(&a, rows * k * 2));
  CHECK(cudaMalloc(&b, E * b_rows * k * 2));
  CHECK(cudaMalloc(&out, rows * n * 2));
  if (o.fc1) CHECK(cudaMalloc(&out_h, rows * 2 * n * 2));
  CHECK(cudaMalloc(&d_offsets, (E + 1) * 4));
  CHECK(cudaMalloc(&counter, 4));
  const int ctas_max = sms + 1;  // a paired launch rounds the grid up to whole clusters
  const size_t trace_words = size_t(ctas_max) * kTileTraceCtaWords;
  CHECK(cudaMalloc(&trace, trace_words * 8));
  fill_random<<<4 * sms, 256>>>(a, rows * k, 1, 1.0f);
  fill_random<<<4 * sms, 256>>>(b, E * b_rows * k, 2, 1.0f / std::sqrt(float(k)));
  CHECK(cudaGetLastError());
  // Padding rows are zeros, as every producer of the layout leaves them.
  for (int64_t e = 0; e < E; ++e) {
    const int64_t pad = offsets[e + 1] - offsets[e] - counts[e];
    if (pad > 0) CHECK(cudaMemset(a + (offsets[e] + counts[e]) * k, 0, pad * k * 2));
  }
  CHECK(cudaMemset(a + int64_t(offsets[E]) * k, 0, (rows - offsets[E]) * k * 2));
  if (!o.fc1) {
    std::vector<float> w(rows, 0.0f);
    std::uniform_real_distribution<float> weight(0.01f, 0.3f);
    for (int64_t e = 0; e < E; ++e) {
      for (int32_t r = 0; r < counts[e]; ++r) w[offsets[e] + r] = weight(gen);
    }
    CHECK(cudaMalloc(&row_weight, rows * 4));
    CHECK(cudaMemcpy(row_weight, w.data(), rows * 4, cudaMemcpyHostToDevice));
  }
  CHECK(cudaMemcpy(d_offsets, offsets.data(), (E + 1) * 4, cudaMemcpyHostToDevice));

  GroupedGemmArgs g{};
  g.schedule = GemmSchedule::kRows;
  g.epilogue = o.fc1 ? GemmEpilogue::kSwiGLU : GemmEpilogue::kStore;
  g.a = a;
  g.b = b;
  g.b_k_major = true;
  g.num_rows = rows;
  g.n = int32_t(n);
  g.k = int32_t(k);
  g.num_experts = int32_t(E);
  g.expert_offsets = d_offsets;
  g.out = out;
  g.a_src_div = 1;
  g.out_h = out_h;
  g.row_weight = row_weight;
  g.tile_counter = counter;
  g.num_sms = sms;
  g.tile_trace = trace;
  const char* why = nullptr;
  if (!grouped_gemm_supported(g, device, &why)) {
    std::fprintf(stderr, "not supported: %s\n", why);
    return 1;
  }
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  FILE* csv = o.csv.empty() ? nullptr : std::fopen(o.csv.c_str(), "w");
  if (csv) std::fprintf(csv, "merge,cta,n,index,rows,sm,taken,boxes,first,main,end\n");

  for (const std::string& m : o.merges) {
    const MergeTails merge = m == "1" ? MergeTails::kOn : m == "0" ? MergeTails::kOff : MergeTails::kAuto;
    const GemmConfig config = choose_gemm_config(g, TileOrder::kAuto, PairRows::kAuto, Fc1Activation::kWarps, merge);
    std::printf("merge %s: claimed %d, merged tails %d, pairs %d, activation warps %d, helper rows %d, merged "
                "activation %d\n",
                m.c_str(), config.claim_tiles, config.merge_tails, config.pair_rows, config.activation_warps,
                config.activation_helper_rows, int(config.merged_activation));
    auto launch = [&] {
      CHECK(cudaMemsetAsync(counter, 0, 4, stream));
      CHECK(launch_grouped_gemm(g, config, stream));
    };
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(o.secs);
    int warm = 0;
    do {
      for (int i = 0; i < 8; ++i, ++warm) launch();
      CHECK(cudaStreamSynchronize(stream));
    } while (std::chrono::steady_clock::now() < until);
    // Every launch stamps; the traced one is the last, on a cleared record (its CTAs may take fewer tiles).
    CHECK(cudaMemsetAsync(trace, 0, trace_words * 8, stream));
    CHECK(cudaMemsetAsync(counter, 0, 4, stream));
    CHECK(cudaEventRecord(start, stream));
    CHECK(launch_grouped_gemm(g, config, stream));
    CHECK(cudaEventRecord(stop, stream));
    CHECK(cudaStreamSynchronize(stream));
    float ms = 0.0f;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    std::vector<uint64_t> words(trace_words);
    CHECK(cudaMemcpy(words.data(), trace, trace_words * 8, cudaMemcpyDeviceToHost));
    std::vector<std::vector<Stamp>> ctas(ctas_max);
    bool truncated = false;
    for (int c = 0; c < ctas_max; ++c) {
      const uint64_t* w = words.data() + size_t(c) * kTileTraceCtaWords;
      for (int t = 0; t + 1 < kTileTraceTiles && w[t * kTileTraceFields] != 0; ++t) {
        const uint64_t* f = w + t * kTileTraceFields;
        const uint64_t end = w[(t + 1) * kTileTraceFields + 1];
        ctas[c].push_back({uint32_t(f[0]), uint32_t(f[0] >> 32) & 0xffff, uint32_t(f[0] >> 48), f[1], f[2], f[3],
                           f[4], end});
        if (t + 2 == kTileTraceTiles) truncated = true;
      }
    }
    std::printf("  (%d untraced launches first%s)\n", warm, truncated ? "; some CTAs took more tiles than traced" : "");
    summarise(ctas, ms);
    summarise_jobs(words, ctas_max);
    if (csv) {
      for (int c = 0; c < ctas_max; ++c) {
        for (size_t t = 0; t < ctas[c].size(); ++t) {
          const Stamp& s = ctas[c][t];
          std::fprintf(csv, "%s,%d,%zu,%u,%u,%u,%llu,%llu,%llu,%llu,%llu\n", m.c_str(), c, t, s.index, s.rows, s.sm,
                       (unsigned long long)s.taken, (unsigned long long)s.boxes, (unsigned long long)s.first,
                       (unsigned long long)s.main, (unsigned long long)s.end);
        }
      }
    }
  }
  if (csv) std::fclose(csv);
  return 0;
}
