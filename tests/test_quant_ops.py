"""torch.ops.primemoe.quantize_fp8_* on CPU: schemas and fake kernels (opcheck), the CPU kernels (the reference
quantisers of primemoe.fp8) and the argument checks, which the CUDA impls run too (csrc/binding/quant_ops.cpp)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import primemoe  # noqa: F401  (registers the ops)
from primemoe import fp8

ops = torch.ops.primemoe
E4M3 = torch.float8_e4m3fn


def bf16(*shape, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).bfloat16()


# op name -> (the op, the reference, shapes of its input)
OPS = {
    "1x128": (ops.quantize_fp8_1x128, fp8.quantize_1x128, [(0, 256), (3, 384), (130, 128)]),
    "128x1": (ops.quantize_fp8_128x1, fp8.quantize_128x1, [(0, 64), (128, 8), (256, 200)]),
    "128x128": (ops.quantize_fp8_128x128, fp8.quantize_128x128, [(128, 128), (3, 256, 384), (0, 128, 256)]),
}
CASES = [(name, shape) for name, (_, _, shapes) in OPS.items() for shape in shapes]


def expected_shapes(name, shape):
    *lead, M, K = shape
    if name == "1x128":
        return (M, K), (M, K // 128)
    if name == "128x1":
        return (K, M), (K, M // 128)
    return tuple(shape), (*lead, M // 128, K // 128)


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("name,shape", CASES)
def test_opcheck(name, shape, pow2):
    torch.library.opcheck(OPS[name][0], (bf16(*shape, seed=len(shape)), pow2))


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("name,shape", CASES)
def test_cpu_kernel_is_the_reference(name, shape, pow2):
    op, reference, _ = OPS[name]
    x = bf16(*shape, seed=3, scale=100.0)
    q, s = op(x, pow2)
    want_q, want_s = reference(x, pow2)
    q_shape, s_shape = expected_shapes(name, shape)
    # The strides of a fresh allocation, as the CUDA impls' (empty outputs included).
    assert q.dtype == E4M3 and tuple(q.shape) == q_shape and q.stride() == torch.empty(q_shape).stride()
    assert s.dtype == torch.float32 and tuple(s.shape) == s_shape and s.stride() == torch.empty(s_shape).stride()
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s.view(torch.int32), want_s.view(torch.int32))


@pytest.mark.parametrize("name,shape", CASES)
def test_fake_shapes(name, shape):
    with FakeTensorMode():
        q, s = OPS[name][0](torch.empty(shape, dtype=torch.bfloat16))
    q_shape, s_shape = expected_shapes(name, shape)
    assert q.dtype == E4M3 and tuple(q.shape) == q_shape
    assert s.dtype == torch.float32 and tuple(s.shape) == s_shape


def test_zero_tiles_get_scale_one_and_pow2_scales_are_powers_of_two():
    x = bf16(256, 256, seed=5, scale=3.0)
    x[:128, :128] = 0
    for name in OPS:
        q, s = OPS[name][0](x)
        assert s.view(-1)[0] == 1.0, name  # the first tile lies in the zero block in every tiling
        assert not q.view(torch.uint8).view(-1)[0], name
        mantissa = s.view(torch.int32) & 0x7FFFFF
        assert not mantissa.any(), f"{name}: a pow2 scale with mantissa bits"


def non_contiguous(shape):
    return bf16(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)


# case -> (op name, input, message pattern)
BAD_INPUTS = {
    "1x128_float32": ("1x128", torch.randn(2, 128), "x: expected bfloat16, got Float"),
    "1x128_float16": ("1x128", torch.randn(2, 128).half(), "x: expected bfloat16, got Half"),
    "1x128_1d": ("1x128", bf16(128), r"x: expected a 2-D tensor \[rows, K\], got \[128\]"),
    "1x128_3d": ("1x128", bf16(1, 2, 128), r"x: expected a 2-D tensor \[rows, K\], got \[1, 2, 128\]"),
    "1x128_K": ("1x128", bf16(2, 100), "x: expected a multiple of 128 columns .*, got 100"),
    "1x128_non_contiguous": ("1x128", non_contiguous((256, 128)), "x: expected a contiguous tensor"),
    "128x1_float32": ("128x1", torch.randn(128, 8), "x: expected bfloat16, got Float"),
    "128x1_1d": ("128x1", bf16(128), r"x: expected a 2-D tensor \[M, K\], got \[128\]"),
    "128x1_M": ("128x1", bf16(100, 64), "x: expected a multiple of 128 rows .*, got 100"),
    "128x1_K": ("128x1", bf16(128, 12), "x: expected a multiple of 8 columns .*, got 12"),
    "128x1_non_contiguous": ("128x1", non_contiguous((128, 128)), "x: expected a contiguous tensor"),
    "128x128_float32": ("128x128", torch.randn(128, 128), "w: expected bfloat16, got Float"),
    "128x128_1d": ("128x128", bf16(128), r"w: expected a tensor of at least 2 dimensions \[\.\.\., N, K\]"),
    "128x128_N": ("128x128", bf16(2, 100, 128), r"w: expected its last two sizes \[N, K\] .*, got \[2, 100, 128\]"),
    "128x128_K": ("128x128", bf16(128, 64), r"w: expected its last two sizes \[N, K\] .*, got \[128, 64\]"),
    "128x128_non_contiguous": ("128x128", non_contiguous((2, 128, 256)), "w: expected a contiguous tensor"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_names_the_argument(case):
    name, x, match = BAD_INPUTS[case]
    with pytest.raises(RuntimeError, match=match):
        OPS[name][0](x)


# ---------------------------------------------------------------- the quantisers' options


def offsets(*values):
    return torch.tensor(values, dtype=torch.int32)


# op name -> (shape, routed rows n): expert_offsets = [0, n // 2, n]; n past the rows is clamped.
OPTION_SHAPES = {
    "1x128": [((3, 384), 2), ((130, 128), 129), ((17, 256), 0), ((5, 128), 9)],
    "128x1": [((256, 200), 100), ((384, 64), 129), ((128, 8), 0), ((256, 16), 256)],
}
OPTION_CASES = [(name, shape, n) for name, cases in OPTION_SHAPES.items() for shape, n in cases]


def expected_with_options(name, x, pow2, scale_mn_major, n):
    """The reference quantisation with the rows (128x1: row tiles) at or past n zeroed and the scale transposed."""
    q, s = OPS[name][1](x, pow2)
    if n is not None:
        n = min(max(n, 0), x.shape[0])
        if name == "1x128":
            q.view(torch.uint8)[n:] = 0
            s[n:] = 0
        else:
            tiles = -(-n // 128)
            q.view(torch.uint8)[:, tiles * 128:] = 0
            s[:, tiles:] = 0
    if scale_mn_major:
        s = s.t()
    return q.contiguous(), s.contiguous()


@pytest.mark.parametrize("bounded", [False, True])
@pytest.mark.parametrize("scale_mn_major", [False, True])
@pytest.mark.parametrize("name,shape,n", OPTION_CASES)
def test_options_cpu_kernel(name, shape, n, scale_mn_major, bounded):
    x = bf16(*shape, seed=7, scale=30.0)
    off = offsets(0, n // 2, n) if bounded else None
    for pow2 in (True, False):
        q, s = OPS[name][0](x, pow2, scale_mn_major, off)
        want_q, want_s = expected_with_options(name, x, pow2, scale_mn_major, n if bounded else None)
        # The strides of a fresh allocation, as the CUDA impls'.
        assert q.dtype == E4M3 and q.shape == want_q.shape and q.stride() == torch.empty(q.shape).stride()
        assert s.dtype == torch.float32 and s.shape == want_s.shape and s.stride() == torch.empty(s.shape).stride()
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(s.view(torch.int32), want_s.view(torch.int32))


def test_options_scale_layouts():
    x = bf16(256, 384, seed=8, scale=5.0)
    q, s = ops.quantize_fp8_1x128(x, True, True)
    assert tuple(s.shape) == (3, 256) and torch.equal(s, fp8.quantize_1x128(x)[1].t())
    q_t, s = ops.quantize_fp8_128x1(x, True, True)
    assert tuple(s.shape) == (2, 384) and torch.equal(s, fp8.quantize_128x1(x)[1].t())


@pytest.mark.parametrize("scale_mn_major", [False, True])
@pytest.mark.parametrize("name,shape,n", OPTION_CASES)
def test_options_opcheck(name, shape, n, scale_mn_major):
    torch.library.opcheck(OPS[name][0], (bf16(*shape, seed=9), True, scale_mn_major, offsets(0, n)))


@pytest.mark.parametrize("scale_mn_major", [False, True])
@pytest.mark.parametrize("name,shape,n", OPTION_CASES)
def test_options_fake_shapes(name, shape, n, scale_mn_major):
    with FakeTensorMode():
        q, s = OPS[name][0](torch.empty(shape, dtype=torch.bfloat16), True, scale_mn_major,
                            torch.empty(3, dtype=torch.int32))
    q_shape, s_shape = expected_shapes(name, shape)
    assert q.dtype == E4M3 and tuple(q.shape) == q_shape
    assert s.dtype == torch.float32 and tuple(s.shape) == (s_shape[::-1] if scale_mn_major else s_shape)


BAD_OFFSETS = {
    "int64": (torch.tensor([0, 3], dtype=torch.int64), "expert_offsets: expected int32, got Long"),
    "2d": (offsets(0, 3).view(1, 2), r"expert_offsets: expected a 1-D tensor, got \[1, 2\]"),
    "one_entry": (offsets(3), "expert_offsets: expected at least 2 entries .*, got 1"),
    "non_contiguous": (offsets(0, 1, 2, 3)[::2], "expert_offsets: expected a contiguous tensor"),
}


@pytest.mark.parametrize("case", BAD_OFFSETS)
@pytest.mark.parametrize("name", ["1x128", "128x1"])
def test_bad_expert_offsets_names_the_argument(name, case):
    off, match = BAD_OFFSETS[case]
    with pytest.raises(RuntimeError, match=match):
        OPS[name][0](bf16(128, 128), True, False, off)


# ---------------------------------------------------------------- the FP8 SwiGLU epilogues


def swiglu_inputs(R, inter, seed=0):
    """h [R, 2I] bf16 (gates over about +-8 plus a few saturating ones), da [R, I] fp32, row_weight [R] fp32."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(R, 2 * inter, generator=gen) * 3
    if R > 2 and inter >= 128:
        h[1, :8] = torch.tensor([-100.0, -30.0, -1.28, 100.0, 30.0, 1e-30, -1e-30, 88.0])
        h[2, inter:] *= 1e-3  # a row of small values (small dh tiles)
    da = torch.randn(R, inter, generator=gen) * 10 ** (torch.rand(R, 1, generator=gen) * 4 - 2)
    row_weight = torch.rand(R, generator=gen) + 0.05
    return h.bfloat16(), da, row_weight


# (R, I, routed rows n)
SWIGLU_CASES = [(0, 128, 0), (1, 128, 1), (5, 256, 3), (17, 384, 11), (9, 128, 0), (40, 768, 40)]


def expected_swiglu_quant(h, n, pow2):
    from primemoe import reference
    R, inter = h.shape[0], h.shape[1] // 2
    a = reference._swiglu_bf16(h[:n])
    q, s = fp8.quantize_1x128(a, pow2)
    want_q = torch.zeros(R, inter, dtype=torch.uint8)
    want_s = torch.zeros(inter // 128, R)
    want_q[:n] = q.view(torch.uint8)
    want_s[:, :n] = s.t()
    return want_q, want_s


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("R,inter,n", SWIGLU_CASES)
def test_swiglu_quant_cpu_kernel(R, inter, n, pow2):
    h, _, _ = swiglu_inputs(R, inter, seed=R + inter)
    a_q, a_scale = ops.fp8_swiglu_quant(h, offsets(0, n // 3, n), pow2)
    assert a_q.dtype == E4M3 and tuple(a_q.shape) == (R, inter) and a_q.is_contiguous()
    assert a_scale.dtype == torch.float32 and tuple(a_scale.shape) == (inter // 128, R) and a_scale.is_contiguous()
    want_q, want_s = expected_swiglu_quant(h, n, pow2)
    assert torch.equal(a_q.view(torch.uint8), want_q)
    assert torch.equal(a_scale.view(torch.int32), want_s.view(torch.int32))


def swiglu_backward_expected(da, h, row_weight, n, pow2):
    """The reference's step 9-11 expressions (reference.moe_fp8_backward) on the rows before n."""
    from primemoe import reference
    gate, up = h[:n].float().chunk(2, dim=-1)
    a = reference._swiglu_bf16(h[:n])
    weight = row_weight[:n].unsqueeze(1)
    sig = torch.sigmoid(gate)
    dw = da[:n] * weight
    dh = torch.cat([dw * up * sig * (1 + gate * (1 - sig)), dw * gate * sig], dim=1).to(torch.bfloat16)
    q, s = fp8.quantize_1x128(dh, pow2)
    aw = (weight * a.float()).to(torch.bfloat16)
    dot = (da[:n].double() * a.double()).sum(1).float()
    return dh, q, s.t(), aw, dot


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("R,inter,n", SWIGLU_CASES)
def test_swiglu_backward_cpu_kernel(R, inter, n, pow2):
    h, da, row_weight = swiglu_inputs(R, inter, seed=3 * R + inter)
    dh, dh_q, dh_scale, aw, dot = ops.fp8_swiglu_backward(da, h, row_weight, offsets(0, n), pow2)
    shapes = [(dh, torch.bfloat16, (R, 2 * inter)), (dh_q, E4M3, (R, 2 * inter)),
              (dh_scale, torch.float32, (2 * inter // 128, R)), (aw, torch.bfloat16, (R, inter)),
              (dot, torch.float32, (R,))]
    for t, dtype, shape in shapes:
        assert t.dtype == dtype and tuple(t.shape) == shape and t.is_contiguous()
    want = swiglu_backward_expected(da, h, row_weight, n, pow2)
    assert torch.equal(dh[:n].view(torch.int16), want[0].view(torch.int16))
    assert torch.equal(dh_q[:n].view(torch.uint8), want[1].view(torch.uint8))
    assert torch.equal(dh_scale[:, :n].view(torch.int32), want[2].view(torch.int32))
    assert torch.equal(aw[:n].view(torch.int16), want[3].view(torch.int16))
    assert torch.equal(dot[:n].view(torch.int32), want[4].view(torch.int32))
    for t in (dh[n:], dh_q[n:].view(torch.uint8), dh_scale[:, n:], aw[n:], dot[n:]):
        assert not t.any()  # zeros past the routed rows (the CUDA impl leaves them unwritten)


def test_swiglu_backward_is_the_derivative():
    """dh is the gradient of sum(w * da * silu(g) * u) over h (float64 autograd), within bf16 rounding; dot is
    <da, a>; aw is w * a."""
    h, da, row_weight = swiglu_inputs(33, 256, seed=11)
    dh, dh_q, dh_scale, aw, dot = ops.fp8_swiglu_backward(da, h, row_weight, offsets(0, 33))
    h64 = h.double().requires_grad_()
    gate, up = h64.chunk(2, dim=-1)
    a64 = torch.nn.functional.silu(gate) * up
    (a64 * da.double() * row_weight.double().unsqueeze(1)).sum().backward()
    want = h64.grad
    assert torch.allclose(dh.double(), want, rtol=2 ** -7, atol=1e-6 * want.abs().max().item())
    assert torch.allclose(fp8.dequantize_1x128(dh_q, dh_scale.t().contiguous(), torch.float64), dh.double(),
                          rtol=2 ** -3, atol=dh_scale.max().item() * 2 ** -9)
    a = a64.detach()
    assert torch.allclose(aw.double(), row_weight.double().unsqueeze(1) * a, rtol=2 ** -7, atol=1e-30)
    want_dot = (da.double() * a).sum(1)
    assert torch.allclose(dot.double(), want_dot, rtol=1e-2, atol=1e-2 * (da.double() * a).abs().sum(1).max().item())


def test_swiglu_ops_share_a():
    """With row_weight 1, the backward's aw is a itself: the forward's a_q is its 1x128 quantisation."""
    h, da, _ = swiglu_inputs(20, 384, seed=12)
    off = offsets(0, 20)
    a_q, a_scale = ops.fp8_swiglu_quant(h, off)
    _, _, _, aw, _ = ops.fp8_swiglu_backward(da, h, torch.ones(20), off)
    q, s = fp8.quantize_1x128(aw)
    assert torch.equal(a_q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(a_scale, s.t())


@pytest.mark.parametrize("R,inter,n", SWIGLU_CASES[:4])
def test_swiglu_opcheck(R, inter, n):
    h, da, row_weight = swiglu_inputs(R, inter, seed=R)
    torch.library.opcheck(ops.fp8_swiglu_quant, (h, offsets(0, n), True))
    torch.library.opcheck(ops.fp8_swiglu_backward, (da, h, row_weight, offsets(0, n), False))


def test_swiglu_fake_shapes():
    with FakeTensorMode():
        h = torch.empty(7, 512, dtype=torch.bfloat16)
        off = torch.empty(4, dtype=torch.int32)
        a_q, a_scale = ops.fp8_swiglu_quant(h, off)
        outs = ops.fp8_swiglu_backward(torch.empty(7, 256), h, torch.empty(7), off)
    assert a_q.dtype == E4M3 and tuple(a_q.shape) == (7, 256)
    assert a_scale.dtype == torch.float32 and tuple(a_scale.shape) == (2, 7)
    want = [(torch.bfloat16, (7, 512)), (E4M3, (7, 512)), (torch.float32, (4, 7)), (torch.bfloat16, (7, 256)),
            (torch.float32, (7,))]
    assert [(t.dtype, tuple(t.shape)) for t in outs] == want


def swiglu_args(**change):
    """Valid fp8_swiglu_backward arguments (R = 4, I = 128), with some replaced."""
    args = dict(da=torch.randn(4, 128), h=bf16(4, 256), row_weight=torch.rand(4), expert_offsets=offsets(0, 4))
    args.update(change)
    return args


# case -> (op, arguments, message pattern)
BAD_SWIGLU = {
    "quant_h_float32": ("quant", dict(h=torch.randn(4, 256)), "h: expected bfloat16, got Float"),
    "quant_h_1d": ("quant", dict(h=bf16(256)), r"h: expected a 2-D tensor \[rows, 2I\], got \[256\]"),
    "quant_h_I": ("quant", dict(h=bf16(4, 384)), "h: expected 2I columns with I a multiple of 128 .*, got 384"),
    "quant_h_non_contiguous": ("quant", dict(h=non_contiguous((256, 256))), "h: expected a contiguous tensor"),
    "quant_offsets_int64": ("quant", dict(expert_offsets=torch.tensor([0, 4])), "expert_offsets: expected int32"),
    "quant_offsets_one": ("quant", dict(expert_offsets=offsets(4)), "expert_offsets: expected at least 2 entries"),
    "bwd_h_I": ("bwd", dict(h=bf16(4, 128)), "h: expected 2I columns with I a multiple of 128 .*, got 128"),
    "bwd_h_float32": ("bwd", dict(h=torch.randn(4, 256)), "h: expected bfloat16, got Float"),
    "bwd_da_bf16": ("bwd", dict(da=bf16(4, 128)), "da: expected float32, got BFloat16"),
    "bwd_da_shape": ("bwd", dict(da=torch.randn(4, 256)), r"da: expected shape \[4, 128\] .*, got \[4, 256\]"),
    "bwd_da_rows": ("bwd", dict(da=torch.randn(5, 128)), r"da: expected shape \[4, 128\] .*, got \[5, 128\]"),
    "bwd_da_non_contiguous": ("bwd", dict(da=torch.randn(128, 4).t()), "da: expected a contiguous tensor"),
    "bwd_weight_bf16": ("bwd", dict(row_weight=torch.rand(4).bfloat16()), "row_weight: expected float32, got BFloat16"),
    "bwd_weight_shape": ("bwd", dict(row_weight=torch.rand(5)), r"row_weight: expected shape \[4\] .*, got \[5\]"),
    "bwd_weight_2d": ("bwd", dict(row_weight=torch.rand(4, 1)), r"row_weight: expected shape \[4\] .*, got \[4, 1\]"),
    "bwd_weight_non_contiguous": ("bwd", dict(row_weight=torch.rand(8)[::2]), "row_weight: expected a contiguous"),
    "bwd_offsets_2d": ("bwd", dict(expert_offsets=offsets(0, 4).view(2, 1)), "expert_offsets: expected a 1-D tensor"),
}


@pytest.mark.parametrize("case", BAD_SWIGLU)
def test_bad_swiglu_input_names_the_argument(case):
    op, change, match = BAD_SWIGLU[case]
    args = swiglu_args(**change)
    with pytest.raises(RuntimeError, match=match):
        if op == "quant":
            ops.fp8_swiglu_quant(args["h"], args["expert_offsets"])
        else:
            ops.fp8_swiglu_backward(args["da"], args["h"], args["row_weight"], args["expert_offsets"])
