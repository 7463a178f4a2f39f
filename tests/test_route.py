"""primemoe.route against the Hugging Face Qwen3-MoE router formula, written out by hand."""

import pytest
import torch

import primemoe


def hf_qwen3_router(logits, top_k, norm_topk_prob):
    """Qwen3MoeSparseMoeBlock: fp32 softmax over all experts, top-k (descending), optional renormalisation."""
    probs = logits.double().softmax(dim=-1).float()
    order = probs.argsort(dim=-1, descending=True, stable=True)[:, :top_k]
    weights = probs.gather(1, order)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return order, weights


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens, experts, top_k", [(40, 8, 2), (16, 128, 8), (3, 4, 4), (0, 8, 2)])
def test_route_matches_hf_formula(tokens, experts, top_k, dtype, norm_topk_prob):
    # A random permutation of evenly spaced values per token: exact in bf16 and free of ties,
    # so the top-k choice and order are unambiguous.
    gen = torch.Generator().manual_seed(tokens * experts + top_k)
    ranks = torch.rand(tokens, experts, generator=gen).argsort(dim=-1).float()
    logits = (ranks * (8 / experts) - 4).to(dtype)
    topk_idx, topk_weights = primemoe.route(logits, top_k, norm_topk_prob=norm_topk_prob)
    want_idx, want_weights = hf_qwen3_router(logits, top_k, norm_topk_prob)
    assert topk_idx.dtype == torch.int64 and topk_weights.dtype == torch.float32
    assert topk_idx.shape == topk_weights.shape == (tokens, top_k)
    assert torch.equal(topk_idx, want_idx)
    torch.testing.assert_close(topk_weights, want_weights, rtol=1e-6, atol=1e-7)
    if norm_topk_prob and tokens:
        torch.testing.assert_close(topk_weights.sum(-1), torch.ones(tokens))


def test_route_without_renormalisation_keeps_the_softmax_probabilities():
    logits = torch.randn(10, 16)
    topk_idx, topk_weights = primemoe.route(logits, 4, norm_topk_prob=False)
    probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(topk_weights, probs.gather(1, topk_idx))
    assert bool((topk_weights.sum(-1) < 1).all())


@pytest.mark.parametrize("logits, top_k, error, match", [
    (torch.randn(8), 2, ValueError, "logits"),
    (torch.randn(2, 3, 8), 2, ValueError, "logits"),
    ([[0.0, 1.0]], 1, ValueError, "logits"),
    (torch.randint(0, 5, (4, 8)), 2, TypeError, "logits"),
    (torch.randn(4, 8), 0, ValueError, "top_k"),
    (torch.randn(4, 8), 9, ValueError, "top_k"),
    (torch.randn(4, 8), 2.0, ValueError, "top_k"),
], ids=["1d", "3d", "list", "int_logits", "top_k_0", "top_k_above_E", "top_k_float"])
def test_route_rejects_bad_arguments(logits, top_k, error, match):
    with pytest.raises(error, match=match):
        primemoe.route(logits, top_k)
