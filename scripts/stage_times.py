"""Per-stage GPU times of primemoe's single-GPU forward and backward (median of CUDA events),
to show where the layer's time goes. Usage: python scripts/stage_times.py [--tokens 8192 16384]
[--row-aligns 64 128] [--tile-orders auto static claimed] (each routing layout alignment's and GEMM tile
order's stages, interleaved with the others'; the tile order is PRIMEMOE_GEMM_TILE_ORDER, auto = unset).

The stages run round-robin (one of each per iteration), not one stage 20 times then the next:
run in sequence, a stage timed late in a long run of heavy kernels came out slower than the
same work timed early (the 235B FC1 without kept pre-activations measured 4.04 ms against
2.83 with them; interleaved it is the faster of the two)."""

import argparse
import itertools
import json
import os
import statistics

import torch

from layer_inputs import layer_inputs
from primemoe import ops
from primemoe.bench import SHAPES, TARGET_SHAPES

lib = torch.ops.primemoe


def time_once(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def timed_round_robin(fns, iters=20):
    """Median ms of each function, the functions interleaved."""
    for _ in range(3):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(iters):
        for fn, t in zip(fns, times):
            t.append(time_once(fn))
    return [statistics.median(t) for t in times]


def stages(shape, tokens, row_align):
    H, I, E, K = SHAPES[shape]
    x, idx, w, w1, w2, dy = layer_inputs(shape, tokens)
    cnt, off, s2r, r2s = lib.dispatch_layout(idx, E, 0, E, row_align)
    xs = lib.gather_rows(x, r2s, K, None, s2r)
    a, h = lib.fc1_swiglu(xs, w1, off, True)
    rw = ops.row_weights(w, r2s)
    o = lib.expert_gemm(a, w2, off, False, rw)
    dy_rows = lib.gather_rows(dy, r2s, K, None, s2r)
    dh, aw, dot = lib.fc2_dgrad_swiglu(dy_rows, w2, h, rw, off)
    rows = int(off[-1])
    flops = 2 * rows * H * I  # one H x I GEMM over the padded rows
    table = {
        "dispatch_layout": (lambda: lib.dispatch_layout(idx, E, 0, E, row_align), 0),
        "gather_rows x": (lambda: lib.gather_rows(x, r2s, K, None, s2r), 0),
        "fc1_swiglu (gathered x)": (lambda: lib.fc1_swiglu(xs, w1, off, True), 2 * flops),
        "fc1_swiglu, h not kept": (lambda: lib.fc1_swiglu(xs, w1, off, False), 2 * flops),
        "fc1 GEMM alone (expert_gemm)": (lambda: lib.expert_gemm(xs, w1, off, False), 2 * flops),
        "fc2 expert_gemm": (lambda: lib.expert_gemm(a, w2, off, False, rw), flops),
        "combine_reduce": (lambda: lib.combine_reduce(o, s2r, None), 0),
        "fc2_dgrad_swiglu": (lambda: lib.fc2_dgrad_swiglu(dy_rows, w2, h, rw, off), flops),
        "wgrad w2": (lambda: lib.expert_wgrad(dy_rows, aw, off, cnt), flops),
        "fc1 dgrad expert_gemm": (lambda: lib.expert_gemm(dh, w1, off, True), 2 * flops),
        "wgrad w1": (lambda: lib.expert_wgrad(dh, xs, off, cnt), 2 * flops),
        # Without the layout's counts: every padding k-slice reduced (interleaved with the above).
        "wgrad w2, no counts": (lambda: lib.expert_wgrad(dy_rows, aw, off), flops),
        "wgrad w1, no counts": (lambda: lib.expert_wgrad(dh, xs, off), 2 * flops),
        "forward total": (lambda: ops.moe_forward_composed(x, idx, w, w1, w2, True, True, row_align),
                          6 * tokens * K * H * I),
        "backward total": (lambda: ops.moe_backward_composed(dy, x, idx, w, w1, w2, h, True, row_align),
                           12 * tokens * K * H * I),
    }
    if row_align == ops.ROW_ALIGN:  # the op's own layout only
        table["fc1_swiglu_gather"] = (lambda: lib.fc1_swiglu_gather(x, r2s, K, w1, off, True), 2 * flops)
    return table, rows


def under_tile_order(fn, order):
    def run():
        if order == "auto":
            os.environ.pop("PRIMEMOE_GEMM_TILE_ORDER", None)
        else:
            os.environ["PRIMEMOE_GEMM_TILE_ORDER"] = order
        return fn()
    return run


def timed_stages(shape, tokens, row_aligns, tile_orders):
    tables = {ra: stages(shape, tokens, ra) for ra in row_aligns}
    named = [(ra, order, name, under_tile_order(fn, order), f)
             for ra, order in itertools.product(row_aligns, tile_orders)
             for name, (fn, f) in tables[ra][0].items()]
    medians = timed_round_robin([fn for _, _, _, fn, _ in named])
    os.environ.pop("PRIMEMOE_GEMM_TILE_ORDER", None)
    out = {}
    for (ra, order, name, _, f), ms in zip(named, medians):
        variant = [f"row_align {ra}"] if len(row_aligns) > 1 else []
        variant += [f"tiles {order}"] if len(tile_orders) > 1 else []
        key = f"{name} [{', '.join(variant)}]" if variant else name
        out[key] = {"ms": round(ms, 4), "tflops": round(f / ms / 1e9, 1) if f else None}
        print(f"{shape:16} T={tokens:6} padded rows={tables[ra][1]:7} {key:40} {ms:8.3f} ms"
              + (f"  {f / ms / 1e9:6.1f} TFLOP/s" if f else ""), flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--shapes", nargs="+", default=TARGET_SHAPES, choices=list(SHAPES))
    p.add_argument("--row-aligns", type=int, nargs="+", default=[ops.ROW_ALIGN])
    p.add_argument("--tile-orders", nargs="+", default=["auto"], choices=["auto", "static", "claimed"])
    p.add_argument("--out", help="write the table as JSON here")
    args = p.parse_args()
    result = {f"{s}/{t}": timed_stages(s, t, args.row_aligns, args.tile_orders)
              for s in args.shapes for t in args.tokens}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
