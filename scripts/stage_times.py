"""Per-stage GPU times of primemoe's single-GPU forward and backward (median of CUDA events),
to show where the layer's time goes. Usage: python scripts/stage_times.py [--shapes ...] [--tokens 8192 16384]
[--row-aligns 64 128] [--out stages.json] (each routing layout alignment's stages, interleaved with the others').

Each stage is one op at its defaults (the GEMMs write every allocated row; the layer leaves the rows past the
routed ones unwritten), with TFLOP/s over the padded rows; "forward total" and "backward total" are the
layer's ops, moe_forward and moe_backward, at the ops' own layout (ROW_ALIGN), with DESIGN.md's FLOP counts.

The stages run round-robin (one of each per iteration), not one stage 20 times then the next: run in
sequence, a stage timed late in a long run of heavy kernels comes out slower than the same work timed early."""

import argparse
import json
import statistics

import torch

from layer_inputs import layer_inputs
from primemoe.ops import ROW_ALIGN
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
    rw = lib.gather_scalars(w.reshape(-1), r2s)  # each row's routing weight, 0 on padding rows
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
    }
    if row_align == ROW_ALIGN:  # the ops' own layout
        _, fc1_out = lib.moe_forward(x, idx, w, w1, w2, "bf16", True)
        table["forward total"] = (lambda: lib.moe_forward(x, idx, w, w1, w2, "bf16", True), 6 * tokens * K * H * I)
        table["backward total"] = (lambda: lib.moe_backward(dy, x, idx, w, w1, w2, fc1_out, "bf16"),
                                   12 * tokens * K * H * I)
    return table, rows


def timed_stages(shape, tokens, row_aligns):
    tables = {ra: stages(shape, tokens, ra) for ra in row_aligns}
    named = [(ra, name, fn, f) for ra in row_aligns for name, (fn, f) in tables[ra][0].items()]
    medians = timed_round_robin([fn for _, _, fn, _ in named])
    out = {}
    for (ra, name, _, f), ms in zip(named, medians):
        key = f"{name} [row_align {ra}]" if len(row_aligns) > 1 else name
        out[key] = {"ms": round(ms, 4), "tflops": round(f / ms / 1e9, 1) if f else None}
        print(f"{shape:16} T={tokens:6} padded rows={tables[ra][1]:7} {key:40} {ms:8.3f} ms"
              + (f"  {f / ms / 1e9:6.1f} TFLOP/s" if f else ""), flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--shapes", nargs="+", default=TARGET_SHAPES, choices=list(SHAPES))
    p.add_argument("--row-aligns", type=int, nargs="+", default=[ROW_ALIGN],
                   help=f"routing layout alignments (multiples of {ROW_ALIGN}) of the stages")
    p.add_argument("--out", help="write the table as JSON here")
    args = p.parse_args()
    result = {f"{s}/{t}": timed_stages(s, t, args.row_aligns)
              for s in args.shapes for t in args.tokens}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
