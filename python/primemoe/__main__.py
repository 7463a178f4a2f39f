"""Main job: one forward+backward of a Qwen3-MoE-shaped layer through primemoe.moe,
checked against an independent implementation, with a small timing table.

    python -m primemoe [--shape qwen3-30b-a3b] [--tokens N] [--iters N]

On a GPU this exercises the CUDA path and checks it against the fp32 reference;
on a CPU-only machine it runs the CPU path (the reference) and checks it against
the plain-PyTorch baseline, and says that no GPU kernel ran.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from .shapes import MODEL_SHAPES


def make_problem(shape, tokens, device, seed=0):
    from . import route

    g = torch.Generator(device="cpu").manual_seed(seed)
    H, I, E, K = shape.dims

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=g) * scale).to(device=device, dtype=torch.bfloat16)

    x = randn(tokens, H)
    topk_idx, topk_weights = route(torch.randn(tokens, E, generator=g).to(device), K)
    w1 = randn(E, 2 * I, H, scale=H ** -0.5)
    w2 = randn(E, H, I, scale=I ** -0.5)
    dy = randn(tokens, H)
    return x, topk_idx, topk_weights, w1, w2, dy


def forward_backward(fn, x, topk_idx, topk_weights, w1, w2, dy):
    leaves = [t.detach().requires_grad_() for t in (x, topk_weights, w1, w2)]
    y = fn(leaves[0], topk_idx, leaves[1], leaves[2], leaves[3])
    grads = torch.autograd.grad(y, leaves, dy)
    return [y.detach(), *grads]


def timed(fn, device, iters):
    """Median wall time of fn in ms (device-synchronised)."""
    times = []
    for i in range(iters + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first run warms up
            times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main(argv=None):
    import primemoe
    from primemoe import baseline, reference

    p = argparse.ArgumentParser(prog="python -m primemoe", description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(MODEL_SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=None, help="tokens (default 4096 on GPU, 32 on CPU)")
    p.add_argument("--iters", type=int, default=None, help="timed repeats (default 10 on GPU, 1 on CPU)")
    args = p.parse_args(argv)

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    tokens = args.tokens if args.tokens is not None else (4096 if on_gpu else 32)
    iters = args.iters if args.iters is not None else (10 if on_gpu else 1)
    shape = MODEL_SHAPES[args.shape]
    H, I, E, K = shape.dims
    print(f"primemoe {primemoe.__version__}: {args.shape} (H={H} I={I} E={E} K={K}), T={tokens}, "
          f"device={torch.cuda.get_device_name() if on_gpu else 'cpu'}", flush=True)

    problem = make_problem(shape, tokens, device)
    x, topk_idx, topk_weights, w1, w2, dy = problem
    ours = forward_backward(primemoe.moe, *problem)
    if on_gpu:
        check_name = "fp32 reference"
        as_fp32 = lambda t: t.float()  # noqa: E731
        expected = forward_backward(reference.moe, as_fp32(x), topk_idx, topk_weights, as_fp32(w1), as_fp32(w2),
                                    as_fp32(dy))
        tolerance = 2e-2
    else:
        check_name = "baseline (independent grouped-GEMM implementation)"
        expected = forward_backward(baseline.moe, *problem)
        tolerance = 3e-2
    names = ["y", "dx", "d_topk_weights", "dw1", "dw2"]
    errors = {n: rel_err(a, b) for n, a, b in zip(names, ours, expected)}
    ok = all(e <= tolerance for e in errors.values())
    print(f"check vs {check_name}: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items())
          + f" -> {'OK' if ok else 'FAILED'} (tolerance {tolerance:g})")

    impls = {"primemoe.moe": primemoe.moe, "baseline": baseline.moe}
    flops_fwd = 6 * tokens * K * H * I
    print(f"\n{'implementation':<16}{'fwd+bwd ms':>12}{'TFLOP/s':>10}")
    for name, fn in impls.items():
        ms = timed(lambda: forward_backward(fn, *problem), device, iters)
        print(f"{name:<16}{ms:>12.3f}{3 * flops_fwd / ms / 1e9:>10.2f}")
    if not on_gpu:
        print("\nNOTE: no CUDA device: the GPU kernels were NOT exercised; this ran the CPU reference path.")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
