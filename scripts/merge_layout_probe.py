"""192-row tiles against 64-row ones among full tiles: FC1 and FC2 with PRIMEMOE_GEMM_MERGE_TAILS=0 / 1 (pairs off
in both, PRIMEMOE_GEMM_PAIRS=0), back to back, rounds alternating, on synthetic layouts of the shape's experts:
  all192    every expert at 192 rows (merged: one tile per column tile; unmerged: a full and a half tile)
  3f1m      every expert at 576 rows (merged: 1 merged + 3 full; unmerged: 4 full + 1 half)
  inter     experts alternating 576 and 512 rows (merged tiles among full ones)
  grouped   the same counts, the 576-row experts first (merged tiles together, fewer transitions)
(The twenty-fifth session found with it, and `gpu_run.sh ncumerge`, that a merged tile placed last in its expert
re-read its weight slices from DRAM: benchmarks/RESULTS.md.)
Usage (from scripts/): python merge_layout_probe.py [--shapes qwen3-235b-a22b:8192 ...] [--out f.json]
(tokens only size the buffers here.) --once LAYOUT: for Nsight Compute, FC1 on that layout of the first shape, unmerged
then merged, each once after a warm-up of both (profile with --launch-skip 2 --launch-count 2)."""
import argparse
import os
import statistics

import torch

from ab_env import phase_ms
from layer_inputs import add_timing_arguments, layer_inputs, time_shapes
from primemoe.bench import SHAPES

lib = torch.ops.primemoe


def layouts(E):
    half = E // 2
    return {
        "all192": [192] * E,
        "3f1m": [576] * E,
        "inter": [576 if e % 2 == 0 else 512 for e in range(E)],
        "grouped": [576] * half + [512] * (E - half),
    }


def inputs(shape, T):
    _, _, E, _ = SHAPES[shape]
    x, _, _, w1, w2, _ = layer_inputs(shape, T)
    counts = layouts(E)
    rows = {k: sum(v) for k, v in counts.items()}
    offsets = {k: torch.tensor([0] + v).cumsum(0).to(torch.int32).cuda() for k, v in counts.items()}
    a_rows = torch.randn(max(rows.values()), x.shape[1], device="cuda").bfloat16()
    row_weight = torch.rand(a_rows.shape[0], device="cuda")
    return w1, w2, counts, rows, offsets, a_rows, row_weight


def run_once(shape, T, layout):
    w1, _, _, rows, offsets, a_rows, _ = inputs(shape, T)
    os.environ["PRIMEMOE_GEMM_PAIRS"] = "0"
    for merge in ("0", "1", "0", "1"):
        os.environ["PRIMEMOE_GEMM_MERGE_TAILS"] = merge
        lib.fc1_swiglu(a_rows[:rows[layout]], w1, offsets[layout], True)
    torch.cuda.synchronize()


def probe(shape, T, a, results):
    w1, w2, counts, rows, offsets, a_rows, row_weight = inputs(shape, T)
    os.environ["PRIMEMOE_GEMM_PAIRS"] = "0"
    os.environ["PRIMEMOE_GEMM_MERGE_TAILS"] = "0"
    acts = {k: lib.fc1_swiglu(a_rows[:rows[k]], w1, off, True)[0] for k, off in offsets.items()}
    for k, off in offsets.items():
        for stage in ("fc1", "fc2"):
            if stage == "fc1":
                fn = lambda: lib.fc1_swiglu(a_rows[:rows[k]], w1, off, True)  # noqa: E731
            else:
                fn = lambda: lib.expert_gemm(acts[k], w2, off, False, row_weight[:rows[k]])  # noqa: E731
            ms = {"unmerged": [], "merged": []}
            for _ in range(a.rounds):
                for name, merge in (("unmerged", "0"), ("merged", "1")):
                    os.environ["PRIMEMOE_GEMM_MERGE_TAILS"] = merge
                    ms[name].append(round(phase_ms(fn, a.secs), 4))
            med = {n: statistics.median(v) for n, v in ms.items()}
            results[f"{shape}/{T} {k} {stage}"] = {"rows": rows[k], "ms": ms}
            print(f"{shape}/{T} {k:8} {stage} rows {rows[k]}: unmerged {med['unmerged']:.4f} merged "
                  f"{med['merged']:.4f} ({med['merged'] / med['unmerged']:.4f}x)", flush=True)
    for name in ("PRIMEMOE_GEMM_PAIRS", "PRIMEMOE_GEMM_MERGE_TAILS"):
        os.environ.pop(name)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_arguments(p, secs=0.5)
    p.add_argument("--once", choices=list(layouts(2)))
    a = p.parse_args()
    if a.once:
        shape, T = a.shapes[0]
        run_once(shape, T, a.once)
        return
    time_shapes(a, lambda shape, T, results: probe(shape, T, a, results), "results")


if __name__ == "__main__":
    main()
