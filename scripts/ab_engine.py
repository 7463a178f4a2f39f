"""A/B of engine variants in one process, interleaved (variant A, B, ... per iteration), so clock
and thermal drift over a run hits every variant alike. Medians of CUDA-event times, ms.
Usage: python scripts/ab_engine.py [--tokens 8192 16384] [--out ab.json]"""

import argparse
import json
import os
import statistics

import torch

from primemoe import ops, route

lib = torch.ops.primemoe
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "qwen3-235b-a22b": (4096, 1536, 128, 8)}


def time_once(fn, env):
    os.environ.update(env)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def compare(name, variants, iters=20):
    """variants: {label: (fn, env)}; all run once to warm up, then interleaved."""
    for fn, env in variants.values():
        time_once(fn, env)
    times = {label: [] for label in variants}
    for _ in range(iters):
        for label, (fn, env) in variants.items():
            times[label].append(time_once(fn, env))
    med = {label: round(statistics.median(t), 4) for label, t in times.items()}
    print(f"{name:40} " + "  ".join(f"{label}={ms:.3f}" for label, ms in med.items()), flush=True)
    return med


def run(shape, tokens):
    H, I, E, K = SHAPES[shape]
    gen = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(tokens, H, device="cuda", generator=gen).bfloat16()
    idx, w = route(torch.randn(tokens, E, device="cuda", generator=gen), K)
    w1 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=gen) * I ** -0.5).bfloat16()
    dy = torch.randn(tokens, H, device="cuda", generator=gen).bfloat16()
    _, off, s2r, r2s = lib.dispatch_layout(idx, E, 0, E, ops.ROW_ALIGN)
    xs = lib.gather_rows(x, r2s, K, None)
    a, h = lib.fc1_swiglu(xs, w1, off, True)
    rw = ops.row_weights(w, r2s)
    dy_rows = lib.gather_rows(dy, r2s, K, None)
    dh, aw, _ = lib.fc2_dgrad_swiglu(dy_rows, w2, h, rw, off)
    plain, stagger = {"PRIMEMOE_GEMM_STAGGER": "0"}, {"PRIMEMOE_GEMM_STAGGER": "1"}
    tag = f"{shape} T={tokens}"
    out = {}
    for name, fn in {
        "fc1_swiglu": lambda: lib.fc1_swiglu(xs, w1, off, True),
        "fc2 expert_gemm": lambda: lib.expert_gemm(a, w2, off, False, rw),
        "fc2_dgrad_swiglu": lambda: lib.fc2_dgrad_swiglu(dy_rows, w2, h, rw, off),
        "fc1 dgrad expert_gemm": lambda: lib.expert_gemm(dh, w1, off, True),
        "wgrad w2": lambda: lib.expert_wgrad(dy_rows, aw, off),
        "wgrad w1": lambda: lib.expert_wgrad(dh, xs, off),
        "forward": lambda: ops.moe_forward_composed(x, idx, w, w1, w2, True, True),
    }.items():
        out[name] = compare(f"{tag} {name}", {"plain": (fn, plain), "stagger": (fn, stagger)})
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--out", help="write the medians as JSON here")
    args = p.parse_args()
    result = {f"{s}/{t}": run(s, t) for s in args.shapes for t in args.tokens}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
