"""precision="fp8" and "fp8_bwd" on the GPU (DESIGN.md sections 2 and 6): primemoe.moe against the FP8-emulating
reference (reference.moe_fp8, tightly) and the fp64 reference (loosely), awkward sizes and routings, the
reference shapes, keep_fc1 either way, bitwise repeats, poisoned memory, CUDA-graph replay, torch.compile, the
quantised-weight cache, fp8_bwd's forward against the bf16 one, and the buffer= path.

Tolerances (relative Frobenius errors, each output):

- against reference.moe_fp8 (the same quantisation and rounding points, fp64 GEMMs rounded to fp32): <= 1e-2
  (d_topk_weights, dot products that cancel: 2e-2), and at most a quarter of FP8's own error (the emulating
  reference against fp64), so a kernel that quantised differently could not pass. The kernels differ from it
  in the accumulation (Hopper's FP8 wgmma accumulates each 128-deep block with less than fp32's precision before
  the promotion into fp32 registers: on the H200 ~5% of FC1's bf16 outputs differ from the reference's by an
  ulp) and the SwiGLU's approximate exp; a flipped bf16 value can requantise to a neighbouring e4m3 value (6%
  apart). Measured on the H200 (2026-12-02): within 1e-2 everywhere except dx at T = 1 (1.2e-2: two rows, where
  a few such flips weigh more), hence 3e-2 for T < 17.
- against the fp64 reference: FP8's tolerance of tests/test_fp8.py (0.10; d_topk_weights 0.13), measured there
  at 0.05-0.08. With a handful of slots (T = 1) the d_topk_weights' relative error is heavy-tailed (a few dot
  products that cancel): only the tight comparison applies there.

H200, 2026-12-02 (commit 0a06319): every test here passed (131; the two-rank ones need two GPUs: not run).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from helpers import (OUTPUT_NAMES, REFERENCE_SHAPES, Outputs, Problem, assert_contract_zeros, assert_outputs_equal,
                     graph_replays, make_problem, poison_caching_allocator, reference64, run_moe)

import primemoe
from primemoe import fp8
from primemoe._constants import FP8_ROW_ALIGN
from primemoe.reference import moe_fp8

pytestmark = pytest.mark.gpu

SMALL = (256, 256, 8, 2)  # H, I, E, K: the engine's smallest tiles (fp8_bwd's forward runs on the engine)
PRECISIONS = ("fp8", "fp8_bwd")
TIGHT = {"y": 1e-2, "dx": 1e-2, "dtw": 2e-2, "dw1": 1e-2, "dw2": 1e-2}
TIGHT_FEW_TOKENS = 3e-2  # T < 17: a handful of rows
TIGHT_SHARE = 0.25  # of FP8's own error (the emulating reference against fp64)
LOOSE = {"y": 0.10, "dx": 0.10, "dtw": 0.13, "dw1": 0.10, "dw2": 0.10}
# The reference shapes' experts, scaled down so that the fp64 references (weights, their gradients) fit beside
# the layer: DeepSeek-V3's 256 experts in fp64 with gradients are ~180 GB.
MAX_EXPERTS = 32


def norm(t) -> float:
    return torch.linalg.vector_norm(t.double()).item()


def fp8_moe(precision, keep_fc1=True):
    return functools.partial(primemoe.moe, precision=precision, keep_fc1=keep_fc1)


def fp8_reference(problem, precision) -> Outputs:
    """reference.moe_fp8 through autograd (gradients in the inputs' dtypes, as primemoe.moe returns them)."""
    return run_moe(functools.partial(moe_fp8, fp8_forward=precision == "fp8"), problem)


def check_fp8(out: Outputs, problem: Problem, precision: str, *, loose=True):
    """The tolerances of the module docstring; fp8_bwd's y is the bf16 forward's (checked bitwise elsewhere), so
    only the tight bound applies to it."""
    ref8 = fp8_reference(problem, precision)
    ref64 = reference64(problem)
    few = problem.x.shape[0] < 17
    for name in OUTPUT_NAMES:
        got, r8, r64 = getattr(out, name), getattr(ref8, name), getattr(ref64, name)
        assert got.shape == r8.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(r8.shape)}"
        assert not got.isnan().any(), f"{name}: NaN"
        diff8, own = norm(got.double() - r8.double()), norm(r8.double() - r64.double())
        tight = max(TIGHT[name], TIGHT_FEW_TOKENS) if few else TIGHT[name]
        assert diff8 <= tight * norm(r8), (
            f"{name}: ||out - fp8 reference|| = {diff8:.3e}, relative {diff8 / max(norm(r8), 1e-300):.3e} > "
            f"{tight:g}")
        if own > 0 and not (precision == "fp8_bwd" and name == "y"):
            assert diff8 <= TIGHT_SHARE * own, (
                f"{name}: ||out - fp8 reference|| = {diff8:.3e} is not well below FP8's own error {own:.3e}")
        if loose:
            rel = norm(got.double() - r64) / max(norm(r64), 1e-300)
            assert norm(r64) == 0 or rel <= LOOSE[name], f"{name}: relative error {rel:.4f} against fp64"
    assert_contract_zeros(out, problem.topk_idx, problem.w1.shape[0])


def small_problem(tokens, routing="uniform", seed=0, **kwargs):
    return make_problem(tokens, *SMALL, routing=routing, seed=seed, device="cuda", **kwargs)


# ---------------------------------------------------------------- against the references


@pytest.mark.parametrize("routing", ["uniform", "skewed", "masked", "one_expert"])
@pytest.mark.parametrize("tokens", [0, 1, 17, 4095])
@pytest.mark.parametrize("keep_fc1", [True, False], ids=["keep_fc1", "recompute_fc1"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_small_shape_matches_references(precision, keep_fc1, tokens, routing):
    problem = small_problem(tokens, routing, seed=tokens + 100)
    check_fp8(run_moe(fp8_moe(precision, keep_fc1), problem), problem, precision, loose=tokens > 1)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("routing", ["empty_experts", "all_skipped"])
def test_experts_without_rows(precision, routing):
    problem = small_problem(600, routing, seed=3)
    check_fp8(run_moe(fp8_moe(precision), problem), problem, precision)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_int32_ids_and_bf16_weights(precision):
    problem = small_problem(777, "masked", seed=4, idx_dtype=torch.int32, weight_dtype=torch.bfloat16)
    out = run_moe(fp8_moe(precision), problem)
    assert out.dtw.dtype == torch.bfloat16
    check_fp8(out, problem, precision)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_sizes_the_bf16_engine_does_not_tile(precision):
    """H, I multiples of 128 but not of 256: fp8's GEMMs are the FP8 kernels anyway; fp8_bwd's forward (and its
    recomputed FC1) run on torch._grouped_mm."""
    problem = make_problem(1000, 384, 128, 6, 2, routing="skewed", seed=5, device="cuda")
    for keep_fc1 in (True, False):
        check_fp8(run_moe(fp8_moe(precision, keep_fc1), problem), problem, precision)


@pytest.mark.parametrize("routing", ["uniform", "skewed", "one_expert"])
@pytest.mark.parametrize("shape", REFERENCE_SHAPES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_reference_shapes(precision, shape, routing):
    hidden, inter, experts, top_k = REFERENCE_SHAPES[shape]
    tokens = 128 if shape == "deepseek-v3" else 256
    problem = make_problem(tokens, hidden, inter, min(experts, MAX_EXPERTS), top_k, routing=routing, seed=6,
                           device="cuda")
    check_fp8(run_moe(fp8_moe(precision), problem), problem, precision)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_qwen3_30b_at_4095_tokens(precision):
    """Many rows per expert (over a hundred 128-row tiles in the skewed experts), all 128 experts."""
    problem = make_problem(4095, *REFERENCE_SHAPES["qwen3-30b-a3b"], routing="skewed", seed=7, device="cuda")
    check_fp8(run_moe(fp8_moe(precision), problem), problem, precision)


# ---------------------------------------------------------------- fp8_bwd's forward is bf16's


@pytest.mark.parametrize("shape", [SMALL, (384, 128, 6, 2)], ids=["engine", "grouped_mm"])
@pytest.mark.parametrize("routing", ["uniform", "masked", "one_expert"])
def test_fp8_bwd_forward_is_the_bf16_forward(shape, routing):
    problem = make_problem(2000, *shape, routing=routing, seed=8, device="cuda")
    args = (problem.x, problem.topk_idx, problem.topk_weights, problem.w1, problem.w2)
    y_bf16, fc1_bf16 = torch.ops.primemoe.moe_forward(*args, "bf16", True)
    y, fc1_out = torch.ops.primemoe.moe_forward(*args, "fp8_bwd", True)
    assert torch.equal(y, y_bf16) and torch.equal(fc1_out, fc1_bf16)
    assert torch.equal(primemoe.moe(*args, precision="fp8_bwd"), primemoe.moe(*args))


# ---------------------------------------------------------------- fc1_out


@pytest.mark.parametrize("routing", ["masked", "skewed", "empty_experts"])
def test_fp8_fc1_out_on_poisoned_memory_is_the_cpu_ops(routing):
    """fp8's fc1_out is in the 128-row layout: routed rows as the CPU op (the emulating reference) computes them
    (up to the FP8 wgmma's accumulation: ~5% of the values an ulp apart on the H200), zeros elsewhere."""
    problem = small_problem(4095, routing, seed=9)
    args = (problem.x, problem.topk_idx, problem.topk_weights, problem.w1, problem.w2, "fp8", True)
    poison_caching_allocator()
    _, fc1_out = torch.ops.primemoe.moe_forward(*args)
    _, want = torch.ops.primemoe.moe_forward(*(a.cpu() if torch.is_tensor(a) else a for a in args))
    E = problem.w1.shape[0]
    routed = int(torch.ops.primemoe.dispatch_layout(problem.topk_idx, E, 0, E, FP8_ROW_ALIGN)[1][-1])
    assert fc1_out.shape == want.shape and 0 < routed < fc1_out.shape[0]
    assert not fc1_out[routed:].view(torch.int16).any(), "fc1_out: a row past the routed ones is not zero"
    assert not fc1_out.isnan().any()
    got = fc1_out.cpu()
    assert norm(got.double() - want.double()) <= 1e-3 * norm(want)
    assert (got == want).float().mean() >= 0.9


# ---------------------------------------------------------------- determinism, overwrite, graphs, compile


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("case", [(4095, "skewed", SMALL), (256, "uniform", REFERENCE_SHAPES["qwen3-30b-a3b"])],
                         ids=["small-skewed", "qwen3-30b-a3b"])
def test_bitwise_repeatable(precision, case):
    tokens, routing, shape = case
    problem = make_problem(tokens, *shape, routing=routing, seed=10, device="cuda")
    first = run_moe(fp8_moe(precision), problem)
    for _ in range(2):
        assert_outputs_equal(run_moe(fp8_moe(precision), problem), first, "a repeated run")


@pytest.mark.parametrize("routing", ["masked", "skewed", "empty_experts"])
@pytest.mark.parametrize("keep_fc1", [True, False], ids=["keep_fc1", "recompute_fc1"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_poisoned_memory_is_fully_overwritten(precision, keep_fc1, routing):
    problem = small_problem(4095, routing, seed=11)
    clean = run_moe(fp8_moe(precision, keep_fc1), problem)
    poison_caching_allocator()
    fp8.clear_cache()  # the weights' quantisation too is made again on poisoned memory
    poisoned = run_moe(fp8_moe(precision, keep_fc1), problem)
    for name in OUTPUT_NAMES:
        assert not getattr(poisoned, name).isnan().any(), f"{name}: NaN from poisoned memory"
    assert_outputs_equal(poisoned, clean, "a run on poisoned memory")


@pytest.mark.parametrize("keep_fc1", [True, False], ids=["keep_fc1", "recompute_fc1"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_cuda_graph_replay_matches_eager(precision, keep_fc1):
    """Each replay gets new weights too (graph_replays copies them into the static ones): the weights must be
    quantised inside the graph, not taken from the cache at capture time."""
    routings = ["uniform", "skewed", "masked", "one_expert"]
    replays = [small_problem(1000, routing, seed=seed) for seed, routing in enumerate(routings, start=13)]
    results = graph_replays(fp8_moe(precision, keep_fc1), small_problem(1000, "uniform", seed=12), replays)
    for routing, (replayed, eager) in zip(routings, results):
        for name in OUTPUT_NAMES:
            assert torch.equal(getattr(replayed, name), getattr(eager, name)), (
                f"{name}: graph replay ({routing}) != eager")


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


@pytest.mark.parametrize("tokens", [17, 4095])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_torch_compile_matches_eager(precision, tokens):
    """Default backend (inductor), fullgraph: one graph, same bits as eager."""
    torch._dynamo.reset()
    problem = small_problem(tokens, "masked", seed=17)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(Fp8ExpertLayer(problem.w1, problem.w2, precision), backend=counter, fullgraph=True)
    got = run_module(compiled, problem)
    assert counter.frame_count == 1, "expected exactly one graph (no graph break)"
    assert_outputs_equal(got, run_module(Fp8ExpertLayer(problem.w1, problem.w2, precision), problem),
                         "torch.compile vs eager")


# ---------------------------------------------------------------- the quantised-weight cache


@pytest.mark.parametrize("precision", PRECISIONS)
def test_weight_cache_is_reused_and_follows_the_optimizer(precision, monkeypatch):
    """One quantisation per weight version: the forward and backward of a step and the next step before the
    optimizer share it; optimizer.step() (an in-place update) makes the next call quantise the new values."""
    seen = []
    real = fp8.quantized_weights

    def recording(w, *args, **kwargs):
        value = real(w, *args, **kwargs)
        seen.append((w, value))
        return value
    monkeypatch.setattr(fp8, "quantized_weights", recording)
    problem = small_problem(500, "skewed", seed=18)
    module = Fp8ExpertLayer(problem.w1, problem.w2, precision)
    optimizer = torch.optim.SGD(module.parameters(), lr=10.0)

    def step():
        seen.clear()
        out = run_module(module, problem)
        by_weight = {}
        for w, value in seen:
            assert w is module.w1 or w is module.w2, "the cache was asked about another tensor than the parameter"
            by_weight.setdefault("w1" if w is module.w1 else "w2", set()).add(id(value))
        return out, by_weight

    first, cached = step()
    # fp8's forward quantises both weights; both precisions' backward read both (dgrad orientations).
    assert set(cached) == {"w1", "w2"} and all(len(ids) == 1 for ids in cached.values()), cached
    before = {name: fp8.quantized_weights(getattr(module, name)) for name in ("w1", "w2")}
    again, cached_again = step()
    assert cached_again == cached, "a second call with unchanged weights quantised them again"
    assert_outputs_equal(again, first, "a second call with unchanged weights")
    module.w1.grad, module.w2.grad = first.dw1, first.dw2
    optimizer.step()
    _, cached_after = step()
    for name in ("w1", "w2"):
        assert cached_after[name] != cached[name], f"{name}: the optimizer's update did not invalidate the cache"
        now = fp8.quantized_weights(getattr(module, name))
        assert now is not before[name]
        assert not torch.equal(now.q.view(torch.uint8), before[name].q.view(torch.uint8)), (
            f"{name}: the quantised weights did not change with the weights")
        assert torch.equal(now.q.view(torch.uint8), torch.ops.primemoe.quantize_fp8_128x128(
            getattr(module, name).detach())[0].view(torch.uint8))


# ---------------------------------------------------------------- CUDA-only input checks


@pytest.mark.parametrize("precision", PRECISIONS)
def test_cuda_rejects_sizes_off_the_fp8_tiles(precision):
    p = make_problem(8, 192, 128, 4, 2, device="cuda")
    with pytest.raises(ValueError, match="x: hidden size H=192 is not supported with FP8"):
        primemoe.moe(p.x, p.topk_idx, p.topk_weights, p.w1, p.w2, precision=precision)
    p = make_problem(8, 256, 192, 4, 2, device="cuda")
    with pytest.raises(ValueError, match="w1: intermediate size I=192 is not supported with FP8"):
        primemoe.moe(p.x, p.topk_idx, p.topk_weights, p.w1, p.w2, precision=precision)


# ---------------------------------------------------------------- buffer= (expert parallelism)


def run_buffer_cases(tmp_path, monkeypatch, precision, world):
    """tests/buffer_ranks.py's moe_cases with an FP8 Buffer: the cases, a repeat, two layers sharing the buffer
    and CUDA-graph replays."""
    from buffer_ranks import buffer_sizes, moe_cases, spawn_ranks
    from ep_harness import prepare_spawn

    splits = {1: [(300,), (0,), (4095,)], 2: [(300, 77), (0, 200), (1500, 2595)]}[world]
    routings = ["masked", "uniform", "skewed"]
    cases = {f"{routing}_{'_'.join(map(str, tpr))}": dict(problem=vars(make_problem(
        sum(tpr), *SMALL, routing=routing, seed=20 + i)), tokens_per_rank=tpr)
        for i, (tpr, routing) in enumerate(zip(splits, routings))}
    graph_tokens = splits[0]
    data = dict(
        precision=precision, cases=cases, repeat=next(iter(cases)), layered=tuple(list(cases)[:2]),
        graph=dict(static=dict(problem=vars(make_problem(sum(graph_tokens), *SMALL, routing="uniform", seed=30)),
                               tokens_per_rank=graph_tokens),
                   replays=[dict(problem=vars(make_problem(sum(graph_tokens), *SMALL, routing=r, seed=31 + i)),
                                 tokens_per_rank=graph_tokens) for i, r in enumerate(["skewed", "one_expert"])]),
        sizes=buffer_sizes(make_problem(1, *SMALL), world, max(max(t) for t in splits)))
    cases_path = tmp_path / "cases.pt"
    torch.save(data, cases_path)
    prepare_spawn(monkeypatch, tmp_path, NCCL_NVLS_ENABLE="0", NVSHMEM_DISABLE_NVLS="1",
                  TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    spawn_ranks(moe_cases, world, str(cases_path), str(tmp_path))
    per_rank = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    def stitch(results):  # tokens in rank order, experts in rank order: the single-process problem's layout
        return Outputs(**{name: torch.cat([r[name] for r in results]) for name in OUTPUT_NAMES})

    for name, case in cases.items():
        problem = Problem(**case["problem"]).to("cuda")
        check_fp8(stitch([r[name] for r in per_rank]).to("cuda"), problem, precision)
    for rank in range(world):
        for name in OUTPUT_NAMES:
            assert torch.equal(per_rank[rank]["repeat"][name], per_rank[rank][data["repeat"]][name]), (
                f"rank {rank}: {name}: a repeat is not bitwise identical")
        for replayed, eager in per_rank[rank]["graph"]:
            for name in OUTPUT_NAMES:
                assert torch.equal(replayed[name], eager[name]), f"rank {rank}: {name}: graph replay != eager"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fp8_with_a_buffer_on_one_rank(tmp_path, monkeypatch, precision):
    run_buffer_cases(tmp_path, monkeypatch, precision, world=1)


@pytest.mark.ep  # two ranks: one GPU each where there are two, else both on cuda:0 over gloo (tests/ep_harness.py)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_fp8_with_a_buffer_on_two_ranks(tmp_path, monkeypatch, precision):
    run_buffer_cases(tmp_path, monkeypatch, precision, world=2)
