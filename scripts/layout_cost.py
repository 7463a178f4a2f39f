"""What the expert-major layout's shape costs FC1 and FC2: the same GEMMs timed back to back (variants alternating
within one process, --rounds rounds, as scripts/ab_env.py does) on four row layouts of the same experts:
  U  the layout of the benchmark's routing (each expert's rows padded to 64: a half tile where the padded count is
     an odd multiple of 64)
  F  every expert at exactly T*K/E rows (512 at the reference shapes: whole 128-row tiles, no padding)
  D  each expert's count rounded down to 64 (no padding rows, half tiles as often as in U)
  R  each expert's count padded to 128 (no half tiles, twice the padding)
All four run on the same random rows (padding rows are random here, not zeros), so only the row counts differ.
Prints each layout's median ms against F's, beside its row count against F's.
Usage (on the GPU machine, from scripts/): python layout_cost.py [--shapes shape:tokens ...] [--out f.json]"""
import argparse
import os
import statistics

import torch

from ab_env import phase_ms
from layer_inputs import add_timing_arguments, layer_inputs, time_shapes
from primemoe import ops
from primemoe.bench import SHAPES

lib = torch.ops.primemoe


def offsets_of(rows_per_expert):
    return torch.tensor([0] + list(rows_per_expert)).cumsum(0).to(torch.int32).cuda()


def time_shape(shape, T, rounds, secs, results):
    _, _, E, K = SHAPES[shape]
    x, idx, w, w1, w2, _ = layer_inputs(shape, T)
    counts, offsets, _, _ = lib.dispatch_layout(idx, E, 0, E, ops.ROW_ALIGN)
    c = [int(v) for v in counts.cpu()]
    layouts = {
        "U": offsets,
        "F": offsets_of([T * K // E] * E),
        "D": offsets_of([v // 64 * 64 for v in c]),
        "R": offsets_of([(v + 127) // 128 * 128 for v in c]),
    }
    rows = {k: int(v[-1]) for k, v in layouts.items()}
    print(f"{shape}/{T} rows {rows}, routed {T * K}", flush=True)
    a_rows = torch.randn(max(rows.values()), x.shape[1], device="cuda").bfloat16()
    row_weight = torch.rand(a_rows.shape[0], device="cuda")
    acts = {k: lib.fc1_swiglu(a_rows[:rows[k]], w1, v, True)[0] for k, v in layouts.items()}
    # FC1 is paired by default, FC2 is not: each also the other way (PRIMEMOE_GEMM_PAIRS).
    for stage, pairs in (("fc1", ""), ("fc1", "0"), ("fc2", ""), ("fc2", "1")):
        os.environ["PRIMEMOE_GEMM_PAIRS"] = pairs
        ms = {k: [] for k in layouts}
        for _ in range(rounds):
            for k, v in layouts.items():
                if stage == "fc1":
                    fn = lambda: lib.fc1_swiglu(a_rows[:rows[k]], w1, v, True)  # noqa: E731
                else:
                    fn = lambda: lib.expert_gemm(acts[k], w2, v, False, row_weight[:rows[k]])  # noqa: E731
                ms[k].append(round(phase_ms(fn, secs), 4))
        med = {k: statistics.median(v) for k, v in ms.items()}
        key = f"{shape}/{T} {stage} pairs={pairs or 'default'}"
        print(key, "  ".join(f"{k} {med[k]:.4f} ({med[k] / med['F']:.4f}x, rows {rows[k] / rows['F']:.4f}x)"
                             for k in layouts), flush=True)
        results[key] = {"ms": ms, "rows": rows}
    os.environ.pop("PRIMEMOE_GEMM_PAIRS")


def main():
    p = argparse.ArgumentParser()
    add_timing_arguments(p, secs=0.5)
    a = p.parse_args()
    time_shapes(a, lambda shape, T, results: time_shape(shape, T, a.rounds, a.secs, results), "results")


if __name__ == "__main__":
    main()
