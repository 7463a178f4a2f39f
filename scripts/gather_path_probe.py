"""Where the gathered FC1 (fc1_swiglu_gather: cp.async copies by one producer warp) loses to FC1 over rows gathered
beforehand (TMA loads): the same FC1, the same row count and expert sizes, five ways, back to back, rounds
alternating:
  tma        fc1_swiglu over the expert-major rows (the layer's path);
  tma_sorted fc1_swiglu, top_k = 1, tokens already in expert order, T * K / E per expert (no padding rows);
  cp_sorted  fc1_swiglu_gather on the same: each row's source is the row itself, so the copies read what TMA
             reads, in the same order (the cp.async path alone, against tma_sorted);
  cp_random  fc1_swiglu_gather, top_k = 1, tokens in random order: the same bytes, scattered (+ the access pattern);
  cp_topk    fc1_swiglu_gather on the layer's own routing (top_k = K, x read K times: + L2 reuse of x).
Usage: python scripts/gather_path_probe.py [--shapes qwen3-235b-a22b:8192 ...] [--rounds 3] [--secs 0.5] [--out f.json]
(tokens: the layer's T; the top_k = 1 cases use T * K tokens, as many rows as the layer routes)."""
import argparse
import statistics

import torch

from ab_env import phase_ms
from layer_inputs import add_timing_arguments, layer_inputs, time_shapes
from primemoe import ops
from primemoe.bench import SHAPES

lib = torch.ops.primemoe


def one_hot_routing(tokens, experts, shuffled, gen):
    """top_k = 1 routing with every expert given tokens / experts tokens (the layer's mean), in expert order or not."""
    idx = torch.arange(tokens, device="cuda") * experts // tokens
    if shuffled:
        idx = idx[torch.randperm(tokens, device="cuda", generator=gen)]
    return idx.view(tokens, 1)


def probe(shape, T, a, results):
    _, _, E, K = SHAPES[shape]
    x, idx, _, w1, _, _ = layer_inputs(shape, T)
    gen = torch.Generator("cuda").manual_seed(1)
    rows_x = torch.randn(T * K, x.shape[1], device="cuda", generator=gen).bfloat16()
    cases = {}
    _, off, s2r, r2s = lib.dispatch_layout(idx, E, 0, E, ops.ROW_ALIGN)
    xs = lib.gather_rows(x, r2s, K, None, s2r)
    cases["tma"] = lambda: lib.fc1_swiglu(xs, w1, off, True)
    for name, shuffled in (("cp_sorted", False), ("cp_random", True)):
        _, off1, _, r2s1 = lib.dispatch_layout(one_hot_routing(T * K, E, shuffled, gen), E, 0, E, ops.ROW_ALIGN)
        if not shuffled:
            assert torch.equal(r2s1[:T * K].cpu(), torch.arange(T * K, dtype=torch.int32)), "rows not in token order"
            cases["tma_sorted"] = lambda off1=off1: lib.fc1_swiglu(rows_x, w1, off1, True)
        cases[name] = lambda off1=off1, r2s1=r2s1: lib.fc1_swiglu_gather(rows_x, r2s1, 1, w1, off1, True)
    cases["cp_topk"] = lambda: lib.fc1_swiglu_gather(x, r2s, K, w1, off, True)
    for _ in range(a.rounds):
        for name, fn in cases.items():
            results.setdefault(f"{shape}/{T}", {}).setdefault(name, []).append(round(phase_ms(fn, a.secs), 4))
    row = results[f"{shape}/{T}"]
    print(f"{shape}/{T}", "  ".join(f"{n} {statistics.median(v):.4f}" for n, v in row.items()), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_arguments(p, secs=0.5)
    a = p.parse_args()
    time_shapes(a, lambda shape, T, results: probe(shape, T, a, results), "ms")


if __name__ == "__main__":
    main()
