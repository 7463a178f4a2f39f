"""Raw timings of the FP8 expert GEMMs beside the bf16 engine's at a model shape (uniform routing, every expert
1024-aligned): FC1-like rows GEMM (K = H, N = 2I), FC2-like (K = I, N = H), and the two weight gradients.

    python scripts/fp8_gemm_bench.py [--shape qwen3-235b-a22b] [--tokens 16384] [--iters 20]
"""

import argparse

import torch

import primemoe  # noqa: F401
from primemoe import fp8
from primemoe.shapes import MODEL_SHAPES

ops = torch.ops.primemoe


def timed(fn, iters):
    for _ in range(3):
        fn()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for i in range(iters):
        flush.zero_()
        start[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in zip(start, end))
    return ms[len(ms) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-235b-a22b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    s = MODEL_SHAPES[args.shape]
    H, I, E, K = s.hidden, s.intermediate, s.experts, s.top_k
    rows = args.tokens * K
    per = rows // E
    offsets = torch.arange(E + 1, dtype=torch.int32, device="cuda") * per
    counts = torch.full((E,), per, dtype=torch.int32, device="cuda")
    dev = "cuda"
    x = torch.randn(rows, H, device=dev, dtype=torch.bfloat16)
    a = torch.randn(rows, I, device=dev, dtype=torch.bfloat16)
    w1 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * H ** -0.5
    w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * I ** -0.5
    xq, xs = ops.quantize_fp8_1x128(x)
    xs = xs.t().contiguous()
    aq, as_ = ops.quantize_fp8_1x128(a)
    as_ = as_.t().contiguous()
    w1q, w1s = ops.quantize_fp8_128x128(w1)
    w2q, w2s = ops.quantize_fp8_128x128(w2)
    dy = torch.randn(rows, H, device=dev, dtype=torch.bfloat16)
    dh = torch.randn(rows, 2 * I, device=dev, dtype=torch.bfloat16)
    dyt, dyts = ops.quantize_fp8_128x1(dy)
    dyts = dyts.t().contiguous()
    at, ats = ops.quantize_fp8_128x1(a)
    ats = ats.t().contiguous()
    dht, dhts = ops.quantize_fp8_128x1(dh)
    dhts = dhts.t().contiguous()
    xt, xts = ops.quantize_fp8_128x1(x)
    xts = xts.t().contiguous()
    rw = torch.rand(rows, device=dev)
    cases = [
        ("fc1 rows (K=H, N=2I)", 2 * rows * H * 2 * I,
         lambda: ops.fp8_expert_gemm(xq, xs, w1q, w1s, offsets),
         lambda: ops.expert_gemm(x, w1, offsets, False, zero_unrouted=False)),
        ("fc2 rows (K=I, N=H)", 2 * rows * I * H,
         lambda: ops.fp8_expert_gemm(aq, as_, w2q, w2s, offsets, rw),
         lambda: ops.expert_gemm(a, w2, offsets, False, rw, zero_unrouted=False)),
        ("wgrad dw2 (M=H, N=I)", 2 * rows * H * I,
         lambda: ops.fp8_expert_wgrad(dyt, dyts, at, ats, offsets, counts, False),
         lambda: ops.expert_wgrad(dy, a, offsets, counts)),
        ("wgrad dw1 (M=2I, N=H)", 2 * rows * 2 * I * H,
         lambda: ops.fp8_expert_wgrad(dht, dhts, xt, xts, offsets, counts, False),
         lambda: ops.expert_wgrad(dh, x, offsets, counts)),
    ]
    print(f"{args.shape} T={args.tokens} rows={rows} (uniform, {per} per expert)")
    for name, flops, f8, b16 in cases:
        t8 = timed(f8, args.iters)
        t16 = timed(b16, args.iters)
        print(f"{name:24s} fp8 {t8:8.3f} ms {flops / t8 / 1e9:7.1f} TFLOP/s | bf16 {t16:8.3f} ms "
              f"{flops / t16 / 1e9:7.1f} TFLOP/s")
    q = lambda: ops.quantize_fp8_1x128(x)  # noqa: E731
    print(f"quantize 1x128 x [{rows}, {H}]: {timed(q, args.iters):.3f} ms")


if __name__ == "__main__":
    main()
