"""Grid sizes of the forward GEMM launches per PRIMEMOE_GEMM_PAIRS setting (from the profiler's kernel records):
how many CTAs the cluster launches get. Usage: python scripts/cluster_grid_probe.py"""
import json
import os
import tempfile

import torch

from layer_inputs import layer_inputs
from primemoe import ops
from primemoe.bench import SHAPES

lib = torch.ops.primemoe
x, idx, w, w1, w2, dy = layer_inputs("qwen3-235b-a22b", 8192)
E, K = SHAPES["qwen3-235b-a22b"][2:]
_, off, s2r, r2s = lib.dispatch_layout(idx, E, 0, E, ops.ROW_ALIGN)
xs = lib.gather_rows(x, r2s, K, None, s2r)
for pairs in ("0", "1", "2x2"):
    os.environ["PRIMEMOE_GEMM_PAIRS"] = pairs
    lib.fc1_swiglu(xs, w1, off, True)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        lib.fc1_swiglu(xs, w1, off, True)
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    grids = [e["args"].get("grid") for e in json.load(open(path))["traceEvents"]
             if "grouped_gemm_kernel" in e.get("name", "") and "args" in e]
    print(f"PRIMEMOE_GEMM_PAIRS={pairs}: grid {grids}", flush=True)
