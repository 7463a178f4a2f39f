"""Pure-PyTorch reference of the MoE expert computation (DESIGN.md section 1).

Single process, all experts local. Computes in float32 (float64 when the inputs
are float64) and returns ``y`` in the dtype of ``x``. Differentiable through
autograd with respect to ``x``, ``topk_weights``, ``w1`` and ``w2``. It is the CPU
implementation of ``torch.ops.primemoe.moe_forward`` and the yardstick of every test.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["moe", "compute_dtype"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def moe(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """y[t] = sum_k w[t,k] * w2[e] @ (silu(w1[e,:I] @ x[t]) * (w1[e,I:] @ x[t])).

    Slots with ``topk_idx == -1`` add nothing. Ids outside ``[-1, E)`` raise.
    """
    T, H = x.shape
    K = topk_idx.shape[1]
    E, two_i, _ = w1.shape
    inter = two_i // 2
    acc = compute_dtype(x.dtype)

    flat_idx = topk_idx.reshape(-1).long()
    if flat_idx.numel() and (bool((flat_idx < -1).any()) or bool((flat_idx >= E).any())):
        bad = flat_idx[(flat_idx < -1) | (flat_idx >= E)][0].item()
        raise ValueError(f"topk_idx holds expert id {bad}, outside [-1, {E})")
    flat_w = topk_weights.reshape(-1).to(acc)
    token_of_slot = torch.arange(T * K, device=x.device) // K

    y = torch.zeros(T, H, dtype=acc, device=x.device)
    xa = x.to(acc)
    for e in range(E):
        slots = (flat_idx == e).nonzero(as_tuple=True)[0]
        if slots.numel() == 0:
            continue
        tokens = token_of_slot[slots]
        xe = xa.index_select(0, tokens)
        h = xe @ w1[e].to(acc).t()
        a = F.silu(h[:, :inter]) * h[:, inter:]
        o = a @ w2[e].to(acc).t()
        y = y.index_add(0, tokens, o * flat_w[slots].unsqueeze(1))
    return y.to(x.dtype)
