"""precision="fp8" / "fp8_bwd" on the CPU: the layer's FP8 composition (layer.forward / backward, what
moe_forward / moe_backward run on CUDA) through the FP8 ops' CPU kernels against the FP8-emulating reference
(reference.moe_fp8 / moe_fp8_backward), the same over the buffer= path (the CPU model of a Buffer), the op
path on the CPU (which is that reference), the fp8_expert_gemm / fp8_expert_wgrad CPU kernels and fakes, the
weight cache, the argument checks, and torch.compile through the fakes.

The composition's FP8 steps and the reference's round at the same points (reference._FP8_SPEC); the CPU
kernels compute each GEMM in float64 and round it once to float32, as the reference does, so the only
difference is the float64 summation order, which can flip a float32 (then bf16) rounding once in a long
while: near-bitwise (relative error <= 1e-6, >= 99.9% of the values equal). "fp8_bwd"'s pre-activations are
the bf16 forward's, which the bf16 engine's CPU kernels compute in float32 (the reference in float64): a few
bf16 values of h differ by an ulp, so its gradients are compared at 1e-3 (its forward is bitwise the bf16
path's).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

from helpers import OUTPUT_NAMES, Outputs, make_problem, reference64, run_moe

import primemoe
from primemoe import fp8, layer
from primemoe._constants import FP8_ROW_ALIGN, ROW_ALIGN, layout_max_rows
from primemoe.reference import moe_fp8

ops = torch.ops.primemoe
E4M3 = torch.float8_e4m3fn

H, I, E, K = 256, 128, 4, 2  # the smallest sizes with two 128-wide tiles along H
FP8_TOL = {"y": 0.10, "dx": 0.10, "dtw": 0.13, "dw1": 0.10, "dw2": 0.10}  # against fp64 (tests/test_fp8.py)


def rel_err(got, want) -> float:
    den = torch.linalg.vector_norm(want.double()).item()
    num = torch.linalg.vector_norm(got.double() - want.double()).item()
    return num / den if den else num


def assert_near_bitwise(got: Outputs, want: Outputs, names=OUTPUT_NAMES, tol=1e-6, equal=0.999):
    for name in names:
        g, w = getattr(got, name), getattr(want, name)
        assert g.shape == w.shape, f"{name}: {tuple(g.shape)} != {tuple(w.shape)}"
        assert not g.isnan().any(), f"{name}: NaN"
        assert rel_err(g, w) <= tol, f"{name}: relative error {rel_err(g, w):.3e} > {tol:g}"
        if equal:
            share = (g.to(w.dtype) == w).float().mean().item() if g.numel() else 1.0
            assert share >= equal, f"{name}: only {share:.4%} of the values equal"


def reference_outputs(problem, precision) -> Outputs:
    """moe_fp8 with autograd: gradients in the inputs' dtypes (as primemoe.moe returns them)."""
    return run_moe(partial(moe_fp8, fp8_forward=precision == "fp8"), problem)


def composition(problem, precision, *, keep_fc1=True, engine=True):
    """Forward and backward of the layer's composition over LocalTransport, as moe_forward / moe_backward's CUDA
    impls run it (layouts from forward_row_align / backward_row_align), on the ops' CPU kernels. Returns the
    outputs (gradients in the inputs' dtypes) and fc1_out."""
    p = problem
    E = p.w1.shape[0]
    fwd = layer.LocalTransport(p.topk_idx, E, layer.forward_row_align(precision))
    y, fc1_out, saved = layer.forward(fwd, p.x, p.topk_weights, p.w1, p.w2, keep_fc1=keep_fc1, engine=engine,
                                      precision=precision)
    assert saved is None
    bwd = layer.LocalTransport(p.topk_idx, E, layer.backward_row_align(precision))
    dx, dtw, dw1, dw2 = layer.backward(bwd, p.dy, p.x, p.topk_weights, p.w1, p.w2, fc1_out if keep_fc1 else None,
                                       engine=engine, precision=precision,
                                       fc1_row_align=layer.forward_row_align(precision))
    return Outputs(y, dx, dtw.to(p.topk_weights.dtype), dw1, dw2), fc1_out


def problem_of(tokens=37, routing="masked", seed=0, inter=I, **kwargs):
    return make_problem(tokens, H, inter, E, K, routing=routing, seed=seed, **kwargs)


# ---------------------------------------------------------------- the composition against the reference


@pytest.mark.parametrize("keep_fc1", [True, False])
@pytest.mark.parametrize("routing", ["masked", "uniform", "skewed", "one_expert", "empty_experts"])
def test_fp8_composition_is_the_reference(routing, keep_fc1):
    problem = problem_of(routing=routing, seed=3)
    got, fc1_out = composition(problem, "fp8", keep_fc1=keep_fc1)
    assert_near_bitwise(got, reference_outputs(problem, "fp8"))
    assert got.y.dtype == got.dx.dtype == got.dw1.dtype == got.dw2.dtype == torch.bfloat16
    if keep_fc1:
        assert fc1_out.shape == (layout_max_rows(problem.topk_idx.numel(), E, FP8_ROW_ALIGN), 2 * I)
        _, cpu_fc1 = ops.moe_forward(problem.x, problem.topk_idx, problem.topk_weights, problem.w1, problem.w2,
                                     "fp8", True)
        assert fc1_out.shape == cpu_fc1.shape
        assert rel_err(fc1_out, cpu_fc1) <= 1e-6 and (fc1_out == cpu_fc1).float().mean() >= 0.999
    else:
        assert fc1_out.shape == (0, 2 * I)


def test_fp8_composition_over_more_than_one_tile_per_expert():
    """One expert with over 128 rows (two wgrad row tiles, the last one padded), one with a few, one empty."""
    problem = make_problem(150, H, I, 3, K, routing="masked", seed=4)
    routed = problem.topk_idx >= 0
    every_fifth = (torch.arange(problem.topk_idx.numel()) % 5 == 0).view(problem.topk_idx.shape)
    problem.topk_idx[routed] = torch.where(every_fifth, 1, 0)[routed]
    assert int((problem.topk_idx == 0).sum()) > FP8_ROW_ALIGN
    p = problem
    fwd = layer.LocalTransport(p.topk_idx, 3, FP8_ROW_ALIGN)
    y, fc1_out, _ = layer.forward(fwd, p.x, p.topk_weights, p.w1, p.w2, precision="fp8")
    grads = layer.backward(layer.LocalTransport(p.topk_idx, 3, FP8_ROW_ALIGN), p.dy, p.x, p.topk_weights, p.w1,
                           p.w2, fc1_out, precision="fp8")
    assert_near_bitwise(Outputs(y, *grads), reference_outputs(problem, "fp8"))
    assert not grads[2][2].any() and not grads[3][2].any()  # expert 2 has no rows: exact zeros


@pytest.mark.parametrize("keep_fc1", [True, False])
@pytest.mark.parametrize("engine", [True, False], ids=["engine", "grouped_mm"])
@pytest.mark.parametrize("routing", ["masked", "skewed", "one_expert"])
def test_fp8_bwd_composition(routing, engine, keep_fc1):
    """The forward is the bf16 path's (bitwise; kept fc1_out in its 64-row layout, moved into the FP8 layout by
    the backward); the gradients are the reference's FP8 backward from the bf16 h. I = 256: the bf16 engine's
    kernels tile I by 256."""
    problem = problem_of(routing=routing, seed=5, inter=256)
    got, fc1_out = composition(problem, "fp8_bwd", keep_fc1=keep_fc1, engine=engine)
    bf16, bf16_fc1 = composition(problem, "bf16", keep_fc1=keep_fc1, engine=engine)
    assert torch.equal(got.y, bf16.y), "fp8_bwd's forward is not bitwise the bf16 forward"
    assert torch.equal(fc1_out, bf16_fc1)
    if keep_fc1:
        assert fc1_out.shape[0] == layout_max_rows(problem.topk_idx.numel(), E, ROW_ALIGN)
    want = reference_outputs(problem, "fp8_bwd")
    assert_near_bitwise(got, want, names=("dx", "dtw", "dw1", "dw2"), tol=1e-3, equal=0)
    ref = reference64(problem)
    for name in ("dx", "dtw", "dw1", "dw2"):  # and FP8's error, not bf16's
        assert 0.02 < rel_err(getattr(got, name), getattr(ref, name)) <= FP8_TOL[name], name


def test_fp8_bwd_kept_rows_are_moved_into_the_fp8_layout():
    """LocalTransport.relayout: each routed row of the 64-row layout lands at its slot's row of the 128-row
    layout; padding rows there are zeros."""
    problem = problem_of(tokens=60, routing="skewed", seed=6)
    ids = problem.topk_idx
    t64, t128 = layer.LocalTransport(ids, E, ROW_ALIGN), layer.LocalTransport(ids, E, FP8_ROW_ALIGN)
    rows64 = torch.randn(t64.num_rows, 2 * I).bfloat16()
    moved = t128.relayout(rows64, ROW_ALIGN)
    assert moved.shape == (t128.num_rows, 2 * I)
    s64, s128 = t64.slot_to_row.view(-1), t128.slot_to_row.view(-1)
    routed = s64 >= 0
    assert torch.equal(moved[s128[routed].long()], rows64[s64[routed].long()])
    end = int(t128.offsets[-1])
    padding = torch.ones(end, dtype=torch.bool)
    padding[s128[routed].long()] = False
    assert not moved[:end][padding].any()
    assert t128.relayout(rows64, FP8_ROW_ALIGN) is rows64  # the same layout: nothing to move


def test_fp8_composition_without_routed_rows():
    for tokens, routing in ((0, "uniform"), (5, "all_skipped")):
        problem = problem_of(tokens=tokens, routing=routing, seed=7)
        for precision in ("fp8", "fp8_bwd"):
            got, _ = composition(problem, precision)
            for name in OUTPUT_NAMES:
                assert not getattr(got, name).any(), f"{precision} T={tokens} {routing}: {name}"


def test_fp8_composition_int32_ids_and_bf16_weights():
    problem = problem_of(routing="masked", seed=8, idx_dtype=torch.int32, weight_dtype=torch.bfloat16)
    got, _ = composition(problem, "fp8")
    assert got.dtw.dtype == torch.bfloat16
    assert_near_bitwise(got, reference_outputs(problem, "fp8"))


def test_fp8_composition_rejects_a_layout_that_is_not_128_aligned():
    problem = problem_of(seed=9)
    with pytest.raises(ValueError, match="multiples of 128 rows, got the transport's row_align=64"):
        layer.forward(layer.LocalTransport(problem.topk_idx, E, 64), problem.x, problem.topk_weights, problem.w1,
                      problem.w2, precision="fp8")


# ---------------------------------------------------------------- the buffer= path (a CPU model of the Buffer)


def run_ranks_fp8(problem, tokens_per_rank, precision, row_align=FP8_ROW_ALIGN, **moe_kwargs) -> Outputs:
    """moe(buffer=) on one thread per rank, each with test_ep_cpu's ModelBuffer made for ``precision`` (NaN past
    the received rows, stale meta, NaN weights there), outputs gathered in rank order."""
    from ep_harness import rank_problem
    from test_ep_cpu import ModelBuffer, World

    world = World(len(tokens_per_rank))

    def rank_main(rank):
        buffer = ModelBuffer(world, rank, max_tokens_per_rank=max(max(tokens_per_rank), 1), hidden=H,
                             intermediate=I, num_experts=E, top_k=K, row_align=row_align)
        buffer.precision = precision
        mine = rank_problem(problem, rank, tokens_per_rank, "cpu")
        return run_moe(partial(layer.ep_moe, buffer=buffer, precision=precision, **moe_kwargs), mine)

    results = world.run(rank_main)
    return Outputs(**{name: torch.cat([getattr(r, name) for r in results]) for name in OUTPUT_NAMES})


@pytest.mark.parametrize("keep_fc1", [True, False])
@pytest.mark.parametrize("tokens_per_rank", [(21, 30), (0, 16), (9, 0, 13, 4)])
def test_fp8_over_a_buffer_is_the_reference(tokens_per_rank, keep_fc1):
    problem = problem_of(tokens=sum(tokens_per_rank), routing="masked", seed=sum(tokens_per_rank))
    got = run_ranks_fp8(problem, tokens_per_rank, "fp8", keep_fc1=keep_fc1)
    assert_near_bitwise(got, reference_outputs(problem, "fp8"))


@pytest.mark.parametrize("keep_fc1", [True, False])
def test_fp8_bwd_over_a_buffer(keep_fc1):
    tokens_per_rank = (21, 30)
    problem = problem_of(tokens=sum(tokens_per_rank), routing="skewed", seed=15)
    got = run_ranks_fp8(problem, tokens_per_rank, "fp8_bwd", keep_fc1=keep_fc1)
    bf16 = run_ranks_fp8(problem, tokens_per_rank, "bf16", keep_fc1=keep_fc1)
    assert torch.equal(got.y, bf16.y)
    want = reference_outputs(problem, "fp8_bwd")
    assert_near_bitwise(got, want, names=("dx", "dtw", "dw1", "dw2"), tol=1e-3, equal=0)


def test_fp8_over_a_buffer_needs_a_128_row_layout():
    with pytest.raises(ValueError, match="multiples of 128 rows, got the transport's row_align=64"):
        run_ranks_fp8(problem_of(tokens=8, seed=16), (8,), "fp8", row_align=64)


# ---------------------------------------------------------------- the weight cache


def test_weights_are_quantised_once_per_version():
    """The forward and the backward share one quantisation of each weight, a second call reuses it, and an
    in-place update (an optimizer step) makes the next call quantise again."""
    problem = problem_of(seed=10)
    w1 = problem.w1.clone().requires_grad_()
    w2 = problem.w2.clone().requires_grad_()
    p = problem
    fwd = layer.LocalTransport(p.topk_idx, E, FP8_ROW_ALIGN)
    y, fc1_out, _ = layer.forward(fwd, p.x, p.topk_weights, w1, w2, precision="fp8")
    first = fp8.quantized_weights(w1), fp8.quantized_weights(w2)
    layer.backward(fwd, p.dy, p.x, p.topk_weights, w1, w2, fc1_out, precision="fp8")
    layer.forward(fwd, p.x, p.topk_weights, w1, w2, precision="fp8")
    assert fp8.quantized_weights(w1) is first[0] and fp8.quantized_weights(w2) is first[1]  # cache hits
    assert first[0]._transposed is not None  # the dgrad orientation, copied once and kept
    with torch.no_grad():
        w1.mul_(1.5)  # what optimizer.step() does: bumps the version counter
    y2, _, _ = layer.forward(fwd, p.x, p.topk_weights, w1, w2, precision="fp8")
    now = fp8.quantized_weights(w1)
    assert now is not first[0] and fp8.quantized_weights(w2) is first[1]
    assert not torch.equal(now.s, first[0].s)  # scaled by 1.5: the scales moved
    assert not torch.equal(y2, y)


# ---------------------------------------------------------------- the op path on the CPU: the reference


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
@pytest.mark.parametrize("keep_fc1", [True, False])
def test_moe_on_cpu_is_the_fp8_reference(precision, keep_fc1):
    problem = problem_of(routing="masked", seed=11)
    got = run_moe(partial(primemoe.moe, precision=precision, keep_fc1=keep_fc1), problem)
    want = reference_outputs(problem, precision)
    for name in OUTPUT_NAMES:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    ref = reference64(problem)
    for name in OUTPUT_NAMES[1:]:
        assert rel_err(getattr(got, name), getattr(ref, name)) <= FP8_TOL[name], name


@pytest.mark.parametrize("precision, align", [("bf16", ROW_ALIGN), ("fp8", FP8_ROW_ALIGN), ("fp8_bwd", ROW_ALIGN)])
def test_moe_forward_fc1_out_layout_per_precision(precision, align):
    """fc1_out's rows: the layout of forward_row_align(precision), on the CPU and in the fake."""
    p = problem_of(seed=12)
    args = (p.x, p.topk_idx, p.topk_weights, p.w1, p.w2, precision, True)
    real = ops.moe_forward(*args)
    with FakeTensorMode() as mode:
        fake = ops.moe_forward(*(mode.from_tensor(a) if torch.is_tensor(a) else a for a in args))
    rows = layout_max_rows(p.topk_idx.numel(), E, align)
    assert [tuple(t.shape) for t in real] == [tuple(t.shape) for t in fake] == [(37, H), (rows, 2 * I)]
    assert [t.dtype for t in real] == [t.dtype for t in fake]


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_opcheck_moe_ops_fp8(precision):
    p = problem_of(tokens=9, seed=13)
    args = (p.x.requires_grad_(), p.topk_idx, p.topk_weights.requires_grad_(), p.w1.requires_grad_(),
            p.w2.requires_grad_(), precision, True)
    torch.library.opcheck(ops.moe_forward, args)
    _, fc1_out = ops.moe_forward(*(a.detach() if torch.is_tensor(a) else a for a in args))
    torch.library.opcheck(ops.moe_backward, (p.dy, p.x.detach(), p.topk_idx, p.topk_weights.detach(),
                                             p.w1.detach(), p.w2.detach(), fc1_out, precision))


class Fp8ExpertLayer(torch.nn.Module):
    def __init__(self, w1, w2, precision):
        super().__init__()
        self.w1 = torch.nn.Parameter(w1.detach().clone())
        self.w2 = torch.nn.Parameter(w2.detach().clone())
        self.precision = precision

    def forward(self, x, topk_idx, topk_weights):
        return primemoe.moe(x, topk_idx, topk_weights, self.w1, self.w2, precision=self.precision)


def run_module(module, problem) -> Outputs:
    x = problem.x.detach().clone().requires_grad_()
    topk_weights = problem.topk_weights.detach().clone().requires_grad_()
    y = module(x, problem.topk_idx, topk_weights)
    grads = torch.autograd.grad(y, [x, topk_weights, module.w1, module.w2], problem.dy)
    return Outputs(y.detach(), *grads)


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_torch_compile_fullgraph_aot_eager_fp8(precision):
    """dynamo + AOTAutograd through moe_forward / moe_backward's fakes with an FP8 precision: one graph, the
    same bits as eager."""
    torch._dynamo.reset()
    problem = problem_of(tokens=13, seed=14)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(Fp8ExpertLayer(problem.w1, problem.w2, precision), backend=counter, fullgraph=True)
    got = run_module(compiled, problem)
    assert counter.frame_count == 1, "expected exactly one graph (no graph break)"
    want = run_module(Fp8ExpertLayer(problem.w1, problem.w2, precision), problem)
    for name in OUTPUT_NAMES:
        assert torch.equal(getattr(got, name), getattr(want, name)), name


# ---------------------------------------------------------------- argument checks


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_fp8_sizes_name_the_argument(precision):
    p = make_problem(4, 192, 128, 2, 1)
    with pytest.raises(ValueError, match="x: hidden size H=192 is not supported with FP8: expected a multiple of 128"):
        primemoe.moe(p.x, p.topk_idx, p.topk_weights, p.w1, p.w2, precision=precision)
    p = make_problem(4, 128, 64, 2, 1)
    with pytest.raises(ValueError, match="w1: intermediate size I=64 is not supported with FP8"):
        primemoe.moe(p.x, p.topk_idx, p.topk_weights, p.w1, p.w2, precision=precision)
    # bf16 takes those sizes
    primemoe.moe(p.x, p.topk_idx, p.topk_weights, p.w1, p.w2)


def test_mxfp8_needs_blackwell():
    p = problem_of(tokens=4)
    with pytest.raises(NotImplementedError, match=r"'mxfp8' .* needs a Blackwell \(sm_100\) GPU and is not built"):
        primemoe.moe(p.x, p.topk_idx, p.topk_weights, p.w1, p.w2, precision="mxfp8")


def test_nn_moe_takes_the_precision():
    torch.manual_seed(0)
    module = primemoe.nn.MoE(H, I, E, K, precision="fp8")
    x = torch.randn(2, 5, H, dtype=torch.bfloat16)
    y = module(x)
    y.float().sum().backward()
    assert y.shape == x.shape and module.w1.grad is not None and module.gate.weight.grad is not None
    with pytest.raises(NotImplementedError, match="mxfp8"):
        primemoe.nn.MoE(H, I, E, K, precision="mxfp8")
    with pytest.raises(ValueError, match="precision: expected one of"):
        primemoe.nn.MoE(H, I, E, K, precision="fp4")


# ---------------------------------------------------------------- fp8_expert_gemm / fp8_expert_wgrad


def gemm_operands(counts, k, n, *, seed=0, experts_rows=None, spare_rows=37):
    """A 128-aligned layout of ``counts`` routed rows per expert (zero padding rows, ``spare_rows`` unused rows
    at the end), its rows quantised 1x128 along ``k`` with MN-major scales, and 128x128-quantised weights
    ``[E, n, k]``."""
    gen = torch.Generator().manual_seed(seed)
    padded = [-(-c // 128) * 128 for c in counts]
    offsets = torch.tensor([0] + padded).cumsum(0).to(torch.int32)
    rows = int(offsets[-1]) + spare_rows
    routed = torch.zeros(rows, dtype=torch.bool)
    for e, c in enumerate(counts):
        routed[int(offsets[e]):int(offsets[e]) + c] = True
    a = (torch.randn(rows, k, generator=gen) * routed.unsqueeze(1)).bfloat16()
    a_q, a_s = fp8.quantize_1x128(a)
    w = (torch.randn(len(counts), n, k, generator=gen) * k ** -0.5).bfloat16()
    b_q, b_s = fp8.quantize_128x128(w)
    row_weight = torch.rand(rows, generator=gen) * routed
    return dict(a=a, a_q=a_q, a_s=a_s.t().contiguous(), b_q=b_q, b_s=b_s, offsets=offsets, row_weight=row_weight,
                counts=torch.tensor(counts, dtype=torch.int32))


GEMM_COUNTS = [3, 0, 130]
# opcheck's test_schema compares each input before and after the call with torch.allclose, which has no CPU kernel
# for float8: the other checks run there, and opcheck_fp8 checks that no input changed (bytes) and no output
# aliases an input.
OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def opcheck_fp8(op, args):
    torch.library.opcheck(op, args, test_utils=OPCHECK_UTILS)
    tensors = [a for a in args if torch.is_tensor(a)]
    before = [t.clone() for t in tensors]
    out = op(*args)
    for t, b in zip(tensors, before):
        assert torch.equal(t.view(torch.uint8), b.view(torch.uint8)) if t.dtype == E4M3 else torch.equal(t, b)
        assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_opcheck_fp8_expert_gemm():
    o = gemm_operands(GEMM_COUNTS, 256, 128)
    opcheck_fp8(ops.fp8_expert_gemm, (o["a_q"], o["a_s"], o["b_q"], o["b_s"], o["offsets"]))
    opcheck_fp8(ops.fp8_expert_gemm, (o["a_q"], o["a_s"], o["b_q"], o["b_s"], o["offsets"], o["row_weight"], True))


def test_fp8_expert_gemm_cpu_semantics():
    """Per expert: the dequantised operands' float64 product rounded to float32, times the row weight in
    float32, then bf16; zeros past the routed rows (the row weights there are not read)."""
    o = gemm_operands(GEMM_COUNTS, 256, 128, seed=1)
    weight = o["row_weight"].clone()
    end = int(o["offsets"][-1])
    weight[end:] = float("nan")
    out = ops.fp8_expert_gemm(o["a_q"], o["a_s"], o["b_q"], o["b_s"], o["offsets"], weight)
    out32 = ops.fp8_expert_gemm(o["a_q"], o["a_s"], o["b_q"], o["b_s"], o["offsets"], None, True)
    assert out.dtype == torch.bfloat16 and out32.dtype == torch.float32 and out.shape == out32.shape == (end + 37, 128)
    a64 = fp8.dequantize_1x128(o["a_q"], o["a_s"].t(), torch.float64)
    for e, (lo, hi) in enumerate(zip(o["offsets"].tolist(), o["offsets"][1:].tolist())):
        want32 = (a64[lo:hi] @ fp8.dequantize_128x128(o["b_q"][e], o["b_s"][e], torch.float64).t()).float()
        assert torch.equal(out32[lo:hi], want32), e
        assert torch.equal(out[lo:hi], (want32 * weight[lo:hi].unsqueeze(1)).bfloat16()), e
    assert not out[end:].any() and not out32[end:].any()
    # Against the unquantised product: FP8's error.
    a = o["a"].double()
    for e, (lo, hi) in enumerate(zip(o["offsets"].tolist(), o["offsets"][1:].tolist())):
        if hi > lo:
            exact = a[lo:hi] @ fp8.dequantize_128x128(o["b_q"][e], o["b_s"][e], torch.float64).t()
            assert rel_err(out32[lo:hi], exact) < 0.05


def wgrad_operands(counts, m, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    padded = [-(-c // 128) * 128 for c in counts]
    offsets = torch.tensor([0] + padded).cumsum(0).to(torch.int32)
    rows = int(offsets[-1])
    routed = torch.zeros(rows, dtype=torch.bool)
    for e, c in enumerate(counts):
        routed[int(offsets[e]):int(offsets[e]) + c] = True
    a = (torch.randn(rows, m, generator=gen) * routed.unsqueeze(1)).bfloat16()
    b = (torch.randn(rows, n, generator=gen) * routed.unsqueeze(1)).bfloat16()
    a_t, a_s = fp8.quantize_128x1(a)
    b_t, b_s = fp8.quantize_128x1(b)
    return dict(a=a, b=b, a_t=a_t, a_s=a_s.t().contiguous(), b_t=b_t, b_s=b_s.t().contiguous(), offsets=offsets,
                counts=torch.tensor(counts, dtype=torch.int32))


def test_opcheck_fp8_expert_wgrad():
    o = wgrad_operands(GEMM_COUNTS, 256, 128)
    opcheck_fp8(ops.fp8_expert_wgrad, (o["a_t"], o["a_s"], o["b_t"], o["b_s"], o["offsets"]))
    opcheck_fp8(ops.fp8_expert_wgrad, (o["a_t"], o["a_s"], o["b_t"], o["b_s"], o["offsets"], o["counts"], False))


def test_fp8_expert_wgrad_cpu_semantics():
    o = wgrad_operands([130, 0, 5], 256, 128, seed=2)
    out = ops.fp8_expert_wgrad(o["a_t"], o["a_s"], o["b_t"], o["b_s"], o["offsets"])
    assert out.dtype == torch.float32 and out.shape == (3, 256, 128)
    assert not out[1].any()
    a64 = fp8.dequantize_128x1(o["a_t"], o["a_s"].t(), torch.float64)
    b64 = fp8.dequantize_128x1(o["b_t"], o["b_s"].t(), torch.float64)
    for e, (lo, hi) in enumerate(zip(o["offsets"].tolist(), o["offsets"][1:].tolist())):
        if hi > lo:
            assert torch.equal(out[e], (a64[lo:hi].t() @ b64[lo:hi]).float()), e
    # The routed row counts skip whole tiles only: the same result (the padding rows are zeros).
    assert torch.equal(ops.fp8_expert_wgrad(o["a_t"], o["a_s"], o["b_t"], o["b_s"], o["offsets"], o["counts"]), out)
    bf16 = ops.fp8_expert_wgrad(o["a_t"], o["a_s"], o["b_t"], o["b_s"], o["offsets"], o["counts"], False)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, out.bfloat16())


def test_fp8_expert_wgrad_skips_the_tiles_past_the_routed_rows():
    """With expert_rows, the 128-row tiles past an expert's routed rows are not read (on the GPU: skipped)."""
    o = wgrad_operands([200, 3], 128, 128, seed=3)  # expert 0: rows [0, 256), two tiles; expert 1: [256, 384)
    fewer = ops.fp8_expert_wgrad(o["a_t"], o["a_s"], o["b_t"], o["b_s"], o["offsets"],
                                 torch.tensor([100, 3], dtype=torch.int32))  # expert 0's second tile skipped
    a64 = fp8.dequantize_128x1(o["a_t"], o["a_s"].t(), torch.float64)
    b64 = fp8.dequantize_128x1(o["b_t"], o["b_s"].t(), torch.float64)
    assert torch.equal(fewer[0], (a64[:128].t() @ b64[:128]).float())
    assert torch.equal(fewer[1], (a64[256:].t() @ b64[256:]).float())


@pytest.mark.parametrize("out_fp32", [False, True])
def test_fp8_gemm_fakes(out_fp32):
    o = gemm_operands(GEMM_COUNTS, 256, 128)
    w = wgrad_operands(GEMM_COUNTS, 256, 128)
    with FakeTensorMode() as mode:
        f = lambda t: mode.from_tensor(t)  # noqa: E731
        out = ops.fp8_expert_gemm(f(o["a_q"]), f(o["a_s"]), f(o["b_q"]), f(o["b_s"]), f(o["offsets"]), None, out_fp32)
        dw = ops.fp8_expert_wgrad(f(w["a_t"]), f(w["a_s"]), f(w["b_t"]), f(w["b_s"]), f(w["offsets"]), None,
                                  out_fp32)
    assert out.shape == (o["a_q"].shape[0], 128) and dw.shape == (3, 256, 128)
    assert out.dtype == dw.dtype == (torch.float32 if out_fp32 else torch.bfloat16)


def test_fp8_wgrad_accumulate_adds_the_fp32_gradient():
    """fp8_expert_wgrad_accumulate: main_grad += fp8_expert_wgrad(..., out_fp32=True), checked and faked."""
    from primemoe import layer

    gen = torch.Generator().manual_seed(3)
    offsets = torch.tensor([0, 128, 128, 384], dtype=torch.int32)
    rows = torch.randn(384, 128, generator=gen).bfloat16()
    cols = torch.randn(384, 256, generator=gen).bfloat16()
    a_t, a_s = torch.ops.primemoe.quantize_fp8_128x1(rows, True, True, offsets)
    b_t, b_s = torch.ops.primemoe.quantize_fp8_128x1(cols, True, True, offsets)
    counts = torch.tensor([100, 0, 256], dtype=torch.int32)
    want = torch.ops.primemoe.fp8_expert_wgrad(a_t, a_s, b_t, b_s, offsets, counts, True)
    start = torch.randn(want.shape, generator=gen)
    main_grad = start.clone()
    torch.ops.primemoe.fp8_expert_wgrad_accumulate(a_t, a_s, b_t, b_s, offsets, counts, main_grad)
    assert torch.equal(main_grad, start + want)
    torch.library.opcheck(torch.ops.primemoe.fp8_expert_wgrad_accumulate,
                          (a_t, a_s, b_t, b_s, offsets, counts, start.clone()), test_utils=OPCHECK_UTILS)
    with pytest.raises(RuntimeError, match="main_grad: expected float32"):
        torch.ops.primemoe.fp8_expert_wgrad_accumulate(a_t, a_s, b_t, b_s, offsets, counts, start.bfloat16())
    # The layer's helper: None after accumulating, else the gradient in the weight's dtype.
    w = torch.zeros(want.shape, dtype=torch.bfloat16)
    assert torch.equal(layer._fp8_wgrad(a_t, a_s, b_t, b_s, offsets, counts, w, None), want.bfloat16())
    again = start.clone()
    assert layer._fp8_wgrad(a_t, a_s, b_t, b_s, offsets, counts, w, again) is None
    assert torch.equal(again, start + want)
