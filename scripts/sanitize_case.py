"""A small forward+backward through every primemoe CUDA kernel, and the gathered FC1, for compute-sanitizer.
Usage: python scripts/sanitize_case.py [T H I E K] (default 77 256 256 8 4)."""
import sys

import torch

import primemoe

torch.manual_seed(0)
# I = 256: the expert GEMM engine's kernels run (not the fallback)
T, H, I, E, K = (int(v) for v in sys.argv[1:6]) if len(sys.argv) > 1 else (77, 256, 256, 8, 4)
x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
topk_idx, topk_weights = primemoe.route(torch.randn(T, E, device="cuda"), K)
topk_idx[3, 1] = -1
topk_weights.requires_grad_()
w1 = (torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5).requires_grad_()
w2 = (torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5).requires_grad_()
assert primemoe.ops.use_engine(x, w1), "the engine does not cover this case: the sanitizer would not see it"
y = primemoe.moe(x, topk_idx, topk_weights, w1, w2)
y.backward(torch.randn_like(y))
layout = torch.ops.primemoe.dispatch_layout(topk_idx.int(), E, 2, min(4, E - 2), 128)
# The gathered FC1 (not on the layer's path).
_, offsets, _, row_to_slot = torch.ops.primemoe.dispatch_layout(topk_idx, E, 0, E, primemoe.ops.ROW_ALIGN)
torch.ops.primemoe.fc1_swiglu_gather(x.detach(), row_to_slot, K, w1.detach(), offsets, True)
torch.cuda.synchronize()
primemoe.check_errors()
print("sanitize case ok", float(y.float().norm()), int(layout[1][-1]))
