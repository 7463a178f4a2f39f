"""The engine's forward GEMMs, for Nsight Compute: each kernel runs once to warm up, then once
more (profile with --launch-skip 3 --launch-count 3): fc1_swiglu_gather, fc1_swiglu over
pre-gathered rows, FC2 (expert_gemm with the routing weight). With --dgrad, the two dgrads instead:
after two GEMMs that make their inputs, FC2 dgrad and FC1 dgrad twice (--launch-skip 4 --launch-count 2).
Usage: python scripts/ncu_engine.py [--shape qwen3-30b-a3b|qwen3-235b-a22b] [--tokens 16384] [--dgrad]"""

import argparse

import torch

from layer_inputs import layer_inputs
from primemoe import ops
from primemoe.bench import SHAPES

lib = torch.ops.primemoe
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
parser.add_argument("--tokens", type=int, default=16384)
parser.add_argument("--dgrad", action="store_true", help="FC2 dgrad and FC1 dgrad instead of the forward GEMMs")
args = parser.parse_args()
H, I, E, K = SHAPES[args.shape]
T = args.tokens

x, idx, w, w1, w2, dy = layer_inputs(args.shape, T)
_, off, _, r2s = lib.dispatch_layout(idx, E, 0, E, ops.ROW_ALIGN)
xs = lib.gather_rows(x, r2s, K, None)
rw = ops.row_weights(w, r2s)
if args.dgrad:
    dy_rows = lib.gather_rows(dy, r2s, K, None)
    _, h = lib.fc1_swiglu(xs, w1, off, True)
    dh, _, _ = lib.fc2_dgrad_swiglu(dy_rows, w2, h, rw, off)
    for _ in range(2):
        lib.fc2_dgrad_swiglu(dy_rows, w2, h, rw, off)
        lib.expert_gemm(dh, w1, off, True)
else:
    for _ in range(2):
        lib.fc1_swiglu_gather(x, r2s, K, w1, off, True)
        a, _ = lib.fc1_swiglu(xs, w1, off, True)
        lib.expert_gemm(a, w2, off, False, rw)
torch.cuda.synchronize()
print("done")
