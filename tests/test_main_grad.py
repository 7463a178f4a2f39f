"""Gradient-accumulation fusion (issue 40): weights carrying an fp32 ``main_grad`` (Megatron's convention) get their
gradients added into it by the backward and no ``.grad``; on the CPU through the ops' CPU kernels, over one rank of
the CPU model of a Buffer, and through ``primemoe.nn.MoE``. The GPU run (the weight-gradient GEMM's accumulating
epilogue) is tests/gpu/test_moe_gpu.py's."""

import pytest
import torch

from helpers import make_problem

import primemoe
from primemoe import layer

SHAPE = (64, 32, 8, 2)  # H, I, E, K


def _leaves(problem):
    return [t.detach().clone().requires_grad_() for t in (problem.x, problem.topk_weights, problem.w1, problem.w2)]


def _plain_grads(problem, precision="bf16"):
    x, tw, w1, w2 = _leaves(problem)
    y = primemoe.moe(x, problem.topk_idx, tw, w1, w2, precision=precision)
    y.backward(problem.dy)
    return y.detach(), x.grad, tw.grad, w1.grad, w2.grad


@pytest.mark.parametrize("precision", ["bf16", "fp8_bwd"])
def test_main_grads_take_the_weight_gradients(precision):
    """Two backwards add up in main_grad (started non-zero), w2 (a plain main_grad) gets no .grad, w1 (with
    Megatron's grad_added_to_main_grad and zero_out_wgrad) a zero placeholder and the flag set; x and topk_weights
    get theirs as before."""
    H, I, E, K = (128, 128, 4, 2) if precision != "bf16" else SHAPE
    problem = make_problem(37, H, I, E, K, routing="masked", seed=3)
    y0, dx0, dtw0, dw1, dw2 = _plain_grads(problem, precision)
    x, tw, w1, w2 = _leaves(problem)
    start = [torch.randn(w.shape) for w in (w1, w2)]
    w1.main_grad, w2.main_grad = (s.clone() for s in start)
    w1.grad_added_to_main_grad, w1.zero_out_wgrad = False, True
    for _ in range(2):
        y = primemoe.moe(x, problem.topk_idx, tw, w1, w2, precision=precision)
        y.backward(problem.dy)
    assert w2.grad is None and w1.grad is not None and not w1.grad.any()
    assert w1.grad_added_to_main_grad is True and not hasattr(w2, "grad_added_to_main_grad")
    assert torch.equal(y.detach(), y0)
    torch.testing.assert_close(x.grad, 2 * dx0)
    for main_grad, s, dw in zip((w1.main_grad, w2.main_grad), start, (dw1, dw2)):
        # dw is rounded to bf16, the main gradient is not (the FP8 reference's is fp32 until then).
        scale = float(dw.abs().max())
        torch.testing.assert_close(main_grad - s, 2 * dw.float(), rtol=2 ** -7, atol=2 ** -7 * scale)


def test_one_main_grad_only():
    problem = make_problem(20, *SHAPE, seed=4)
    _, _, _, dw1, dw2 = _plain_grads(problem)
    x, tw, w1, w2 = _leaves(problem)
    w2.main_grad = torch.zeros(w2.shape)
    primemoe.moe(x, problem.topk_idx, tw, w1, w2).backward(problem.dy)
    assert torch.equal(w1.grad, dw1) and w2.grad is None
    torch.testing.assert_close(w2.main_grad, dw2.float())


@pytest.mark.parametrize("bad, error, match", [
    (lambda w: torch.zeros(w.shape, dtype=torch.bfloat16), ValueError, "w1.main_grad: expected a float32 tensor"),
    (lambda w: torch.zeros(w.shape[0], w.shape[1], w.shape[2] + 1), ValueError, "of w1's shape"),
    (lambda w: w.shape, TypeError, "w1.main_grad: expected a tensor"),
])
def test_a_bad_main_grad_is_refused_at_the_forward(bad, error, match):
    problem = make_problem(5, *SHAPE, seed=5)
    x, tw, w1, w2 = _leaves(problem)
    w1.main_grad = bad(w1)
    with pytest.raises(error, match=match):
        primemoe.moe(x, problem.topk_idx, tw, w1, w2)


def test_no_tokens_adds_nothing():
    problem = make_problem(0, *SHAPE, seed=6)
    x, tw, w1, w2 = _leaves(problem)
    w1.main_grad, w2.main_grad = torch.ones(w1.shape), torch.ones(w2.shape)
    y = primemoe.moe(x, problem.topk_idx, tw, w1, w2)
    if y.requires_grad:
        y.backward(problem.dy)
    assert (w1.main_grad == 1).all() and (w2.main_grad == 1).all()


def test_nn_moe_attach_main_grads():
    torch.manual_seed(0)
    H, I, E, K = SHAPE
    module = primemoe.nn.MoE(H, I, E, K)
    module.attach_main_grads()
    x = torch.randn(3, 5, H, dtype=torch.bfloat16)
    module(x).float().square().sum().backward()
    assert module.w1.grad is None and module.w2.grad is None and module.gate.weight.grad is not None
    assert module.w1.main_grad.dtype == torch.float32 and module.w1.main_grad.abs().sum() > 0
    assert module.w2.main_grad.abs().sum() > 0


def test_expert_backward_adds_into_main_grads_on_the_engine_ops():
    """The composition on the engine's ops (their CPU kernels): expert_wgrad_accumulate instead of expert_wgrad."""
    from engine_cases import engine_operands

    e = engine_operands([3, 0, 130, 64], hidden=256, inter=256, seed=7)
    plain = layer.expert_backward([e.xs, e.h, e.dy_rows], e.row_weight, e.w1, e.w2, e.offsets, e.counts, True)
    main_grads = (torch.zeros(e.w1.shape), torch.zeros(e.w2.shape))
    fused = layer.expert_backward([e.xs, e.h, e.dy_rows], e.row_weight, e.w1, e.w2, e.offsets, e.counts, True,
                                  main_grads=main_grads)
    assert fused[1] is None and fused[2] is None
    assert torch.equal(fused[0], plain[0]) and torch.equal(fused[3], plain[3])
    for main_grad, dw in zip(main_grads, (plain[1], plain[2])):
        # The engine's dw is the same fp32 sum rounded to bf16.
        torch.testing.assert_close(main_grad.bfloat16(), dw, rtol=0, atol=0)
