"""Pure-PyTorch reference of the MoE expert computation (DESIGN.md section 1).

Single process, all experts local. Computes in float32 (float64 when the inputs
are float64) and returns ``y`` in the dtype of ``x``. Differentiable through
autograd with respect to ``x``, ``topk_weights``, ``w1`` and ``w2``. It is the CPU
implementation of ``torch.ops.primemoe.moe_forward`` and the yardstick of every test.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["moe", "moe_backward", "compute_dtype"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _slots(x, topk_idx, topk_weights, w1):
    """Per-slot views shared by forward and backward: (expert id, weight, token) of each slot t*K+k."""
    E = w1.shape[0]
    flat_idx = topk_idx.reshape(-1).long()
    if flat_idx.numel() and (bool((flat_idx < -1).any()) or bool((flat_idx >= E).any())):
        bad = flat_idx[(flat_idx < -1) | (flat_idx >= E)][0].item()
        raise ValueError(f"topk_idx holds expert id {bad}, outside [-1, {E})")
    flat_w = topk_weights.reshape(-1).to(compute_dtype(x.dtype))
    token_of_slot = torch.arange(topk_idx.numel(), device=x.device) // topk_idx.shape[1]
    return flat_idx, flat_w, token_of_slot


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
    E, two_i, _ = w1.shape
    inter = two_i // 2
    acc = compute_dtype(x.dtype)
    flat_idx, flat_w, token_of_slot = _slots(x, topk_idx, topk_weights, w1)

    y = torch.zeros(T, H, dtype=acc, device=x.device)
    xa = x.to(acc)
    # unbind once: indexing w1[e] per expert would make autograd build a full-size
    # gradient per expert.
    w1s, w2s = w1.unbind(0), w2.unbind(0)
    for e in range(E):
        slots = (flat_idx == e).nonzero(as_tuple=True)[0]
        if slots.numel() == 0:
            continue
        tokens = token_of_slot[slots]
        xe = xa.index_select(0, tokens)
        h = xe @ w1s[e].to(acc).t()
        a = F.silu(h[:, :inter]) * h[:, inter:]
        o = a @ w2s[e].to(acc).t()
        y = y.index_add(0, tokens, o * flat_w[slots].unsqueeze(1))
    return y.to(x.dtype)


def moe_backward(dy, x, topk_idx, topk_weights, w1, w2):
    """Gradients of :func:`moe` written out by hand (no autograd, so it can run inside an
    op kernel): returns ``(dx, d_topk_weights fp32, dw1, dw2)``."""
    T, H = x.shape
    K = topk_idx.shape[1]
    E, two_i, _ = w1.shape
    inter = two_i // 2
    acc = compute_dtype(x.dtype)
    flat_idx, flat_w, token_of_slot = _slots(x, topk_idx, topk_weights, w1)
    xa, dya = x.to(acc), dy.to(acc)
    dx = torch.zeros(T, H, dtype=acc, device=x.device)
    d_weights = torch.zeros(T * K, dtype=acc, device=x.device)
    dw1 = torch.zeros(w1.shape, dtype=acc, device=x.device)
    dw2 = torch.zeros(w2.shape, dtype=acc, device=x.device)
    for e in range(E):
        slots = (flat_idx == e).nonzero(as_tuple=True)[0]
        if slots.numel() == 0:
            continue
        tokens = token_of_slot[slots]
        xe, dye = xa.index_select(0, tokens), dya.index_select(0, tokens)
        w1e, w2e = w1[e].to(acc), w2[e].to(acc)
        h = xe @ w1e.t()
        gate, up = h[:, :inter], h[:, inter:]
        sig = torch.sigmoid(gate)
        silu = gate * sig
        a = silu * up
        d_weights[slots] = ((a @ w2e.t()) * dye).sum(1)
        do = dye * flat_w[slots].unsqueeze(1)
        dw2[e] = do.t() @ a
        da = do @ w2e
        dh = torch.cat([da * up * sig * (1 + gate * (1 - sig)), da * silu], dim=1)
        dw1[e] = dh.t() @ xe
        dx.index_add_(0, tokens, dh @ w1e)
    return dx.to(x.dtype), d_weights.view(T, K).float(), dw1.to(w1.dtype), dw2.to(w2.dtype)
