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
