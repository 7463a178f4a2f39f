"""The Qwen3-MoE router: fp32 softmax, top-k, optional renormalisation."""

from __future__ import annotations

import torch

__all__ = ["route"]


def route(logits: torch.Tensor, top_k: int, *, norm_topk_prob: bool = True):
    """Return ``(topk_idx int64 [T, K], topk_weights fp32 [T, K])`` for router ``logits [T, E]``.

    Matches Hugging Face ``Qwen3MoeSparseMoeBlock``: probabilities are a float32
    softmax over all experts; the top-k are renormalised to sum to one when
    ``norm_topk_prob`` is set. Weights stay float32 (the layer applies them in fp32).
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits: expected a 2-D tensor [T, E], got {_describe(logits)}")
    if not logits.is_floating_point():
        raise TypeError(f"logits: expected a floating dtype, got {logits.dtype}")
    num_experts = logits.shape[1]
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: expected an int in [1, {num_experts}], got {top_k!r}")
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_idx, topk_weights


def _describe(obj) -> str:
    if isinstance(obj, torch.Tensor):
        return f"shape {tuple(obj.shape)}"
    return type(obj).__name__
