"""The blockwise FP8 expert GEMMs (csrc/gemm/sm90/fp8_kernel.cuh) against float64 products of the dequantised
operands, on fresh random inputs with poisoned output memory: fp8_expert_gemm (rows: every expert's 128-row blocks,
row weights, bf16 and fp32 outputs, empty experts, experts of one block, rows past the routed ones unwritten) and
fp8_expert_wgrad (experts: token blocks per expert, partial last blocks, empty experts, with and without the routed
counts); bitwise repeats and CUDA-graph replay."""

import pytest
import torch

from helpers import poison_caching_allocator

import primemoe  # noqa: F401  (registers the ops)
from primemoe import fp8

pytestmark = pytest.mark.gpu
ops = torch.ops.primemoe
dev = "cuda"


def rel_err(got, want):
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def routed_layout(counts, align=128):
    """offsets [E + 1] int32 with each expert's range padded to `align` rows."""
    padded = [(c + align - 1) // align * align for c in counts]
    offsets = [0]
    for p in padded:
        offsets.append(offsets[-1] + p)
    return torch.tensor(offsets, dtype=torch.int32)


def rows_case(counts, K, N, seed, extra_rows=37, align=128):
    gen = torch.Generator().manual_seed(seed)
    offsets = routed_layout(counts, align)
    R = int(offsets[-1]) + extra_rows
    x = torch.randn(R, K, generator=gen) * torch.exp(torch.randn(R, 1, generator=gen))
    # Padding rows inside an expert's range are zeros, as the layout leaves them.
    for e, c in enumerate(counts):
        x[int(offsets[e]) + c:int(offsets[e + 1])] = 0
    E = len(counts)
    # Weight blocks of different magnitudes, so that the per-block scales matter.
    block_scale = torch.exp(torch.randn(E, N // 128, K // 128, generator=gen))
    w = torch.randn(E, N, K, generator=gen) * K ** -0.5
    w *= block_scale.repeat_interleave(128, 1).repeat_interleave(128, 2)
    q, s = fp8.quantize_1x128(x.bfloat16())
    wq, ws = fp8.quantize_128x128(w.bfloat16())
    row_weight = torch.rand(R, generator=gen) + 0.1
    return offsets, q, s, wq, ws, row_weight


def expected_rows(offsets, q, s, wq, ws, row_weight):
    a = fp8.dequantize_1x128(q, s, torch.float64)
    out = torch.zeros(q.shape[0], wq.shape[1], dtype=torch.float64)
    for e in range(wq.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if hi > lo:
            b = fp8.dequantize_128x128(wq[e], ws[e], torch.float64)
            out[lo:hi] = (a[lo:hi] @ b.t()).float().double()
    if row_weight is not None:
        out = (out.float() * row_weight.unsqueeze(1)).double()
    return out


ROWS_CASES = [
    # (counts per expert, K, N)
    ([128], 128, 128),
    ([5, 0, 300, 128, 1], 256, 384),
    ([0, 0, 700], 512, 256),
    ([64, 129, 17, 0, 256, 1000, 3, 128], 1024, 512),
]


@pytest.mark.parametrize("case", range(len(ROWS_CASES)))
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("out_fp32", [False, True])
def test_fp8_expert_gemm(case, weighted, out_fp32):
    counts, K, N = ROWS_CASES[case]
    offsets, q, s, wq, ws, row_weight = rows_case(counts, K, N, seed=case)
    want = expected_rows(offsets, q, s, wq, ws, row_weight if weighted else None)
    args = (q.to(dev), s.t().contiguous().to(dev), wq.to(dev), ws.to(dev), offsets.to(dev),
            row_weight.to(dev) if weighted else None, out_fp32)
    poison_caching_allocator()
    out = ops.fp8_expert_gemm(*args)
    torch.cuda.synchronize()
    routed = int(offsets[-1])
    got = out[:routed].cpu()
    assert got.dtype == (torch.float32 if out_fp32 else torch.bfloat16)
    assert torch.isfinite(got).all(), "rows below expert_offsets[-1] left unwritten (poison)"
    err = rel_err(got, want[:routed])
    # fp32 accumulation in the tensor cores (short mantissa inside a 128-deep block) against float64.
    assert err < (2e-3 if not out_fp32 else 1e-3), err
    # Elementwise: within a few bf16 ulps of the expected value (or of the row's scale).
    tol = 2 ** -7 * want[:routed].abs() + 1e-3 * want[:routed].abs().amax(1, keepdim=True) + 1e-30
    assert ((got.double() - want[:routed]).abs() <= tol).all()
    again = ops.fp8_expert_gemm(*args)
    assert torch.equal(again[:routed], out[:routed]), "not repeatable"


@pytest.mark.parametrize("align", [64, 1])
def test_fp8_expert_gemm_any_offsets(align):
    """Offsets that are not multiples of 128 (the bf16 engine's 64, or none): an expert's partial last block is
    stored from registers, row by row, and no row of the next expert is overwritten."""
    counts, K, N = ROWS_CASES[3]
    offsets, q, s, wq, ws, row_weight = rows_case(counts, K, N, seed=50 + align, align=align)
    want = expected_rows(offsets, q, s, wq, ws, row_weight)
    poison_caching_allocator()
    out = ops.fp8_expert_gemm(q.to(dev), s.t().contiguous().to(dev), wq.to(dev), ws.to(dev), offsets.to(dev),
                              row_weight.to(dev))
    routed = int(offsets[-1])
    got = out[:routed].cpu()
    assert torch.isfinite(got).all()
    assert rel_err(got, want[:routed]) < 2e-3
    tol = 2 ** -7 * want[:routed].abs() + 1e-3 * want[:routed].abs().amax(1, keepdim=True) + 1e-30
    assert ((got.double() - want[:routed]).abs() <= tol).all()


def wgrad_case(counts, M, N, seed):
    gen = torch.Generator().manual_seed(seed)
    offsets = routed_layout(counts)
    R = int(offsets[-1]) + 128  # a multiple of 128, as the layer passes it
    a = torch.randn(R, M, generator=gen) * torch.exp(torch.randn(R, 1, generator=gen))
    b = torch.randn(R, N, generator=gen)
    for e, c in enumerate(counts):
        a[int(offsets[e]) + c:int(offsets[e + 1])] = 0
        b[int(offsets[e]) + c:int(offsets[e + 1])] = 0
    aq, as_ = fp8.quantize_128x1(a.bfloat16())  # [M, R], [M, R/128]
    bq, bs = fp8.quantize_128x1(b.bfloat16())
    return offsets, aq, as_, bq, bs


def expected_wgrad(offsets, aq, as_, bq, bs):
    a = fp8.dequantize_128x1(aq, as_, torch.float64)  # [R, M]
    b = fp8.dequantize_128x1(bq, bs, torch.float64)
    E = offsets.numel() - 1
    out = torch.zeros(E, a.shape[1], b.shape[1], dtype=torch.float64)
    for e in range(E):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        out[e] = (a[lo:hi].t() @ b[lo:hi]).float().double()
    return out


WGRAD_CASES = [
    ([128], 128, 128),
    ([5, 0, 300, 1], 256, 384),
    ([0, 1000, 0], 384, 256),
    ([64, 129, 17, 0, 256, 1000, 3, 128], 512, 256),
]


@pytest.mark.parametrize("case", range(len(WGRAD_CASES)))
@pytest.mark.parametrize("with_counts", [False, True])
@pytest.mark.parametrize("out_fp32", [False, True])
def test_fp8_expert_wgrad(case, with_counts, out_fp32):
    counts, M, N = WGRAD_CASES[case]
    offsets, aq, as_, bq, bs = wgrad_case(counts, M, N, seed=100 + case)
    want = expected_wgrad(offsets, aq, as_, bq, bs)
    rows = torch.tensor(counts, dtype=torch.int32).to(dev) if with_counts else None
    args = (aq.to(dev), as_.t().contiguous().to(dev), bq.to(dev), bs.t().contiguous().to(dev), offsets.to(dev),
            rows, out_fp32)
    poison_caching_allocator()
    out = ops.fp8_expert_wgrad(*args)
    torch.cuda.synchronize()
    got = out.cpu()
    assert got.dtype == (torch.float32 if out_fp32 else torch.bfloat16)
    assert torch.isfinite(got).all()
    for e, c in enumerate(counts):
        if c == 0:
            assert (got[e] == 0).all(), f"expert {e} without rows must be zeros"
    assert rel_err(got, want) < 2e-3
    tol = 2 ** -7 * want.abs() + 1e-3 * want.abs().amax((1, 2), keepdim=True) + 1e-30
    assert ((got.double() - want).abs() <= tol).all()
    assert torch.equal(ops.fp8_expert_wgrad(*args), out), "not repeatable"


def test_fp8_gemm_graph_replay():
    counts, K, N = ROWS_CASES[3]
    offsets, q, s, wq, ws, row_weight = rows_case(counts, K, N, seed=7)
    a, sa = q.to(dev), s.t().contiguous().to(dev)
    b, sb = wq.to(dev), ws.to(dev)
    off, rw = offsets.to(dev), row_weight.to(dev)
    eager = ops.fp8_expert_gemm(a, sa, b, sb, off, rw)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ops.fp8_expert_gemm(a, sa, b, sb, off, rw)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.fp8_expert_gemm(a, sa, b, sb, off, rw)
    # New inputs in place: the replay reads them.
    offsets2, q2, s2, _, _, rw2 = rows_case(counts, K, N, seed=8)
    a.copy_(q2.to(dev))
    sa.copy_(s2.t().contiguous().to(dev))
    rw.copy_(rw2.to(dev))
    graph.replay()
    torch.cuda.synchronize()
    routed = int(offsets[-1])
    assert torch.equal(out[:routed], ops.fp8_expert_gemm(a, sa, b, sb, off, rw)[:routed])
    assert not torch.equal(out[:routed], eager[:routed])


def test_fp8_gemm_errors():
    a = torch.zeros(256, 100, dtype=fp8.FP8_DTYPE, device=dev)
    with pytest.raises(RuntimeError, match="a: expected a positive multiple of 128"):
        ops.fp8_expert_gemm(a, torch.ones(1, 256, device=dev), torch.zeros(1, 128, 100, dtype=fp8.FP8_DTYPE,
                                                                             device=dev),
                            torch.ones(1, 1, 1, device=dev), torch.tensor([0, 256], dtype=torch.int32, device=dev))
