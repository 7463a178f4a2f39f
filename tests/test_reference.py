"""primemoe.reference.moe against the independent naive fp64 loop (tests/naive.py)."""

import pytest
import torch

from helpers import OUTPUT_NAMES, make_problem, run_moe
from naive import naive64

import primemoe

SHAPE = dict(hidden=16, inter=8, experts=6, top_k=3)

CASES = {
    "uniform": dict(tokens=24),
    "masked": dict(tokens=24, routing="masked"),
    "all_skipped": dict(tokens=5, routing="all_skipped"),
    "no_tokens": dict(tokens=0),
    "one_token": dict(tokens=1),
    "empty_experts": dict(tokens=24, routing="empty_experts"),
    "one_expert": dict(tokens=24, routing="one_expert"),
    "skewed": dict(tokens=24, routing="skewed"),
    "int32_ids": dict(tokens=24, routing="masked", idx_dtype=torch.int32),
    "bf16_weights": dict(tokens=24, weight_dtype=torch.bfloat16),
}


def assert_matches_naive(out, ref):
    for name in OUTPUT_NAMES:
        got, want = getattr(out, name), getattr(ref, name)
        # fp64 everywhere except bf16 topk_weights, whose gradient autograd returns in bf16.
        tol = dict(rtol=1e-10, atol=1e-10) if got.dtype == torch.float64 else {}
        torch.testing.assert_close(got, want.to(got.dtype), **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_naive(case):
    problem = make_problem(**SHAPE, **CASES[case], dtype=torch.float64, seed=1)
    out = run_moe(primemoe.reference.moe, problem)
    assert out.y.dtype == torch.float64 and out.y.shape == problem.x.shape
    assert_matches_naive(out, naive64(problem))


def test_reference_bf16_inputs_accumulate_in_fp32():
    problem = make_problem(**SHAPE, tokens=24, seed=2)
    y = primemoe.reference.moe(problem.x, problem.topk_idx, problem.topk_weights, problem.w1, problem.w2)
    assert y.dtype == torch.bfloat16
    # fp32 accumulation then one rounding: within one bf16 ulp of the fp64 result.
    torch.testing.assert_close(y, naive64(problem).y.to(torch.bfloat16), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("bad_id", [6, 100, -2])
def test_reference_rejects_out_of_range_ids(bad_id):
    problem = make_problem(**SHAPE, tokens=4, dtype=torch.float64)
    problem.topk_idx[2, 1] = bad_id
    with pytest.raises(ValueError, match=f"expert id {bad_id}"):
        primemoe.reference.moe(problem.x, problem.topk_idx, problem.topk_weights, problem.w1, problem.w2)
