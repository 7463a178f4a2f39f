"""primemoe.moe (CUDA op path) and primemoe.baseline.moe against the fp64 reference on the GPU
(DESIGN.md section 6): awkward sizes, skewed and masked routing, the reference shapes,
bitwise repeatability, poisoned memory, CUDA-graph replay and torch.compile."""

import functools
import math
from dataclasses import replace

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from helpers import (OUTPUT_NAMES, REFERENCE_SHAPES, ROUTINGS, ExpertLayer, Outputs, assert_close_to_reference,
                     assert_contract_zeros, assert_error_within, assert_moe_outputs_match, assert_outputs_equal,
                     graph_replays, make_problem, poison_caching_allocator, reference64, run_module, run_moe)
from naive import composite

import primemoe
from primemoe import layer

pytestmark = pytest.mark.gpu

SMALL = (256, 256, 8, 2)  # H, I, E, K: the smallest sizes the expert GEMM engine's tiles cover
IMPLS = {
    "primemoe": primemoe.moe,
    "primemoe_recompute_fc1": functools.partial(primemoe.moe, keep_fc1=False),
    "baseline": primemoe.baseline.moe,
}


def small_problem(tokens, routing="uniform", seed=0, **kwargs):
    return make_problem(tokens, *SMALL, routing=routing, seed=seed, device="cuda", **kwargs)


def check_against_reference(fn, problem):
    assert_moe_outputs_match(run_moe(fn, problem), reference64(problem), composite(problem), problem)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens", [0, 1, 17, 4095])
@pytest.mark.parametrize("impl", IMPLS)
def test_small_shape_matches_reference(impl, tokens, routing):
    check_against_reference(IMPLS[impl], small_problem(tokens, routing, seed=tokens))


def fallback_outputs(problem):
    """Forward and backward of the layer's composition (moe_forward / moe_backward on CUDA) with the
    engine turned off: the expert GEMMs on torch._grouped_mm."""
    E = problem.w1.shape[0]
    y, fc1_out, _ = layer.forward(layer.LocalTransport(problem.topk_idx, E), problem.x, problem.topk_weights,
                                  problem.w1, problem.w2, engine=False)
    dx, dtw, dw1, dw2 = layer.backward(layer.LocalTransport(problem.topk_idx, E), problem.dy, problem.x,
                                       problem.topk_weights, problem.w1, problem.w2, fc1_out, engine=False)
    return Outputs(y, dx, dtw.to(problem.topk_weights.dtype), dw1, dw2)


@pytest.mark.parametrize("routing", ["uniform", "skewed", "masked"])
@pytest.mark.parametrize("tokens", [17, 4095])
def test_grouped_mm_fallback_matches_reference(tokens, routing):
    """The composition with the engine turned off (as for sizes the engine does not tile: the next test)
    runs on torch._grouped_mm."""
    problem = small_problem(tokens, routing, seed=tokens + 1)
    assert_moe_outputs_match(fallback_outputs(problem), reference64(problem), composite(problem), problem)


@pytest.mark.parametrize("tokens", [17, 4095])
def test_engine_untiled_sizes_fall_back(tokens):
    check_against_reference(primemoe.moe, make_problem(tokens, 256, 128, 8, 2, routing="skewed", seed=3,
                                                       device="cuda"))


@pytest.mark.parametrize("tokens", [17, 4095])
@pytest.mark.parametrize("impl", IMPLS)
def test_int32_ids(impl, tokens):
    check_against_reference(IMPLS[impl], small_problem(tokens, "masked", seed=1, idx_dtype=torch.int32))


@pytest.mark.parametrize("tokens", [17, 4095])
@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_topk_weights(impl, tokens):
    check_against_reference(IMPLS[impl], small_problem(tokens, "skewed", seed=2, weight_dtype=torch.bfloat16))


# ---------------------------------------------------------------- the reference shapes


def check_against_reference_by_expert_chunks(out, problem, chunk):
    """The tolerance rule with the fp64 reference computed ``chunk`` experts at a time:
    fp64 copies of DeepSeek-V3's weights and their gradients (~180 GB) do not fit on one GPU.
    y, dx and d_topk_weights are sums over experts (summed over the chunks); an expert's dw
    depends on its own slots only (compared chunk by chunk, squared norms summed)."""
    comp = composite(problem)
    num_experts = problem.w1.shape[0]
    ref_sum = {name: 0.0 for name in ("y", "dx", "dtw")}
    squares = {name: [0.0, 0.0, 0.0] for name in ("dw1", "dw2")}  # ||out-ref||^2, ||comp-ref||^2, ||ref||^2
    for begin in range(0, num_experts, chunk):
        experts = slice(begin, begin + chunk)
        ids = problem.topk_idx.long()
        in_chunk = (ids >= begin) & (ids < begin + chunk)
        part = reference64(replace(problem, topk_idx=torch.where(in_chunk, ids - begin, -1),
                                   w1=problem.w1[experts], w2=problem.w2[experts]))
        for name in ref_sum:
            ref_sum[name] = ref_sum[name] + getattr(part, name)
        for name, acc in squares.items():
            ref = getattr(part, name)
            acc[0] += torch.linalg.vector_norm(getattr(out, name)[experts].double() - ref).item() ** 2
            acc[1] += torch.linalg.vector_norm(getattr(comp, name)[experts].double() - ref).item() ** 2
            acc[2] += torch.linalg.vector_norm(ref).item() ** 2
        del part
    for name, ref in ref_sum.items():
        assert_close_to_reference(name, getattr(out, name), ref, getattr(comp, name))
    for name, (out_sq, comp_sq, ref_sq) in squares.items():
        assert_error_within(name, math.sqrt(out_sq), math.sqrt(comp_sq), math.sqrt(ref_sq))
    assert_contract_zeros(out, problem.topk_idx, num_experts)


@pytest.mark.parametrize("routing", ["uniform", "skewed", "masked"])
@pytest.mark.parametrize("shape", REFERENCE_SHAPES)
@pytest.mark.parametrize("impl", ["primemoe", "baseline"])
def test_reference_shape_matches_reference(impl, shape, routing):
    # DeepSeek-V3's bf16 weights alone are 22.5 GB (fp64 copies and gradients would not fit: see the chunks).
    tokens = 128 if shape == "deepseek-v3" else 256
    problem = make_problem(tokens, *REFERENCE_SHAPES[shape], routing=routing, seed=3, device="cuda")
    out = run_moe(IMPLS[impl], problem)
    check_against_reference_by_expert_chunks(out, problem, chunk=16)


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_qwen3_30b_at_16384_tokens_matches_reference(routing):
    problem = make_problem(16384, *REFERENCE_SHAPES["qwen3-30b-a3b"], routing=routing, seed=9, device="cuda")
    out = run_moe(primemoe.moe, problem)
    check_against_reference_by_expert_chunks(out, problem, chunk=16)


@pytest.mark.parametrize("shape", REFERENCE_SHAPES)
def test_reference_shape_all_to_one_expert(shape):
    """Every slot to the last expert: one expert's rows are all of T * K, the other experts have none."""
    tokens = 128 if shape == "deepseek-v3" else 256
    problem = make_problem(tokens, *REFERENCE_SHAPES[shape], routing="one_expert", seed=5, device="cuda")
    out = run_moe(primemoe.moe, problem)
    check_against_reference_by_expert_chunks(out, problem, chunk=16)


@pytest.mark.parametrize("routing", ["skewed", "one_expert"])
def test_qwen3_235b_at_4095_tokens_matches_reference(routing):
    """The benchmark's 235B path at an odd T: claimed tiles, and where experts end in a partial block (skewed),
    FC1's and FC2's 192-row tiles; one_expert is a single expert of 32,760 rows."""
    problem = make_problem(4095, *REFERENCE_SHAPES["qwen3-235b-a22b"], routing=routing, seed=11, device="cuda")
    out = run_moe(primemoe.moe, problem)
    check_against_reference_by_expert_chunks(out, problem, chunk=16)


# ---------------------------------------------------------------- determinism and overwrite


@pytest.mark.parametrize("case", [(4095, "uniform", SMALL), (4095, "skewed", SMALL), (4095, "masked", SMALL),
                                  (256, "uniform", REFERENCE_SHAPES["qwen3-30b-a3b"])],
                         ids=["small-uniform", "small-skewed", "small-masked", "qwen3-30b-a3b"])
def test_bitwise_repeatable(case):
    tokens, routing, shape = case
    problem = make_problem(tokens, *shape, routing=routing, seed=4, device="cuda")
    first = run_moe(primemoe.moe, problem)
    for _ in range(2):
        assert_outputs_equal(run_moe(primemoe.moe, problem), first, "a repeated run")


@pytest.mark.parametrize("routing", ["masked", "skewed", "empty_experts"])
@pytest.mark.parametrize("impl", ["primemoe", "primemoe_recompute_fc1", "baseline"])
def test_poisoned_memory_is_fully_overwritten(impl, routing):
    problem = small_problem(4095, routing, seed=5)
    clean = run_moe(IMPLS[impl], problem)
    poison_caching_allocator()
    poisoned = run_moe(IMPLS[impl], problem)
    for name in OUTPUT_NAMES:
        assert not getattr(poisoned, name).isnan().any(), f"{name}: NaN from poisoned memory"
    assert_outputs_equal(poisoned, clean, "a run on poisoned memory")


@pytest.mark.parametrize("routing", ["masked", "skewed", "empty_experts"])
def test_fc1_out_on_poisoned_memory_is_the_cpu_ops(routing):
    """The GEMMs skip the rows past the routed ones, and fc1_out's are zeroed apart: the caller gets no
    undefined row, the routed ones as the CPU op computes them."""
    problem = small_problem(4095, routing, seed=9)
    args = (problem.x, problem.topk_idx, problem.topk_weights, problem.w1, problem.w2, "bf16", True)
    poison_caching_allocator()
    _, fc1_out = torch.ops.primemoe.moe_forward(*args)
    _, want = torch.ops.primemoe.moe_forward(*(a.cpu() if torch.is_tensor(a) else a for a in args))
    E = problem.w1.shape[0]
    routed = int(torch.ops.primemoe.dispatch_layout(problem.topk_idx, E, 0, E, 64)[1][-1])
    assert 0 < routed < fc1_out.shape[0]
    assert not fc1_out[routed:].view(torch.int16).any(), "fc1_out: a row past the routed ones is not zero"
    assert not fc1_out.isnan().any()
    torch.testing.assert_close(fc1_out.cpu().float(), want.float(), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------- CUDA graphs and torch.compile


def test_cuda_graph_replay_matches_eager():
    routings = ["uniform", "skewed", "masked", "one_expert"]
    replays = [small_problem(1000, routing, seed=seed) for seed, routing in enumerate(routings, start=7)]
    results = graph_replays(primemoe.moe, small_problem(1000, "uniform", seed=6), replays)
    for routing, (replayed, eager) in zip(routings, results):
        for name in OUTPUT_NAMES:
            assert torch.equal(getattr(replayed, name), getattr(eager, name)), (
                f"{name}: graph replay ({routing}) != eager")


# Over 8 MiB of weights per expert (FC1 and FC1 dgrad: 2 x 1536 x 2048 bf16), so those GEMMs claim their
# tiles from a counter (grouped_gemm.cu, choose_gemm_config) zeroed on the stream.
CLAIMING = (2048, 1536, 6, 2)


@pytest.mark.parametrize("routing", ["skewed", "one_expert"])
def test_claimed_tile_order_matches_reference(routing):
    check_against_reference(primemoe.moe, make_problem(700, *CLAIMING, routing=routing, seed=30, device="cuda"))


def test_cuda_graph_replay_matches_eager_with_claimed_tiles():
    """Each replay must zero the claim counter again, or its GEMMs would skip tiles. 4096 tokens: FC1's
    ~800 tiles give each CTA several claims, so both slots of the index handoff come round again."""
    routings = ["uniform", "skewed", "masked", "one_expert"]
    replays = [make_problem(4096, *CLAIMING, routing=routing, seed=seed, device="cuda")
               for seed, routing in enumerate(routings, start=21)]
    results = graph_replays(primemoe.moe, make_problem(4096, *CLAIMING, routing="uniform", seed=20, device="cuda"),
                            replays)
    for routing, (replayed, eager) in zip(routings, results):
        for name in OUTPUT_NAMES:
            assert torch.equal(getattr(replayed, name), getattr(eager, name)), (
                f"{name}: graph replay ({routing}) != eager")


@pytest.mark.parametrize("tokens", [17, 4095])
def test_torch_compile_matches_eager(tokens):
    """Default backend (inductor), fullgraph: one graph, same bits as eager."""
    torch._dynamo.reset()
    problem = small_problem(tokens, "masked", seed=11)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(ExpertLayer(problem.w1, problem.w2), backend=counter, fullgraph=True)
    got = run_module(compiled, problem)
    assert counter.frame_count == 1, "expected exactly one graph (no graph break)"
    assert_outputs_equal(got, run_module(ExpertLayer(problem.w1, problem.w2), problem), "torch.compile vs eager")


# ---------------------------------------------------------------- CUDA-only input checks


def test_cuda_rejects_hidden_not_multiple_of_8():
    p = make_problem(4, 12, 16, 4, 2, device="cuda")
    with pytest.raises(ValueError, match="x: hidden size H=12"):
        primemoe.moe(p.x, p.topk_idx, p.topk_weights, p.w1, p.w2)


def test_cuda_rejects_intermediate_not_multiple_of_8():
    p = make_problem(4, 16, 12, 4, 2, device="cuda")
    with pytest.raises(ValueError, match="w1: intermediate size I=12"):
        primemoe.moe(p.x, p.topk_idx, p.topk_weights, p.w1, p.w2)


def test_cuda_rejects_fp32_activations():
    p = make_problem(4, 16, 16, 4, 2, device="cuda", dtype=torch.float32)
    with pytest.raises(TypeError, match="x: expected dtype bfloat16 on CUDA"):
        primemoe.moe(p.x, p.topk_idx, p.topk_weights, p.w1, p.w2)


@pytest.mark.parametrize("name", ["topk_idx", "topk_weights", "w1", "w2"])
def test_cuda_rejects_argument_on_cpu(name):
    p = small_problem(8)
    args = dict(x=p.x, topk_idx=p.topk_idx, topk_weights=p.topk_weights, w1=p.w1, w2=p.w2)
    args[name] = args[name].cpu()
    with pytest.raises(ValueError, match=f"{name}: expected device cuda"):
        primemoe.moe(**args)


def test_debug_mode_checks_ids_before_any_kernel(monkeypatch):
    monkeypatch.setenv("PRIMEMOE_DEBUG", "1")
    p = small_problem(8)
    p.topk_idx[6, 1] = 999
    with pytest.raises(ValueError, match=r"topk_idx\[6, 1\] = 999"):
        primemoe.moe(p.x, p.topk_idx, p.topk_weights, p.w1, p.w2)
    primemoe.check_errors()  # nothing ran, so nothing was recorded


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("keep_fc1", [True, False])
def test_main_grads_on_the_gpu(precision, keep_fc1):
    """Weights with fp32 main gradients: the weight-gradient GEMMs add into them (bf16: its accumulating epilogue;
    fp8: the GEMM's fp32 result added by a pass), w1 / w2 get no .grad, everything else unchanged; two backwards
    sum; into zeros, main_grad rounded to bf16 is the plain gradient bit for bit (bf16: the same accumulator)."""
    problem = make_problem(4095, *SMALL, routing="skewed", seed=21, device="cuda")
    moe = functools.partial(primemoe.moe, keep_fc1=keep_fc1, precision=precision)
    plain = run_moe(moe, problem)
    leaves = [t.detach().clone().requires_grad_() for t in (problem.x, problem.topk_weights, problem.w1, problem.w2)]
    x, tw, w1, w2 = leaves
    w1.main_grad, w2.main_grad = torch.zeros(w1.shape, device="cuda"), torch.zeros(w2.shape, device="cuda")
    moe(x, problem.topk_idx, tw, w1, w2).backward(problem.dy)
    assert w1.grad is None and w2.grad is None
    assert torch.equal(x.grad, plain.dx) and torch.equal(tw.grad, plain.dtw)
    for main_grad, dw in ((w1.main_grad, plain.dw1), (w2.main_grad, plain.dw2)):
        assert torch.equal(main_grad.bfloat16(), dw)
    once = [w1.main_grad.clone(), w2.main_grad.clone()]
    moe(x, problem.topk_idx, tw, w1, w2).backward(problem.dy)
    for main_grad, first in zip((w1.main_grad, w2.main_grad), once):
        assert torch.equal(main_grad, 2 * first)  # the same fp32 sums again: doubling is exact
    primemoe.check_errors()
