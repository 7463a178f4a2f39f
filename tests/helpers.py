"""Shared test helpers: random MoE problems, forward+backward runners and the
tolerance rule of DESIGN.md section 6."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
from torch import nn

import primemoe
from primemoe.shapes import MODEL_SHAPES

# Where this process imported primemoe from: subprocesses and spawned ranks must import the same one.
PRIMEMOE_ROOT = str(Path(primemoe.__file__).resolve().parents[1])

OUTPUT_NAMES = ("y", "dx", "dtw", "dw1", "dw2")
ROUTINGS = ("uniform", "skewed", "masked", "one_expert", "empty_experts", "all_skipped")
HOT_EXPERTS = 4  # "skewed": most tokens prefer the first HOT_EXPERTS experts

# The reference shapes of DESIGN.md section 1: (H, I, E, K).
REFERENCE_SHAPES = {name: shape.dims for name, shape in MODEL_SHAPES.items()}


@dataclass
class Problem:
    """Inputs of one MoE layer call plus the upstream gradient ``dy``."""

    x: torch.Tensor  # [T, H]
    topk_idx: torch.Tensor  # [T, K]
    topk_weights: torch.Tensor  # [T, K]
    w1: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    dy: torch.Tensor  # [T, H]

    def to(self, device) -> "Problem":
        return Problem(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def with_idx(self, topk_idx: torch.Tensor) -> "Problem":
        return replace(self, topk_idx=topk_idx)


@dataclass
class Outputs:
    """``y`` and the gradients w.r.t. x, topk_weights, w1, w2 of one forward+backward."""

    y: torch.Tensor
    dx: torch.Tensor
    dtw: torch.Tensor
    dw1: torch.Tensor
    dw2: torch.Tensor

    def to(self, device) -> "Outputs":
        return Outputs(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def make_problem(tokens, hidden, inter, experts, top_k, *, routing="uniform", seed=0, device="cpu",
                 dtype=torch.bfloat16, idx_dtype=torch.int64, weight_dtype=torch.float32) -> Problem:
    """Fresh random inputs (never zeros). Weights are scaled so activations stay O(1)."""
    gen = torch.Generator(device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)

    topk_idx, topk_weights = make_routing(tokens, experts, top_k, routing, gen, device)
    return Problem(
        x=randn(tokens, hidden),
        topk_idx=topk_idx.to(idx_dtype),
        topk_weights=topk_weights.to(weight_dtype),
        w1=randn(experts, 2 * inter, hidden, scale=hidden ** -0.5),
        w2=randn(experts, hidden, inter, scale=inter ** -0.5),
        dy=randn(tokens, hidden),
    )


def make_routing(tokens, experts, top_k, routing, gen, device):
    """``(topk_idx int64, topk_weights fp32)``; weights always come from ``primemoe.route``."""
    logits = torch.randn(tokens, experts, generator=gen, device=device)
    if routing == "skewed":
        # 90% of the tokens strongly prefer the hot experts.
        hot_tokens = torch.rand(tokens, generator=gen, device=device) < 0.9
        logits[hot_tokens, :HOT_EXPERTS] += 20.0
    elif routing == "empty_experts":
        logits[:, 1::2] = float("-inf")  # odd experts never win
    topk_idx, topk_weights = primemoe.route(logits, top_k)
    if routing == "masked":
        topk_idx = topk_idx.masked_fill(torch.rand(topk_idx.shape, generator=gen, device=device) < 0.25, -1)
        if tokens >= 2:
            topk_idx[1] = -1  # one token with every slot skipped
    elif routing == "one_expert":
        # Every slot of every token to the same expert (duplicate ids in a token are legal: section 1 sums over k).
        topk_idx = torch.full_like(topk_idx, experts - 1)
    elif routing == "all_skipped":
        topk_idx = torch.full_like(topk_idx, -1)
    elif routing not in ("uniform", "skewed", "empty_experts"):
        raise ValueError(f"unknown routing {routing!r}")
    return topk_idx, topk_weights


def run_moe(fn, problem: Problem, dtype=None) -> Outputs:
    """Forward ``fn(x, topk_idx, topk_weights, w1, w2)`` and backward with ``problem.dy``
    on fresh leaves (cast to ``dtype`` when given). Gradients keep the leaves' dtypes."""
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    # detach() aliases the problem's storage (no copy of big weights); nothing writes to the inputs.
    leaves = [cast(t).detach().requires_grad_() for t in (problem.x, problem.topk_weights, problem.w1, problem.w2)]
    x, topk_weights, w1, w2 = leaves
    y = fn(x, problem.topk_idx, topk_weights, w1, w2)
    if y.requires_grad:
        grads = torch.autograd.grad(y, leaves, cast(problem.dy), allow_unused=True, materialize_grads=True)
    else:  # nothing was routed (e.g. T = 0): y does not depend on the leaves
        grads = [torch.zeros_like(t) for t in leaves]
    return Outputs(y.detach(), *grads)


def graph_replays(moe, static_problem: Problem, replay_problems):
    """Forward+backward of ``moe`` captured once in a CUDA graph, then replayed on each of
    ``replay_problems`` (new values and routings copied into the static inputs). Returns
    ``[(replayed Outputs, eager Outputs)]``: nothing about the first routing may be baked in."""
    leaves = [t.detach().clone().requires_grad_() for t in (static_problem.x, static_problem.topk_weights,
                                                             static_problem.w1, static_problem.w2)]
    static_x, static_tw, static_w1, static_w2 = leaves
    static_idx, static_dy = static_problem.topk_idx.clone(), static_problem.dy.clone()

    def step():
        y = moe(static_x, static_idx, static_tw, static_w1, static_w2)
        return (y, *torch.autograd.grad(y, leaves, static_dy))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()

    results = []
    for problem in replay_problems:
        with torch.no_grad():
            for static, new in zip((static_x, static_tw, static_w1, static_w2, static_idx, static_dy),
                                   (problem.x, problem.topk_weights, problem.w1, problem.w2, problem.topk_idx,
                                    problem.dy)):
                static.copy_(new)
        graph.replay()
        replayed = Outputs(*(t.clone() for t in static_out))
        results.append((replayed, run_moe(moe, problem)))
    return results


def reference64(problem: Problem) -> Outputs:
    """``primemoe.reference.moe`` in fp64 with autograd: the yardstick of the tolerance rule."""
    return run_moe(primemoe.reference.moe, problem, dtype=torch.float64)


# Floor of the tolerance rule, relative to ||ref||. d_topk_weights are dot products <dy[t], o[t,k]> that
# cancel: their rounding error scales with the typical |dtw|, not with each value, so over a few slots
# (T = 1) the ratio to ||ref|| is heavy-tailed for every bf16 implementation. One bf16 epsilon (2^-7)
# of the typical magnitude is the absolute-ish floor that absorbs it.
FLOORS = {"y": 1e-3, "dx": 1e-3, "dtw": 2 ** -7, "dw1": 1e-3, "dw2": 1e-3}


def assert_error_within(name, diff_norm, composite_diff_norm, ref_norm):
    """The rule of DESIGN.md section 6 on precomputed Frobenius norms:
    ||out - ref|| <= (2 * rel_err(composite) + floor) * ||ref||  (exactly 0 when ref is 0)."""
    composite_rel = composite_diff_norm / ref_norm if ref_norm > 0 else 0.0
    bound = (2 * composite_rel + FLOORS[name]) * ref_norm
    assert diff_norm <= bound, (
        f"{name}: ||out - ref64|| = {diff_norm:.4e} exceeds the bound {bound:.4e} "
        f"(rel err {diff_norm / max(ref_norm, 1e-300):.3e}, composite rel err {composite_rel:.3e}, "
        f"floor {FLOORS[name]:.2e})")


def assert_close_to_reference(name, out, ref64, composite):
    """rel_err(out, ref64) <= 2 * rel_err(composite, ref64) + FLOORS[name]."""
    assert out.shape == ref64.shape == composite.shape, f"{name}: shapes {out.shape}, {ref64.shape}, {composite.shape}"
    assert not out.isnan().any(), f"{name}: NaN in the output"
    norm = lambda t: torch.linalg.vector_norm(t.double()).item()  # noqa: E731
    assert_error_within(name, norm(out.double() - ref64.double()), norm(composite.double() - ref64.double()),
                        norm(ref64))


def assert_moe_outputs_match(out: Outputs, ref64: Outputs, composite: Outputs, problem: Problem):
    """Tolerance rule on all five outputs, plus the exact zeros the contract promises."""
    for name in OUTPUT_NAMES:
        assert_close_to_reference(name, getattr(out, name), getattr(ref64, name), getattr(composite, name))
    assert_contract_zeros(out, problem.topk_idx, problem.w1.shape[0])


def assert_contract_zeros(out: Outputs, topk_idx: torch.Tensor, num_experts: int):
    """d_topk_weights is 0 on skipped slots; experts with no token get dw = 0 exactly."""
    skipped = topk_idx < 0
    assert torch.all(out.dtw[skipped] == 0), "d_topk_weights: not 0 on skipped slots"
    counts = torch.bincount(topk_idx[~skipped].long(), minlength=num_experts)
    empty = (counts == 0).to(out.dw1.device)
    assert torch.all(out.dw1[empty] == 0), "dw1: not 0 for experts without tokens"
    assert torch.all(out.dw2[empty] == 0), "dw2: not 0 for experts without tokens"


def assert_outputs_equal(a: Outputs, b: Outputs, what: str):
    for name in OUTPUT_NAMES:
        assert torch.equal(getattr(a, name), getattr(b, name)), f"{name}: {what} is not bitwise identical"


class ExpertLayer(nn.Module):
    """The smallest module around ``primemoe.moe`` (used by the torch.compile tests)."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        self.w1 = nn.Parameter(w1.detach().clone())
        self.w2 = nn.Parameter(w2.detach().clone())

    def forward(self, x, topk_idx, topk_weights):
        return primemoe.moe(x, topk_idx, topk_weights, self.w1, self.w2)


def run_module(module: ExpertLayer, problem: Problem) -> Outputs:
    """Forward+backward of an ExpertLayer (possibly compiled) with its own parameters as w1, w2."""
    x = problem.x.detach().clone().requires_grad_()
    topk_weights = problem.topk_weights.detach().clone().requires_grad_()
    y = module(x, problem.topk_idx, topk_weights)
    grads = torch.autograd.grad(y, [x, topk_weights, module.w1, module.w2], problem.dy)
    return Outputs(y.detach(), *grads)


def run_python(code: str) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter that imports the same primemoe as this one."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [PRIMEMOE_ROOT, os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


# Sizes that take the free parts of partly used segments, largest first: the large pool's (> 1 MiB),
# then the small pool's.
FRAGMENT_BYTES = (64 << 20, 8 << 20, 2 << 20, (1 << 20) + 512, 1 << 20, 256 << 10, 64 << 10, 16 << 10, 4 << 10,
                  1 << 10, 512)
# The blocks that fill those fragments, held until the next poisoning (see poison_caching_allocator).
_held_fragments: list = []


def poison_caching_allocator(big_bytes=8 << 30, small_bytes=64 << 10, small_count=2048):
    """Leave the allocator with only NaN-filled free memory, so any output element a kernel forgets
    to write reads back as NaN.

    empty_cache() keeps the segments that still hold live tensors, and their free parts keep old data
    (zeros, say). Those parts are taken first, each size until the allocator reserves new memory (that
    last block's new segment goes straight back), and stay taken until the next call: freed, a block
    would merge with the untaken tail of its part (smaller than any request) into a block that a
    request of the part's size gets whole, tail included. Then fresh segments are filled with NaN and
    freed. Assumes the allocator's default settings (no expandable segments, no max_split_size)."""
    _held_fragments.clear()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    nan = float("nan")
    for size in FRAGMENT_BYTES:
        while True:
            reserved = torch.cuda.memory_reserved()
            block = torch.empty(size // 2, dtype=torch.bfloat16, device="cuda")
            if torch.cuda.memory_reserved() > reserved:
                del block
                torch.cuda.empty_cache()
                break
            _held_fragments.append(block)
    blocks = [torch.full((big_bytes // 2,), nan, dtype=torch.bfloat16, device="cuda")]
    blocks += [torch.full((small_bytes // 2,), nan, dtype=torch.bfloat16, device="cuda") for _ in range(small_count)]
    torch.cuda.synchronize()
    del blocks
