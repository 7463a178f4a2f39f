"""primemoe.baseline.moe on CPU (torch._grouped_mm's CPU fallback) against the fp64 naive loop."""

import pytest
import torch

from ep_harness import prepare_spawn, run_ep_case
from helpers import Outputs, assert_moe_outputs_match, make_problem, run_moe
from naive import composite, naive64

import primemoe
from primemoe import layer


def _cpu_grouped_mm_available() -> bool:
    try:
        a = torch.randn(4, 8, dtype=torch.bfloat16)
        torch._grouped_mm(a, torch.randn(2, 8, 8, dtype=torch.bfloat16), offs=torch.tensor([2, 4], dtype=torch.int32))
        return True
    except (RuntimeError, NotImplementedError):
        return False


# torch >= 2.14 has a CPU fallback for _grouped_mm; older releases (e.g. 2.11 on the
# GPU machine) run the baseline on CUDA only, where tests/gpu covers it.
pytestmark = pytest.mark.skipif(not _cpu_grouped_mm_available(),
                                reason="torch._grouped_mm has no CPU kernel in this torch")

SHAPE = dict(hidden=64, inter=32, experts=8, top_k=4)

CASES = {
    "uniform": dict(tokens=64),
    "skewed": dict(tokens=64, routing="skewed"),
    "masked": dict(tokens=48, routing="masked"),
    "all_skipped": dict(tokens=8, routing="all_skipped"),
    "one_expert": dict(tokens=32, routing="one_expert"),
    "empty_experts": dict(tokens=32, routing="empty_experts"),
    "no_tokens": dict(tokens=0),
    "one_token": dict(tokens=1),
    "int32_ids": dict(tokens=32, routing="masked", idx_dtype=torch.int32),
    "bf16_weights": dict(tokens=32, weight_dtype=torch.bfloat16),
}


@pytest.mark.parametrize("case", CASES)
def test_baseline_matches_reference(case):
    problem = make_problem(**SHAPE, **CASES[case], seed=3)
    out = run_moe(primemoe.baseline.moe, problem)
    assert out.y.dtype == torch.bfloat16
    assert_moe_outputs_match(out, naive64(problem), composite(problem), problem)


# The engine's kernels tile the intermediate size by 256 columns.
ENGINE_SHAPE = dict(hidden=64, inter=256, experts=4, top_k=2)


@pytest.mark.parametrize("engine", [False, True], ids=["grouped_mm", "engine"])
@pytest.mark.parametrize("keep_fc1", [True, False])
@pytest.mark.parametrize("case", ["uniform", "masked", "empty_experts", "no_tokens", "int32_ids"])
def test_cuda_op_path_composition_on_cpu(case, keep_fc1, engine):
    check_composition(case, keep_fc1, engine, layer.ROW_ALIGN)


@pytest.mark.parametrize("engine", [False, True], ids=["grouped_mm", "engine"])
def test_composition_on_a_coarser_layout(engine):
    """row_align = 128 (what the EP receive layout uses; stage_times.py compares the two): same results."""
    check_composition("masked", True, engine, 128)


def check_composition(case, keep_fc1, engine, row_align):
    """The CUDA implementations of moe_forward/moe_backward are the layer's composition over
    LocalTransport, made of primitives that also have CPU kernels: run it here so its wiring is
    checked in CI, not only on a GPU. ``engine``: the expert GEMM engine's ops (fc1_swiglu,
    expert_gemm, fc2_dgrad_swiglu, expert_wgrad) through their CPU kernels; else the
    torch._grouped_mm fallback."""
    shape = dict(SHAPE, **ENGINE_SHAPE) if engine else SHAPE
    if case == "empty_experts" and engine:
        shape = dict(shape, experts=8)
    p = make_problem(**shape, **CASES[case], seed=5)
    E = p.w1.shape[0]
    y, fc1_out, saved = layer.forward(layer.LocalTransport(p.topk_idx, E, row_align), p.x, p.topk_weights, p.w1,
                                      p.w2, keep_fc1=keep_fc1, engine=engine)
    assert saved is None
    assert fc1_out.shape[0] == (p.topk_idx.numel() + E * (row_align - 1) if keep_fc1 else 0)
    grads = layer.backward(layer.LocalTransport(p.topk_idx, E, row_align), p.dy, p.x, p.topk_weights, p.w1, p.w2,
                           fc1_out if keep_fc1 else None, engine=engine)
    assert_moe_outputs_match(Outputs(y, *grads), naive64(p), composite(p), p)


def test_baseline_forward_backward_halves_match_autograd():
    problem = make_problem(**SHAPE, tokens=40, routing="masked", seed=4)
    y, ctx = primemoe.baseline.forward(problem.x, problem.topk_idx, problem.topk_weights, problem.w1, problem.w2)
    dx, dtw, dw1, dw2 = primemoe.baseline.backward(ctx, problem.dy)
    out = run_moe(primemoe.baseline.moe, problem)
    for name, got in dict(y=y, dx=dx, dtw=dtw, dw1=dw1, dw2=dw2).items():
        assert torch.equal(got, getattr(out, name)), name


# Expert parallelism over gloo: the same harness as tests/gpu/test_ep_baseline.py, on CPU.
EP_CASES = {
    "different_T": dict(tokens_per_rank=(12, 5), routing="masked"),
    "one_rank_without_tokens": dict(tokens_per_rank=(0, 9), routing="uniform"),
    "one_expert": dict(tokens_per_rank=(7, 6), routing="one_expert"),
}


@pytest.mark.parametrize("case", EP_CASES)
def test_baseline_expert_parallel_gloo(tmp_path, monkeypatch, case):
    prepare_spawn(monkeypatch, tmp_path)
    run_ep_case(tmp_path, "gloo", shape=(32, 16, 4, 2), seed=5, device="cpu", **EP_CASES[case])
