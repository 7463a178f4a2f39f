"""A/B of the engine's forward GEMMs under environment overrides the binding reads per launch (tile order,
paired row blocks), back to back as the benchmark runs them (the H200 sits at its power cap there, so a gap
between calls would time a faster clock). Variants alternate phase by phase within one process, for --rounds
rounds, so drift in the power-capped clock falls on all of them alike.
Usage: python scripts/ab_env.py --variant claimed=PRIMEMOE_GEMM_TILE_ORDER=claimed \
           --variant pairs=PRIMEMOE_GEMM_PAIRS=1,PRIMEMOE_GEMM_TILE_ORDER=claimed [--shapes ...] [--out f.json]
Prints and writes, per shape, tokens, stage (gather, gather_routed, fc1, fc1_no_h, gather_fc1, fc1_gathered, fc2,
forward, forward_gathered, forward_zeroing, backward, backward_zeroing) and variant, the median ms of each round."""
import argparse
import os
import statistics
import time

import torch

from layer_inputs import add_timing_arguments, layer_inputs, time_shapes
from primemoe import ops
from primemoe.bench import SHAPES

lib = torch.ops.primemoe


def parse_variant(text):
    name, _, assignments = text.partition("=")
    env = dict(a.split("=", 1) for a in assignments.split(",") if a)
    return name, env


def phase_ms(fn, secs):
    """Median ms of back-to-back calls for about secs seconds, after a warm-up of the same length."""
    for timed in (False, True):
        events = []
        end = time.time() + secs
        while time.time() < end:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            events.append((s, e))
        torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def forward_gathered(x, idx, w, w1, w2, K):
    """The layer's forward with FC1 gathering its rows from x (fc1_swiglu_gather) instead of gather_rows + TMA."""
    _, offsets, slot_to_row, row_to_slot = lib.dispatch_layout(idx, w1.shape[0], 0, w1.shape[0], ops.ROW_ALIGN)
    a, _ = lib.fc1_swiglu_gather(x, row_to_slot, K, w1, offsets, True)
    o = lib.expert_gemm(a, w2, offsets, False, ops.row_weights(w, row_to_slot))
    return lib.combine_reduce(o, slot_to_row, None)


def time_shape(shape, T, a, overridden, results):
    """Every stage of a.stages at (shape, T): a.rounds rounds of the variants, alternating."""
    _, _, E, K = SHAPES[shape]
    x, idx, w, w1, w2, dy = layer_inputs(shape, T)
    _, off, s2r, r2s = lib.dispatch_layout(idx, E, 0, E, ops.ROW_ALIGN)
    xs = lib.gather_rows(x, r2s, K, None, s2r)
    act = lib.fc1_swiglu(xs, w1, off, True)[0]
    rw = ops.row_weights(w, r2s)
    _, fc1_out = lib.moe_forward(x, idx, w, w1, w2, "bf16", True)
    stages = {
        "gather": lambda: lib.gather_rows(x, r2s, K, None, s2r),
        "gather_routed": lambda: lib.gather_rows(x, r2s, K, None, s2r, off),
        "fc1": lambda: lib.fc1_swiglu(xs, w1, off, True),
        "fc1_no_h": lambda: lib.fc1_swiglu(xs, w1, off, False),
        "gather_fc1": lambda: lib.fc1_swiglu(lib.gather_rows(x, r2s, K, None, s2r), w1, off, True),
        "fc1_gathered": lambda: lib.fc1_swiglu_gather(x, r2s, K, w1, off, True),
        "fc2": lambda: lib.expert_gemm(act, w2, off, False, rw),
        "forward": lambda: ops.moe_forward_composed(x, idx, w, w1, w2, True, True, ops.ROW_ALIGN),
        "forward_gathered": lambda: forward_gathered(x, idx, w, w1, w2, K),
        "forward_zeroing": lambda: ops.moe_forward_composed(x, idx, w, w1, w2, True, True, zero_unrouted=True),
        "backward": lambda: lib.moe_backward(dy, x, idx, w, w1, w2, fc1_out, "bf16"),
        "backward_zeroing": lambda: ops.moe_backward_composed(dy, x, idx, w, w1, w2, fc1_out, True,
                                                              zero_unrouted=True),
    }
    # Rounds outermost: stages alternate too, so two stages that are two compositions compare like variants.
    for _ in range(a.rounds):
        for stage in a.stages:
            for name, env in a.variant:
                for k in overridden:
                    os.environ.pop(k, None)
                os.environ.update(env)
                ms = phase_ms(stages[stage], a.secs)
                results.setdefault(f"{shape}/{T} {stage}", {}).setdefault(name, []).append(round(ms, 4))
    for stage in a.stages:
        row = results[f"{shape}/{T} {stage}"]
        print(f"{shape}/{T} {stage:8}", "  ".join(f"{n} {statistics.median(v):.4f} {v}" for n, v in row.items()),
              flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variant", action="append", required=True, type=parse_variant,
                   help="name=VAR=value[,VAR=value...] (name= alone: no overrides)")
    add_timing_arguments(p, secs=1.0)
    p.add_argument("--stages", nargs="+", default=["fc1", "fc2", "forward", "backward"],
                   help="of gather, gather_routed (the routed rows only), fc1, fc1_no_h (h not kept), gather_fc1 "
                        "(the two in a row), fc1_gathered (fc1_swiglu_gather), fc2, forward, forward_gathered, "
                        "forward_zeroing and backward_zeroing (the GEMMs zero the rows past the routed ones), backward")
    a = p.parse_args()
    overridden = {k for _, env in a.variant for k in env}
    time_shapes(a, lambda shape, T, results: time_shape(shape, T, a, overridden, results), "ms",
                variants=dict(a.variant))


if __name__ == "__main__":
    main()
