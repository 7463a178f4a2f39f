"""The engine's forward GEMMs, for Nsight Compute: fc1_swiglu over pre-gathered rows, then FC2 (expert_gemm with
the routing weight), twice (profile the second pair: --launch-skip 2 --launch-count 2, as `gpu_run.sh ncu`).
With --dgrad, the two dgrads instead: after two GEMMs that make their inputs, FC2 dgrad and FC1 dgrad twice
(--launch-skip 4 --launch-count 2).
Usage: python scripts/ncu_engine.py [--shape qwen3-30b-a3b|qwen3-235b-a22b] [--tokens 16384] [--dgrad]"""

import argparse

import torch

from layer_inputs import layer_inputs
from primemoe.bench import SHAPES
from primemoe.ops import ROW_ALIGN

lib = torch.ops.primemoe
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
parser.add_argument("--tokens", type=int, default=16384)
parser.add_argument("--dgrad", action="store_true", help="FC2 dgrad and FC1 dgrad instead of the forward GEMMs")
args = parser.parse_args()
H, I, E, K = SHAPES[args.shape]
T = args.tokens

x, idx, w, w1, w2, dy = layer_inputs(args.shape, T)
_, off, s2r, r2s = lib.dispatch_layout(idx, E, 0, E, ROW_ALIGN)
xs = lib.gather_rows(x, r2s, K, None, s2r)
rw = lib.gather_scalars(w.reshape(-1), r2s)  # each row's routing weight, 0 on padding rows
if args.dgrad:
    dy_rows = lib.gather_rows(dy, r2s, K, None, s2r)
    _, h = lib.fc1_swiglu(xs, w1, off, True)
    dh, _, _ = lib.fc2_dgrad_swiglu(dy_rows, w2, h, rw, off)
    for _ in range(2):
        lib.fc2_dgrad_swiglu(dy_rows, w2, h, rw, off)
        lib.expert_gemm(dh, w1, off, True)
else:
    for _ in range(2):
        a, _ = lib.fc1_swiglu(xs, w1, off, True)
        lib.expert_gemm(a, w2, off, False, rw)
torch.cuda.synchronize()
print("done")
