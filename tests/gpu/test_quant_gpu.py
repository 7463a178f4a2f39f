"""The FP8 quantisation kernels (csrc/kernels/quantize.cu) against their CPU kernels (the primemoe.fp8 reference):
bitwise equal on fresh random bf16 inputs, every output element written, CUDA-graph replay, opcheck on CUDA; their
options (scale_mn_major, expert_offsets: rows past the bound left unwritten); the FP8 SwiGLU epilogues
(csrc/kernels/fp8_rows.cu) against their CPU kernels, within the ulp that CUDA's expf may differ by."""

import math

import pytest
import torch

from helpers import poison_caching_allocator

import primemoe  # noqa: F401  (registers the ops)
from primemoe import _quant_ops, fp8

pytestmark = pytest.mark.gpu
ops = torch.ops.primemoe

OPS = {"1x128": ops.quantize_fp8_1x128, "128x1": ops.quantize_fp8_128x1, "128x128": ops.quantize_fp8_128x128}

# op name -> input shapes: empty, one tile, partial 64-column blocks (128x1: 200 = 3 * 64 + 8), M = 128 * 3 with
# K = 128 * 5, experts, and one larger case per op.
SHAPES = {
    "1x128": [(0, 256), (1, 128), (17, 640), (384, 640), (1000, 2048)],
    "128x1": [(0, 640), (128, 8), (256, 200), (384, 640), (1024, 1536)],
    "128x128": [(0, 128, 256), (128, 128), (256, 640), (3, 256, 384), (2, 3, 128, 256)],
}
CASES = [(name, shape) for name, shapes in SHAPES.items() for shape in shapes]


def make_input(shape, seed):
    """bf16 over many magnitudes: a normal sample times log-uniform row (1e-6 .. 1e4) and column (1e-2 .. 1e2)
    scales, so tiles mix values far below their amax (products in and below E4M3's subnormal range) in every
    tiling. In the [rows, K] view: row 0 zeros; rows 128 .. 256 x columns 128 .. 256 zeros (a zero tile in
    every tiling); row 1 small (2^-15) but for one 1.0 per 128 columns (its quantised values are E4M3
    subnormals); a value near the bf16 maximum in row 2; 16 values of row 3 times 1e30; in row 4 a tile of amax
    1e-33 holding bf16 subnormals; the last row's first 128 values negative; rows 256 .. 384 x columns 0 .. 256 tiny
    (1e-38, 1e-36: multipliers capped at 2^126)."""
    gen = torch.Generator().manual_seed(seed)
    rows, K = math.prod(shape[:-1]), shape[-1]
    t = torch.randn(rows, K, generator=gen)
    t *= 10 ** (torch.rand(rows, 1, generator=gen) * 10 - 6)
    t *= 10 ** (torch.rand(1, K, generator=gen) * 4 - 2)
    if rows > 1:
        t[1] = torch.randn(K, generator=gen) * 2.0 ** -15
        t[1, ::128] = 1.0
    if rows > 2 and K >= 8:
        t[2, 6] = -2.5e38
    if rows > 3:
        t[3, :16] *= 1e30
    if rows > 4 and K >= 256:  # a tile of amax 1e-33, bf16 subnormals in it quantised to nonzero values
        t[4, 128:256] = torch.randn(128, generator=gen) * 1e-34
        t[4, 130], t[4, 131], t[4, 132] = 1e-33, 5e-39, -3e-39
    # Tiles of tiny values in every tiling (bf16 subnormals among them): 448 / amax overflows (first 128 columns)
    # or passes 2^126 (next 128), the multiplier is capped at 2^126.
    t[256:384, :128] = torch.randn(t[256:384, :128].shape, generator=gen) * 1e-38
    t[256:384, 128:256] = torch.randn(t[256:384, 128:256].shape, generator=gen) * 1e-36
    if rows > 4:
        t[-1, :128] = -t[-1, :128].abs()
    if rows > 0:
        t[0] = 0
    t[128:256, 128:256] = 0
    return t.bfloat16().view(shape)


def assert_bitwise(got, want, what):
    assert got.is_cuda, what
    assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride(), (
        f"{what}: got {got.dtype} {tuple(got.shape)} strides {got.stride()}, "
        f"want {want.dtype} {tuple(want.shape)} strides {want.stride()}")
    bits = torch.uint8 if want.element_size() == 1 else torch.int32
    g, w = got.cpu().view(bits), want.view(bits)
    if not torch.equal(g, w):
        bad = (g != w).nonzero()
        first = tuple(bad[0].tolist())
        raise AssertionError(f"{what}: {bad.shape[0]} of {w.numel()} elements differ; first at {first}: "
                             f"got {got.cpu()[first].item()!r} ({g[first].item():#x}), "
                             f"want {want[first].item()!r} ({w[first].item():#x})")


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("name,shape", CASES)
def test_cuda_equals_cpu_on_poisoned_memory(name, shape, pow2):
    """Outputs allocated from NaN-filled memory: an element the kernel does not write reads back as NaN."""
    x = make_input(shape, seed=2 * CASES.index((name, shape)) + pow2)
    want_q, want_s = OPS[name](x, pow2)
    x = x.cuda()
    poison_caching_allocator()
    got_q, got_s = OPS[name](x, pow2)
    assert_bitwise(got_q, want_q, f"{name} q {shape} pow2={pow2}")
    assert_bitwise(got_s, want_s, f"{name} s {shape} pow2={pow2}")


@pytest.mark.parametrize("name", OPS)
def test_graph_replay_equals_eager(name):
    shape = SHAPES[name][3]
    static_x = make_input(shape, seed=1).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        OPS[name](static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_q, static_s = OPS[name](static_x)
    for seed in (2, 3):
        x = make_input(shape, seed=seed).cuda()
        static_x.copy_(x)
        graph.replay()
        q, s = OPS[name](x)
        assert_bitwise(static_q, q.cpu(), f"{name} q after replay, seed {seed}")
        assert_bitwise(static_s, s.cpu(), f"{name} s after replay, seed {seed}")


@pytest.mark.parametrize("name", OPS)
def test_opcheck_on_cuda(name):
    torch.library.opcheck(OPS[name], (make_input(SHAPES[name][2], seed=4).cuda(), True))


@pytest.mark.parametrize("name", OPS)
def test_misaligned_view_names_the_argument(name):
    base = torch.zeros(256 * 256 + 8, dtype=torch.bfloat16, device="cuda")
    x = base[1:1 + 256 * 256].view(256, 256)
    arg = "w" if name == "128x128" else "x"
    with pytest.raises(RuntimeError, match=f"{arg}: expected 16-byte aligned data on CUDA"):
        OPS[name](x)


def test_bandwidth(capsys):
    """Reported (pytest -s), with a floor far below the H200's ~4.3 TB/s that only a broken kernel misses."""
    x = torch.randn(16384, 7168, device="cuda").bfloat16()
    moved = x.numel() * (2 + 1 + 4 / 128)  # bf16 in, e4m3 out, one fp32 scale per 128 values
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    report = []
    for name, op in OPS.items():
        for _ in range(3):
            op(x)
        start.record()
        for _ in range(20):
            op(x)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / 20
        report.append((name, moved / seconds / 1e9, seconds * 1e6))
    with capsys.disabled():
        for name, gbps, us in report:
            print(f"\nquantize_fp8_{name} [16384, 7168]: {us:.1f} us, {gbps:.0f} GB/s", end="")
        print()
    for name, gbps, _ in report:
        assert gbps > 500, f"quantize_fp8_{name}: {gbps:.0f} GB/s"


# ---------------------------------------------------------------- shared by the options and the SwiGLU epilogues


def offsets(*values, device="cpu"):
    return torch.tensor(values, dtype=torch.int32, device=device)


def assert_bits_equal(got, want, what):
    """got (CUDA) and want (CPU) equal bit for bit, whatever their strides (slices of outputs)."""
    assert got.is_cuda and got.dtype == want.dtype and got.shape == want.shape, what
    bits = torch.uint8 if want.element_size() == 1 else (torch.int16 if want.element_size() == 2 else torch.int32)
    g, w = got.cpu().contiguous().view(bits), want.contiguous().view(bits)
    if not torch.equal(g, w):
        bad = (g != w).nonzero()
        first = tuple(bad[0].tolist())
        raise AssertionError(f"{what}: {bad.shape[0]} of {w.numel()} elements differ; first at {first}: "
                             f"got {g[first].item():#x}, want {w[first].item():#x}")


def assert_unwritten(t, what):
    """t (a part of an output allocated after poison_caching_allocator) still holds the poison: bf16 NaNs
    (0x7FC0), i.e. bytes 0xC0, 0x7F."""
    if t.numel() == 0:
        return
    b = t.cpu().contiguous().view(torch.uint8)
    assert ((b == 0xC0) | (b == 0x7F)).all(), f"{what}: written past the routed rows"


# ---------------------------------------------------------------- quantiser options


# op name -> (x shape, routed rows n): expert_offsets = [0, n // 2, n]
OPTION_SHAPES = {
    "1x128": [((1, 128), 1), ((17, 640), 11), ((4095, 768), 3001), ((1000, 2048), 1000), ((300, 256), 0)],
    "128x1": [((128, 8), 1), ((256, 200), 129), ((4096, 1536), 3001), ((384, 640), 384), ((256, 64), 0)],
}
OPTION_CASES = [(name, shape, n) for name, cases in OPTION_SHAPES.items() for shape, n in cases]


@pytest.mark.parametrize("scale_mn_major", [False, True])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("name,shape,n", OPTION_CASES)
def test_options_cuda_equal_cpu(name, shape, n, pow2, scale_mn_major):
    """Bitwise equal to the CPU kernel with each option; with expert_offsets, the rows (row tiles) past the bound
    keep the poisoned memory's bytes."""
    x = make_input(shape, seed=100 + OPTION_CASES.index((name, shape, n)))
    off = offsets(0, n // 2, n)
    x_cuda, off_cuda = x.cuda(), off.cuda()
    for bounded in (False, True):
        want_q, want_s = OPS[name](x, pow2, scale_mn_major, off if bounded else None)
        poison_caching_allocator()
        got_q, got_s = OPS[name](x_cuda, pow2, scale_mn_major, off_cuda if bounded else None)
        what = f"{name} {shape} pow2={pow2} mn_major={scale_mn_major} bounded={bounded}"
        assert got_q.shape == want_q.shape and got_q.stride() == want_q.stride(), what
        assert got_s.shape == want_s.shape and got_s.stride() == want_s.stride(), what
        if not bounded:
            assert_bitwise(got_q, want_q, f"{what} q")
            assert_bitwise(got_s, want_s, f"{what} s")
            continue
        if name == "1x128":
            live_q, dead_q = (slice(0, n), slice(None)), (slice(n, None), slice(None))
            row_dim_of_s = 1 if scale_mn_major else 0
            live = n
        else:
            live = -(-n // 128)  # row tiles starting before n
            live_q, dead_q = (slice(None), slice(0, live * 128)), (slice(None), slice(live * 128, None))
            row_dim_of_s = 0 if scale_mn_major else 1
        live_s = [slice(None), slice(None)]
        dead_s = [slice(None), slice(None)]
        live_s[row_dim_of_s], dead_s[row_dim_of_s] = slice(0, live), slice(live, None)
        assert_bits_equal(got_q[live_q], want_q[live_q], f"{what} q")
        assert_bits_equal(got_s[tuple(live_s)], want_s[tuple(live_s)], f"{what} s")
        assert_unwritten(got_q[dead_q], f"{what} q")
        assert_unwritten(got_s[tuple(dead_s)], f"{what} s")


def test_options_bound_read_on_the_device():
    """expert_offsets is read by the kernel (no host sync): changing it between graph replays moves the bound."""
    x = make_input((1024, 512), seed=5).cuda()
    off = offsets(0, 1024, device="cuda")
    for name in ("1x128", "128x1"):
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            OPS[name](x, True, True, off)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            q, s = OPS[name](x, True, True, off)
        want_q, want_s = OPS[name](x, True, True)
        q.view(torch.uint8).fill_(0x7F)
        s.fill_(float("nan"))
        off[-1] = 300
        graph.replay()
        torch.cuda.synchronize()
        live = 300 if name == "1x128" else 384
        rows_q = (slice(0, live),) if name == "1x128" else (slice(None), slice(0, live))
        rows_s = (slice(None), slice(0, live)) if name == "1x128" else (slice(0, live // 128),)
        assert torch.equal(q[rows_q].view(torch.uint8), want_q[rows_q].view(torch.uint8)), name
        assert torch.equal(s[rows_s], want_s[rows_s]), name
        assert s.isnan().sum() == s.numel() - s[rows_s].numel(), f"{name}: scales written past the bound"
        off[-1] = 1024


# ---------------------------------------------------------------- fp8_swiglu_quant and fp8_swiglu_backward


def swiglu_inputs(R, inter, seed):
    """Fresh random inputs, no zeros: h [R, 2I] bf16 (gates over about +-10, some saturating ones, a row of small
    up values), da [R, I] fp32 with row scales over 1e-2 .. 1e2, row_weight [R] fp32 in [0.05, 1.05)."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(R, 2 * inter, generator=gen) * 3
    if R > 2:
        h[1, :8] = torch.tensor([-100.0, -30.0, -1.28, 100.0, 30.0, 1e-30, -1e-30, 88.0])
        h[2, inter:] *= 1e-3
    da = torch.randn(R, inter, generator=gen) * 10 ** (torch.rand(R, 1, generator=gen) * 4 - 2)
    row_weight = torch.rand(R, generator=gen) + 0.05
    return h.bfloat16(), da, row_weight


def bf16_ulp(t):
    """One bf16 ulp at |t| (float64; 2^-133 at zero)."""
    _, e = torch.frexp(t.double().abs())
    return torch.ldexp(torch.ones_like(t, dtype=torch.float64), (e - 8).clamp(min=-133))


def assert_bf16_close(got, want, what, ulps=1, equal_fraction=0.999):
    """got (CUDA bf16) within `ulps` bf16 ulps of want (CPU bf16) everywhere, and bit-equal on at least
    equal_fraction of the elements (differences come from CUDA's expf being an ulp off torch's exp)."""
    g, w = got.cpu().double(), want.double()
    assert g.isfinite().all(), f"{what}: non-finite values"
    tol = ulps * bf16_ulp(torch.maximum(g.abs(), w.abs()))
    bad = (g - w).abs() > tol
    assert not bad.any(), f"{what}: {int(bad.sum())} elements past {ulps} ulp(s), first at {bad.nonzero()[0].tolist()}"
    differ = int((got.cpu().view(torch.int16) != want.view(torch.int16)).sum())
    assert differ <= max(2, (1 - equal_fraction) * want.numel()), f"{what}: {differ} of {want.numel()} elements differ"


def assert_quantized_close(got_q, got_s, want_q, want_s, what):
    """1x128 quantisations (q [n, C] e4m3, MN-major scales [C / 128, n]) of bf16 values that may differ by an ulp:
    at least 99.9% of the bytes and scales equal, and every dequantised value within one e4m3 step of the CPU's
    (a value an ulp apart can round to the neighbouring e4m3 value)."""
    gq, wq = got_q.cpu(), want_q
    gs, ws = got_s.cpu(), want_s
    assert gs.isfinite().all() and (gs > 0).all(), f"{what}: bad scales"
    # At most 0.1% differ (a flipped tile amax can change a whole tile: 128 bytes are allowed in small cases).
    differ_q = int((gq.view(torch.uint8) != wq.view(torch.uint8)).sum())
    differ_s = int((gs != ws).sum())
    assert differ_q <= max(128, 0.001 * wq.numel()) and differ_s <= max(1, 0.001 * ws.numel()), (
        f"{what}: {differ_q} of {wq.numel()} bytes and {differ_s} of {ws.numel()} scales differ")
    g = fp8.dequantize_1x128(gq, gs.t().contiguous(), torch.float64)
    w = fp8.dequantize_1x128(wq, ws.t().contiguous(), torch.float64)
    step = torch.maximum(gs, ws).t().double().repeat_interleave(128, dim=1) * 2.0 ** -9  # e4m3 subnormal step
    bad = (g - w).abs() > 0.125 * torch.maximum(g.abs(), w.abs()) + step
    assert not bad.any(), f"{what}: {int(bad.sum())} dequantised values past one e4m3 step"


# (R, I, routed rows n)
SWIGLU_CASES = [(1, 128, 1), (17, 128, 11), (17, 768, 17), (17, 1536, 0), (4095, 128, 4000), (4095, 768, 3001),
                (4095, 1536, 2048), (1000, 1536, 1000)]


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("R,inter,n", SWIGLU_CASES)
def test_swiglu_quant_cuda_matches_cpu(R, inter, n, pow2):
    h, da, _ = swiglu_inputs(R, inter, seed=R * 7 + inter + pow2)
    off = offsets(0, n // 2, n)
    want_q, want_s = ops.fp8_swiglu_quant(h, off, pow2)
    h_cuda, off_cuda = h.cuda(), off.cuda()
    poison_caching_allocator()
    got_q, got_s = ops.fp8_swiglu_quant(h_cuda, off_cuda, pow2)
    what = f"fp8_swiglu_quant R={R} I={inter} n={n} pow2={pow2}"
    assert got_q.dtype == want_q.dtype and got_q.shape == want_q.shape and got_q.stride() == want_q.stride(), what
    assert got_s.dtype == want_s.dtype and got_s.shape == want_s.shape and got_s.stride() == want_s.stride(), what
    assert_quantized_close(got_q[:n], got_s[:, :n], want_q[:n], want_s[:, :n], what)
    assert_unwritten(got_q[n:], f"{what} a_q")
    assert_unwritten(got_s[:, n:], f"{what} a_scale")
    # The same a as the backward's (row_weight 1: aw = a), quantised by the 1x128 quantiser: bitwise.
    _, _, _, a, _ = ops.fp8_swiglu_backward(da.cuda(), h_cuda, torch.ones(R, device="cuda"), off_cuda, pow2)
    q, s = ops.quantize_fp8_1x128(a[:n].contiguous(), pow2, True)
    assert_bits_equal(got_q[:n], q.cpu(), f"{what}: a_q against quantize_fp8_1x128 of the backward's a")
    assert_bits_equal(got_s[:, :n], s.cpu(), f"{what}: a_scale against quantize_fp8_1x128 of the backward's a")
    _, _, want_a = _quant_ops._swiglu_terms(h[:n])
    assert_bf16_close(a[:n], want_a, f"{what}: a")


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("R,inter,n", SWIGLU_CASES)
def test_swiglu_backward_cuda_matches_cpu(R, inter, n, pow2):
    h, da, row_weight = swiglu_inputs(R, inter, seed=R * 5 + inter + pow2)
    off = offsets(0, n, n)
    want = ops.fp8_swiglu_backward(da, h, row_weight, off, pow2)
    args = (da.cuda(), h.cuda(), row_weight.cuda(), off.cuda())
    poison_caching_allocator()
    got = ops.fp8_swiglu_backward(*args, pow2)
    what = f"fp8_swiglu_backward R={R} I={inter} n={n} pow2={pow2}"
    for name, g, w in zip(("dh", "dh_q", "dh_scale", "aw", "dot"), got, want):
        assert g.is_cuda and g.dtype == w.dtype and g.shape == w.shape and g.stride() == w.stride(), f"{what} {name}"
    dh, dh_q, dh_scale, aw, dot = got
    assert_bf16_close(dh[:n], want[0][:n], f"{what} dh")
    # dh_q is the 1x128 quantisation of the kernel's own bf16 dh (bitwise), and close to the CPU kernel's.
    q, s = ops.quantize_fp8_1x128(dh[:n].contiguous(), pow2, True)
    assert_bits_equal(dh_q[:n], q.cpu(), f"{what} dh_q against quantize_fp8_1x128 of dh")
    assert_bits_equal(dh_scale[:, :n], s.cpu(), f"{what} dh_scale against quantize_fp8_1x128 of dh")
    assert_quantized_close(dh_q[:n], dh_scale[:, :n], want[1][:n], want[2][:, :n], f"{what} dh_q")
    assert_bf16_close(aw[:n], want[3][:n], f"{what} aw", ulps=2)
    _, _, a = _quant_ops._swiglu_terms(h[:n])
    magnitude = (da[:n].double() * a.double()).abs().sum(1)
    err = (dot[:n].cpu().double() - want[4][:n].double()).abs()
    assert (err <= 1e-5 * magnitude + 1e-30).all(), f"{what} dot: max error {(err / magnitude).max().item():.3g}"
    for name, t in (("dh", dh[n:]), ("dh_q", dh_q[n:]), ("dh_scale", dh_scale[:, n:]), ("aw", aw[n:])):
        assert_unwritten(t, f"{what} {name}")
    if n < R:  # fp32 poison: 0x7FC07FC0
        assert_unwritten(dot[n:], f"{what} dot")


def test_swiglu_deterministic_and_graph_replay():
    """Two runs are bitwise equal (no atomics), and a graph replay equals eager."""
    h, da, row_weight = swiglu_inputs(2048, 768, seed=9)
    h, da, row_weight = h.cuda(), da.cuda(), row_weight.cuda()
    off = offsets(0, 1000, 2000, device="cuda")
    eager = [*ops.fp8_swiglu_quant(h, off), *ops.fp8_swiglu_backward(da, h, row_weight, off)]
    again = [*ops.fp8_swiglu_quant(h, off), *ops.fp8_swiglu_backward(da, h, row_weight, off)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.fp8_swiglu_quant(h, off)
        ops.fp8_swiglu_backward(da, h, row_weight, off)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = [*ops.fp8_swiglu_quant(h, off), *ops.fp8_swiglu_backward(da, h, row_weight, off)]
    graph.replay()
    torch.cuda.synchronize()
    for i, (e, a, s) in enumerate(zip(eager, again, static)):
        rows = (slice(None), slice(0, 2000)) if e.dim() == 2 and e.shape[1] == 2048 else (slice(0, 2000),)
        assert_bits_equal(a[rows], e[rows].cpu(), f"output {i}: second run")
        assert_bits_equal(s[rows], e[rows].cpu(), f"output {i}: graph replay")


def test_swiglu_opcheck_on_cuda():
    h, da, row_weight = swiglu_inputs(40, 256, seed=4)
    off = offsets(0, 17, 40, device="cuda")
    torch.library.opcheck(ops.fp8_swiglu_quant, (h.cuda(), off, True))
    torch.library.opcheck(ops.fp8_swiglu_backward, (da.cuda(), h.cuda(), row_weight.cuda(), off, True))


def test_swiglu_misaligned_h_names_the_argument():
    base = torch.zeros(64 * 256 + 8, dtype=torch.bfloat16, device="cuda")
    h = base[1:1 + 64 * 256].view(64, 256)
    off = offsets(0, 64, device="cuda")
    with pytest.raises(RuntimeError, match="h: expected 16-byte aligned data on CUDA"):
        ops.fp8_swiglu_quant(h, off)
    with pytest.raises(RuntimeError, match="h: expected 16-byte aligned data on CUDA"):
        ops.fp8_swiglu_backward(torch.zeros(64, 128, device="cuda"), h, torch.ones(64, device="cuda"), off)


def test_swiglu_bandwidth(capsys):
    """Reported (pytest -s) at an H200-size problem (R = 139264 rows, I = 1536); the floor only catches a broken
    kernel (the aim is > 3 TB/s)."""
    R, inter = 139264, 1536
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(R, 2 * inter, device="cuda", generator=gen) * 3).bfloat16()
    da = torch.randn(R, inter, device="cuda", generator=gen)
    row_weight = torch.rand(R, device="cuda", generator=gen)
    off = offsets(0, R // 2, R, device="cuda")
    tiles = 2 * inter // 128
    moved = {
        "fp8_swiglu_quant": R * (2 * inter * 2 + inter + tiles // 2 * 4),
        # da and h and the weight in; dh, dh_q, dh_scale, aw and dot out.
        "fp8_swiglu_backward": R * (inter * 4 + 2 * inter * 2 + 4 + 2 * inter * 2 + 2 * inter + tiles * 4
                                    + inter * 2 + 4),
    }
    calls = {"fp8_swiglu_quant": lambda: ops.fp8_swiglu_quant(h, off),
             "fp8_swiglu_backward": lambda: ops.fp8_swiglu_backward(da, h, row_weight, off)}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    report = []
    for name, call in calls.items():
        for _ in range(3):
            call()
        start.record()
        for _ in range(10):
            call()
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / 10
        report.append((name, moved[name] / seconds / 1e9, seconds * 1e6))
    with capsys.disabled():
        for name, gbps, us in report:
            print(f"\n{name} [{R}, {inter}]: {us:.1f} us, {gbps:.0f} GB/s", end="")
        print()
    for name, gbps, _ in report:
        assert gbps > 500, f"{name}: {gbps:.0f} GB/s"
