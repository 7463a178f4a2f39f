"""A small forward+backward through every primemoe CUDA kernel of the single-GPU layer, for compute-sanitizer
(and the GPU runner's smoke step).

    python scripts/sanitize_case.py [T H I E K [CLAIM MERGE]]     (default 77 256 256 8 4)

The GEMM configuration is the heuristics' choice for the sizes (the default case: the static order with split half
tiles; `450 3072 1536 3 2`: experts' weights above 8 MiB and more tiles than SMs, so FC1 and FC2 claim tiles and
merge tails), or, with CLAIM MERGE, forced for the forward's GEMMs: `600 256 256 4 2 1 1` runs 192-row tiles
(300 rows per expert) at a small size."""
import sys

import torch

import primemoe

torch.manual_seed(0)
# I and H multiples of 256: the expert GEMM engine's kernels run (not the torch._grouped_mm fallback)
T, H, I, E, K = (int(v) for v in sys.argv[1:6]) if len(sys.argv) > 1 else (77, 256, 256, 8, 4)
if len(sys.argv) > 6:  # CLAIM MERGE (0/1): the forward GEMMs' GemmConfig forced (this thread's launches only)
    torch.ops.primemoe._gemm_force_config(int(sys.argv[6]), int(sys.argv[7]))
why = torch.ops.primemoe.expert_gemm_unsupported(torch.cuda.current_device(), H, I)
assert not why, f"the engine does not cover this case ({why}): the sanitizer would not see it"
x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
topk_idx, topk_weights = primemoe.route(torch.randn(T, E, device="cuda"), K)
topk_idx[3, 1] = -1
topk_weights.requires_grad_()
w1 = (torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5).requires_grad_()
w2 = (torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5).requires_grad_()
y = primemoe.moe(x, topk_idx, topk_weights, w1, w2)
y.backward(torch.randn_like(y))
# A layout of a subset of the experts (the expert-parallel form: expert_begin, num_local, row_align 128).
layout = torch.ops.primemoe.dispatch_layout(topk_idx.int(), E, min(2, E - 1), min(4, E - min(2, E - 1)), 128)
torch.cuda.synchronize()
primemoe.check_errors()
print("sanitize case ok", float(y.float().norm()), int(layout[1][-1]))
