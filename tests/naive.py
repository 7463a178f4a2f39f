"""Two independent implementations of DESIGN.md section 1 used as yardsticks.

``naive_moe``: deliberately naive, fp64, one token and one slot at a time; no
sorting, no scatter, nothing shared with ``primemoe.reference``.

``composite_bf16``: the plain PyTorch bf16 composite (Hugging Face
``Qwen3MoeSparseMoeBlock`` style: loop over experts, bf16 matmuls and SwiGLU,
routing weight applied in the weights' dtype then cast, bf16 accumulation). Its
error against the fp64 result sets the tolerance of every bf16 path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helpers import Outputs, Problem, run_moe


def naive_moe(x, topk_idx, topk_weights, w1, w2):
    """y[t] = sum_k w[t,k] * w2[e] @ (silu(w1[e,:I] @ x[t]) * (w1[e,I:] @ x[t])), in fp64."""
    x, topk_weights, w1, w2 = (t.double() for t in (x, topk_weights, w1, w2))
    tokens, hidden = x.shape
    inter = w1.shape[1] // 2
    rows = []
    for t in range(tokens):
        y_t = torch.zeros(hidden, dtype=torch.float64, device=x.device)
        for k in range(topk_idx.shape[1]):
            e = int(topk_idx[t, k])
            if e < 0:
                continue
            gate = w1[e, :inter] @ x[t]
            up = w1[e, inter:] @ x[t]
            y_t = y_t + topk_weights[t, k] * (w2[e] @ (F.silu(gate) * up))
        rows.append(y_t)
    return torch.stack(rows) if rows else x.new_zeros(0, hidden)


def naive64(problem: Problem) -> Outputs:
    """y and the four gradients of ``naive_moe`` by autograd on fp64 leaves."""
    return run_moe(naive_moe, problem, dtype=torch.float64)


def composite_bf16(x, topk_idx, topk_weights, w1, w2):
    """The PyTorch composite in the inputs' dtype (bf16), differentiable by autograd."""
    inter = w1.shape[1] // 2
    y = torch.zeros_like(x)
    # unbind, not w1[e]: its backward stacks the per-expert grads once instead of one full-size zeros per expert.
    for e, (w1_e, w2_e) in enumerate(zip(w1.unbind(0), w2.unbind(0))):
        token, slot = torch.where(topk_idx == e)
        if token.numel() == 0:
            continue
        x_e = x[token]
        hidden = F.silu(F.linear(x_e, w1_e[:inter])) * F.linear(x_e, w1_e[inter:])
        out = F.linear(hidden, w2_e) * topk_weights[token, slot, None]
        y = y.index_add(0, token, out.to(x.dtype))
    return y


def composite(problem: Problem) -> Outputs:
    return run_moe(composite_bf16, problem)
