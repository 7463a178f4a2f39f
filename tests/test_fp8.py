"""Blockwise FP8 (issue 38) on the CPU: the quantisers of primemoe.fp8, the quantised-weight cache and the
FP8-emulating reference (primemoe.reference.moe_fp8 / moe_fp8_backward).

The quantisers are checked against a naive per-tile implementation written here from the recipe's words
(float32 division through numpy, the power of two through math.frexp, E4M3 round-to-nearest-even through
frexp and round-half-even, nothing shared with the library or with torch's float8 cast), and the emulating
reference against a naive loop over tokens and slots built on that naive quantiser.

FP8 tolerance against the unquantised fp64 reference (relative Frobenius error, H = I = 256, E = 4, K = 2,
T = 37): E4M3 keeps 3 mantissa bits, so each quantised operand carries about 3% rms relative error and each
output goes through about four quantisations (its two GEMM operands and the operands upstream of them).
Measured over 12 seeded problems (3 seeds x masked / uniform / skewed / one-expert routing): 0.061-0.070 for
y, dx, dw1 and dw2 and 0.050-0.083 for d_topk_weights (dot products that cancel: heavier-tailed), with
power-of-two or exact scales alike; fp8_bwd's gradients 0.031-0.055; the bf16 composite 0.003-0.005. The
bounds below are about 1.5x those; the lower bound proves the quantisation is not a no-op.
"""

from __future__ import annotations

import gc
import math
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import OUTPUT_NAMES, Outputs, make_problem, reference64, run_moe

import primemoe
from primemoe import fp8
from primemoe._validate import check_fp8_problem
from primemoe.reference import moe_fp8, moe_fp8_backward

FP8_TOL = {"y": 0.10, "dx": 0.10, "dtw": 0.13, "dw1": 0.10, "dw2": 0.10}
FP8_FLOOR = 0.02  # every output's error is above this: the operands really were quantised
QUANTIZE_128X128 = fp8.quantize_128x128  # the real one (the cache tests count calls through a wrapper)


def bits(q: torch.Tensor) -> torch.Tensor:
    """Bytes of an e4m3 tensor (torch.equal has no float8 kernel)."""
    return q.contiguous().view(torch.uint8)


def assert_same_quantisation(got, want):
    (qg, sg), (qw, sw) = got, want
    assert qg.dtype == qw.dtype == torch.float8_e4m3fn and sg.dtype == sw.dtype == torch.float32
    assert qg.shape == qw.shape and sg.shape == sw.shape
    assert torch.equal(bits(qg), bits(qw)), "q differs"
    assert torch.equal(sg.view(torch.int32), sw.view(torch.int32)), "s differs"


def rel_err(got, want) -> float:
    den = torch.linalg.vector_norm(want.double()).item()
    num = torch.linalg.vector_norm(got.double() - want.double()).item()
    return num / den if den else num


# ---------------------------------------------------------------- a naive quantiser, from the recipe's words


def naive_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round float64 values in [-448, 448] to the nearest E4M3 value, ties to even (float64 result)."""
    a = v.abs()
    _, exponent = torch.frexp(a)  # a = mantissa * 2**exponent, mantissa in [0.5, 1)
    e = torch.clamp(exponent - 1, min=-6)  # floor(log2 a), the subnormals share 2**-6's spacing
    step = torch.ldexp(torch.ones_like(a), e - 3)  # 3 mantissa bits
    return torch.copysign(torch.round(a / step) * step, v)  # torch.round: half to even


def naive_tile(tile: torch.Tensor, pow2: bool):
    """(q as float64 values, s as a Python float) of one tile."""
    t32 = tile.to(torch.float32)
    amax = np.float32(t32.abs().max().item())
    if amax == 0:
        m = np.float32(1.0)
    else:
        m = np.float32(448.0) / amax  # IEEE float32 division
        if pow2:
            _, exponent = math.frexp(float(m))
            m = np.float32(math.ldexp(1.0, exponent - 1))
    scaled = (t32 * torch.tensor(float(m), dtype=torch.float32)).double()
    q = naive_e4m3(scaled.clamp(-448.0, 448.0))
    return q, float(np.float32(1.0) / m)


def naive_1x128(t: torch.Tensor, pow2=True):
    """Dequantised float64 values of the 1x128 quantisation of t [M, K], one tile at a time."""
    out = torch.empty(t.shape, dtype=torch.float64)
    for i in range(t.shape[0]):
        for j in range(0, t.shape[1], 128):
            q, s = naive_tile(t[i, j:j + 128], pow2)
            out[i, j:j + 128] = q * s
    return out


def naive_128x1(t: torch.Tensor, pow2=True):
    """Dequantised float64 values of the 128x1 quantisation of t [M, K] (as [M, K])."""
    out = torch.empty(t.shape, dtype=torch.float64)
    for i in range(0, t.shape[0], 128):
        for k in range(t.shape[1]):
            q, s = naive_tile(t[i:i + 128, k], pow2)
            out[i:i + 128, k] = q * s
    return out


def naive_128x128(w: torch.Tensor, pow2=True):
    out = torch.empty(w.shape, dtype=torch.float64)
    for i in range(0, w.shape[0], 128):
        for j in range(0, w.shape[1], 128):
            q, s = naive_tile(w[i:i + 128, j:j + 128], pow2)
            out[i:i + 128, j:j + 128] = q * s
    return out


def varied(rows, cols, seed, dtype=torch.float32):
    """Random values whose magnitude varies by orders of magnitude from tile to tile and within tiles."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=gen) * torch.exp(4 * torch.randn(rows, cols // 128, 1, generator=gen)
                                                         ).repeat_interleave(128, 1).view(rows, cols)
    t = t * torch.exp(torch.randn(rows, cols, generator=gen))
    return t.to(dtype)


# ---------------------------------------------------------------- quantisers


def test_e4m3_cast_is_round_to_nearest_even():
    """The recipe's cast: torch's float8_e4m3fn conversion of values in [-448, 448] is RNE, ties included."""
    grid = naive_e4m3(torch.linspace(-448, 448, 20001, dtype=torch.float64))
    representable = torch.unique(grid)
    mids = (representable[1:] + representable[:-1]) / 2  # the ties
    gen = torch.Generator().manual_seed(0)
    values = torch.cat([mids, representable, torch.rand(20000, generator=gen, dtype=torch.float64) * 896 - 448,
                        torch.randn(20000, generator=gen, dtype=torch.float64) * 2 ** -7]).float()
    got = values.to(torch.float8_e4m3fn).double()
    torch.testing.assert_close(got, naive_e4m3(values.double()), rtol=0, atol=0)


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_1x128_matches_naive(pow2, dtype):
    t = varied(6, 512, seed=1, dtype=dtype)
    q, s = fp8.quantize_1x128(t, pow2)
    assert q.shape == (6, 512) and q.dtype == torch.float8_e4m3fn and s.shape == (6, 4) and s.dtype == torch.float32
    for i in range(6):
        for j in range(4):
            q_ref, s_ref = naive_tile(t[i, 128 * j:128 * (j + 1)], pow2)
            assert s[i, j].item() == s_ref
            assert torch.equal(q[i, 128 * j:128 * (j + 1)].double(), q_ref)


def test_bf16_input_is_upcast_exactly():
    t = varied(4, 256, seed=2, dtype=torch.bfloat16)
    assert_same_quantisation(fp8.quantize_1x128(t), fp8.quantize_1x128(t.float()))


def test_scales_are_powers_of_two_rounded_up():
    t = varied(16, 1024, seed=3)
    q, s = fp8.quantize_1x128(t)
    assert torch.all((s.view(torch.int32) & 0x007FFFFF) == 0), "a pow2 scale has mantissa bits"
    amax = t.view(16, 8, 128).abs().amax(2)
    # s = amax / 448 rounded up to a power of two: amax / 448 <= s < 2 * amax / 448.
    assert torch.all(amax.double() / 448 <= s.double()) and torch.all(s.double() < 2 * amax.double() / 448)
    assert q.float().abs().max() <= 448


def test_exact_scales_without_pow2():
    t = varied(16, 1024, seed=4)
    q, s = fp8.quantize_1x128(t, pow2=False)
    amax = t.view(16, 8, 128).abs().amax(2).numpy()
    m = np.float32(448.0) / amax  # the IEEE float32 division (not 448 * (1 / amax))
    assert np.array_equal(s.numpy(), np.float32(1.0) / m)
    assert not torch.all((s.view(torch.int32) & 0x007FFFFF) == 0)
    # The tile's largest value lands on 448 (clamped if amax * m rounded past it).
    assert torch.all(q.float().view(16, 8, 128).abs().amax(2) == 448)


@pytest.mark.parametrize("pow2", [True, False])
def test_no_overflow_and_half_ulp_error(pow2):
    t = varied(8, 1024, seed=5)
    q, s = fp8.quantize_1x128(t, pow2)
    assert not q.float().isnan().any() and q.float().abs().max() <= 448
    # |q - t * m| <= half an E4M3 ulp of the scaled value (ulp 2**(floor(log2|v|) - 3), 2**-9 in subnormals).
    m = (1 / s.double()).repeat_interleave(128, 1)
    scaled = t.double() * m
    _, exponent = torch.frexp(scaled.abs())
    half_ulp = torch.ldexp(torch.ones_like(scaled), torch.clamp(exponent - 1, min=-6) - 4)
    assert torch.all((q.double() - scaled).abs() <= half_ulp)


def test_zero_tile_gets_scale_one():
    t = torch.randn(3, 384)
    t[1, 128:256] = 0
    t[2] = 0
    q, s = fp8.quantize_1x128(t)
    assert s[1, 1] == 1 and s[2].eq(1).all()
    assert torch.all(bits(q[1, 128:256]) == 0) and torch.all(bits(q[2]) == 0)
    assert s[1, 0] != 1 and s[0].ne(1).all()


@pytest.mark.parametrize("pow2", [True, False])
def test_non_finite_values_poison_only_their_tile(pow2):
    """Outside the bitwise contract (module doc): every non-finite input dequantises to NaN, and only its tile
    is affected."""
    t = torch.randn(2, 384)
    t[0, 5] = float("nan")
    t[1, 300] = float("inf")
    t[1, 10] = -float("inf")
    q, s = fp8.quantize_1x128(t, pow2)
    values = fp8.dequantize_1x128(q, s)
    assert values[0, 5].isnan() and values[1, 300].isnan() and values[1, 10].isnan()
    finite = torch.ones(2, 3, dtype=torch.bool)
    finite[0, 0] = finite[1, 0] = finite[1, 2] = False
    assert torch.isfinite(s[finite]).all() and torch.isfinite(values.view(2, 3, 128)[finite]).all()
    assert_same_quantisation((q[:1, 128:], s[:1, 1:]), fp8.quantize_1x128(t[:1, 128:], pow2))


def test_tiny_tile_stays_finite():
    """448 / amax would overflow float32 below amax = 448 / FLT_MAX: the multiplier is capped at 2^126."""
    t = torch.full((1, 128), 1e-37)
    t[0, 1] = 0
    t[0, 2] = -9.2e-41  # a bf16 subnormal
    q, s = fp8.quantize_1x128(t)
    assert s.item() == 2.0 ** -126
    assert torch.isfinite(fp8.dequantize_1x128(q, s)).all() and q.float()[0, 1] == 0


def test_tile_with_one_huge_value():
    gen = torch.Generator().manual_seed(6)
    t = torch.randn(1, 128, generator=gen) * 1e-3
    t[0, 17] = 3.0e4
    q, s = fp8.quantize_1x128(t)
    assert s.item() == 2.0 ** math.ceil(math.log2(3.0e4 / 448))  # 128: the huge value sets the scale
    assert q[0, 17].float().item() == naive_e4m3(torch.tensor(3.0e4 / 128, dtype=torch.float64)).item()
    others = torch.arange(128) != 17
    # The small values (|t| * m < 2**-10, under half of E4M3's smallest subnormal) all flush to (signed) zero,
    # within half a subnormal step (2**-10 * s) of the input.
    assert torch.all(q[0, others].float() == 0)
    assert torch.all((q.float() * s - t)[0, others].abs() <= 2 ** -10 * s)


def test_negative_values_mirror_positive():
    t = varied(4, 512, seed=7)
    q, s = fp8.quantize_1x128(t)
    qn, sn = fp8.quantize_1x128(-t)
    assert torch.equal(s, sn)
    assert torch.equal(bits(qn), bits(q) ^ 0x80)  # only the sign bit differs
    assert (q.float() < 0).any() and (q.float() > 0).any()


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_128x1_is_transposed_1x128(pow2, dtype):
    t = varied(384, 256, seed=8, dtype=dtype)
    t[128:256, 5] = 0  # a zero tile
    q_t, s = fp8.quantize_128x1(t, pow2)
    assert q_t.shape == (256, 384) and s.shape == (256, 3) and q_t.is_contiguous() and s.is_contiguous()
    assert_same_quantisation((q_t, s), fp8.quantize_1x128(t.t().contiguous(), pow2))
    assert s[5, 1] == 1
    # q_t[k, m] quantises t[m, k] with the scale of tile (m // 128, k), as the naive loop does.
    torch.testing.assert_close(fp8.dequantize_128x1(q_t, s, torch.float64), naive_128x1(t, pow2), rtol=0, atol=0)


@pytest.mark.parametrize("pow2", [True, False])
def test_quantize_128x128(pow2):
    gen = torch.Generator().manual_seed(9)
    w = (torch.randn(3, 256, 384, generator=gen) * torch.exp(torch.randn(3, 256, 384, generator=gen))
         ).to(torch.bfloat16)
    w[1, :128, 128:256] = 0
    q, s = fp8.quantize_128x128(w, pow2)
    assert q.shape == w.shape and s.shape == (3, 2, 3)
    assert s[1, 0, 1] == 1 and torch.all(bits(q[1, :128, 128:256]) == 0)
    for e in range(3):
        torch.testing.assert_close(fp8.dequantize_128x128(q[e], s[e], torch.float64), naive_128x128(w[e], pow2),
                                   rtol=0, atol=0)
    # A 2-D weight, and the leading dims are independent problems.
    assert_same_quantisation(fp8.quantize_128x128(w[2], pow2), (q[2], s[2]))


@pytest.mark.parametrize("pow2", [True, False])
def test_quantize_128x128_transpose_identity(pow2):
    """dgrad's orientation: the transposed weight's blocks are the same blocks with the same bits."""
    gen = torch.Generator().manual_seed(10)
    w = torch.randn(2, 256, 384, generator=gen) * torch.exp(torch.randn(2, 256, 384, generator=gen))
    q, s = fp8.quantize_128x128(w, pow2)
    assert_same_quantisation((q.transpose(-1, -2), s.transpose(-1, -2)),
                             fp8.quantize_128x128(w.transpose(-1, -2).contiguous(), pow2))
    # A non-contiguous (transposed view) input quantises the same as its contiguous copy.
    assert_same_quantisation(fp8.quantize_128x128(w.transpose(-1, -2), pow2),
                             fp8.quantize_128x128(w.transpose(-1, -2).contiguous(), pow2))


def test_dequantize_round_trip_and_shapes():
    t = varied(256, 384, seed=11, dtype=torch.bfloat16)
    for quant, deq in ((fp8.quantize_1x128, fp8.dequantize_1x128), (fp8.quantize_128x1, fp8.dequantize_128x1)):
        values = deq(*quant(t))
        assert values.shape == t.shape and values.dtype == torch.float32
        assert rel_err(values, t) < 0.05
        assert deq(*quant(t), dtype=torch.float64).dtype == torch.float64
    w = fp8.dequantize_128x128(*fp8.quantize_128x128(t))
    assert w.shape == t.shape and rel_err(w, t) < 0.05


def test_empty_rows():
    q, s = fp8.quantize_1x128(torch.randn(0, 256))
    assert q.shape == (0, 256) and s.shape == (0, 2)
    q_t, s = fp8.quantize_128x1(torch.randn(0, 256))
    assert q_t.shape == (256, 0) and s.shape == (256, 0)
    assert fp8.dequantize_128x1(q_t, s).shape == (0, 256)


def test_quantiser_errors():
    with pytest.raises(ValueError, match=r"t: expected the last \(contraction\) dim K to be a multiple of 128.*200"):
        fp8.quantize_1x128(torch.randn(4, 200))
    with pytest.raises(ValueError, match=r"x: .*K.*multiple of 128.*got 64"):
        fp8.quantize_1x128(torch.randn(4, 64), name="x")
    with pytest.raises(ValueError, match=r"t: expected the first \(token\) dim M to be a multiple of 128.*got 100"):
        fp8.quantize_128x1(torch.randn(100, 128))
    with pytest.raises(ValueError, match=r"w: expected dim -2 \(N\) to be a multiple of 128.*got 100"):
        fp8.quantize_128x128(torch.randn(2, 100, 128))
    with pytest.raises(ValueError, match=r"w: expected the last dim K to be a multiple of 128.*got 96"):
        fp8.quantize_128x128(torch.randn(2, 128, 96))
    with pytest.raises(ValueError, match=r"t: expected a 2-D tensor"):
        fp8.quantize_1x128(torch.randn(2, 2, 128))
    with pytest.raises(ValueError, match=r"w: expected a tensor \[..., N, K\]"):
        fp8.quantize_128x128(torch.randn(128))
    with pytest.raises(TypeError, match=r"t: expected a floating tensor"):
        fp8.quantize_1x128(torch.ones(2, 128, dtype=torch.int32))
    q, s = fp8.quantize_1x128(torch.randn(2, 256))
    with pytest.raises(ValueError, match=r"s: expected shape \(2, 2\)"):
        fp8.dequantize_1x128(q, s[:, :1])
    with pytest.raises(TypeError, match=r"q: expected dtype torch.float8_e4m3fn"):
        fp8.dequantize_1x128(q.float(), s)


def test_check_fp8_problem():
    check_fp8_problem(256, 128)
    with pytest.raises(ValueError, match=r"x: hidden size H=200 .*multiple of 128"):
        check_fp8_problem(200, 128)
    with pytest.raises(ValueError, match=r"w1: intermediate size I=96 .*multiple of 128"):
        check_fp8_problem(256, 96)


# ---------------------------------------------------------------- the quantised-weight cache


@pytest.fixture
def counted(monkeypatch):
    """Counts the cache's quantisations (it calls fp8.quantize_128x128 through the module)."""
    calls = []
    def counting(w, pow2=True, **kwargs):
        calls.append(w)
        return QUANTIZE_128X128(w, pow2, **kwargs)

    monkeypatch.setattr(fp8, "quantize_128x128", counting)
    yield calls
    calls.clear()


def weight(seed=12, shape=(2, 256, 128), dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


def test_cache_reuses_until_the_weight_changes(counted):
    w = weight()
    first = fp8.quantized_weights(w)
    assert_same_quantisation((first.q, first.s), QUANTIZE_128X128(w))
    assert fp8.quantized_weights(w) is first and fp8.quantized_weights(w) is first
    assert len(counted) == 1
    # Both orientations: views for free, the contiguous copy made once.
    assert first.q_t.data_ptr() == first.q.data_ptr() and first.q_t.shape == (2, 128, 256)
    qt, st = first.transposed_contiguous()
    assert qt.is_contiguous() and st.shape == (2, 1, 2)
    assert first.transposed_contiguous()[0] is qt
    assert torch.equal(bits(qt), bits(first.q_t))
    # pow2=False is its own entry, also cached.
    exact = fp8.quantized_weights(w, pow2=False)
    assert exact is not first and fp8.quantized_weights(w, pow2=False) is exact and len(counted) == 2
    assert fp8.quantized_weights(w) is first


def test_cache_value_is_the_quantisation():
    w = weight(seed=13)
    value = fp8.quantized_weights(w)
    assert_same_quantisation((value.q, value.s), QUANTIZE_128X128(w))
    torch.testing.assert_close(value.dequantize(torch.float64), fp8.dequantize_128x128(value.q, value.s,
                                                                                        torch.float64))


def test_cache_invalidated_by_inplace_update(counted):
    w = weight(seed=14)
    first = fp8.quantized_weights(w)
    with torch.no_grad():
        w.add_(1.0)
    second = fp8.quantized_weights(w)
    assert second is not first and len(counted) == 2
    assert_same_quantisation((second.q, second.s), QUANTIZE_128X128(w))
    assert fp8.quantized_weights(w) is second and len(counted) == 2  # reused again


def test_cache_invalidated_by_optimizer_step(counted):
    p = torch.nn.Parameter(weight(seed=15, dtype=torch.float32))
    opt = torch.optim.AdamW([p], lr=1e-2)
    values = []
    for _ in range(3):
        values.append(fp8.quantized_weights(p))
        assert fp8.quantized_weights(p) is values[-1]  # one quantisation per step
        p.grad = torch.randn_like(p)
        opt.step()
    assert len(counted) == 3 and len({id(v) for v in values}) == 3
    assert_same_quantisation((fp8.quantized_weights(p).q, fp8.quantized_weights(p).s), QUANTIZE_128X128(p))


def test_cache_invalidated_by_data_swap(counted):
    w = weight(seed=16, shape=(128, 128), dtype=torch.float32).requires_grad_()
    first = fp8.quantized_weights(w)
    version = w._version
    w.data = weight(seed=17, shape=(128, 128), dtype=torch.float32)
    assert w._version == version  # a .data swap keeps the version counter: data_ptr / storage catch it
    second = fp8.quantized_weights(w)
    assert second is not first
    assert_same_quantisation((second.q, second.s), QUANTIZE_128X128(w))
    # The hard case: new data at the cached address (as when the allocator hands the freed block of the old
    # storage to the new one), same version, same shape: only the storage's identity tells. Two tensors over
    # one numpy buffer are two storages at one address.
    buffer = np.empty((128, 128), dtype=np.float32)
    buffer[:] = weight(seed=18, shape=(128, 128), dtype=torch.float32).numpy()
    w.data = torch.from_numpy(buffer)
    third = fp8.quantized_weights(w)
    assert third is not second
    buffer[:] = weight(seed=19, shape=(128, 128), dtype=torch.float32).numpy()  # no version counter sees this
    ptr = w.data_ptr()
    w.data = torch.from_numpy(buffer)
    assert w.data_ptr() == ptr and w._version == version
    fourth = fp8.quantized_weights(w)
    assert fourth is not third and len(counted) == 4
    assert_same_quantisation((fourth.q, fourth.s), QUANTIZE_128X128(w))


def test_cache_does_not_see_writes_through_data_without_invalidate(counted):
    """Writes through ``w.data`` bypass the version counter (documented): ``invalidate`` is the remedy."""
    w = weight(seed=19)
    first = fp8.quantized_weights(w)
    w.data.mul_(2)
    assert fp8.quantized_weights(w) is first  # stale, as documented
    fp8.invalidate(w)
    second = fp8.quantized_weights(w)
    assert second is not first
    assert_same_quantisation((second.q, second.s), QUANTIZE_128X128(w))


def test_freed_weight_frees_its_entry():
    fp8.clear_cache()
    w = weight(seed=20)
    value = fp8.quantized_weights(w)
    fp8.quantized_weights(w, pow2=False)
    assert fp8.cache_size() == 1
    ref = weakref.ref(w)
    del w
    gc.collect()
    assert ref() is None, "the cache kept the weight alive"
    assert fp8.cache_size() == 0, "the freed weight's entry stayed"
    assert value.q.shape == (2, 256, 128)  # what the caller holds stays valid
    # Many short-lived weights leave nothing behind.
    for seed in range(5):
        fp8.quantized_weights(weight(seed=seed))
    gc.collect()
    assert fp8.cache_size() == 0


def test_cache_clear_and_uncacheable_tensors():
    w = weight(seed=21)
    fp8.quantized_weights(w)
    assert fp8.cache_size() >= 1
    fp8.clear_cache()
    assert fp8.cache_size() == 0
    with torch.inference_mode():
        w_inf = weight(seed=22)  # no version counter: quantised every call, never cached
        a, b = fp8.quantized_weights(w_inf), fp8.quantized_weights(w_inf)
    assert a is not b and fp8.cache_size() == 0
    assert_same_quantisation((a.q, a.s), (b.q, b.s))


# ---------------------------------------------------------------- the FP8-emulating reference

SHAPE = dict(hidden=256, inter=256, experts=4, top_k=2)


def fp8_outputs(problem, **flags) -> Outputs:
    y = moe_fp8(problem.x, problem.topk_idx, problem.topk_weights, problem.w1, problem.w2, **flags)
    grads = moe_fp8_backward(problem.dy, problem.x, problem.topk_idx, problem.topk_weights, problem.w1, problem.w2,
                             **flags)
    return Outputs(y, *grads)


@pytest.mark.parametrize("routing", ["masked", "uniform", "skewed", "one_expert"])
@pytest.mark.parametrize("pow2", [True, False])
def test_fp8_reference_within_fp8_tolerance_of_fp64(routing, pow2):
    problem = make_problem(tokens=37, **SHAPE, routing=routing, seed=23)
    out, ref = fp8_outputs(problem, pow2=pow2), reference64(problem)
    assert out.y.dtype == torch.bfloat16 and out.dx.dtype == torch.bfloat16
    assert out.dtw.dtype == out.dw1.dtype == out.dw2.dtype == torch.float32
    for name in OUTPUT_NAMES:
        got, want = getattr(out, name), getattr(ref, name)
        assert got.shape == want.shape
        err = rel_err(got, want)
        assert FP8_FLOOR < err <= FP8_TOL[name], f"{name}: relative error {err:.4f} (bound {FP8_TOL[name]})"
    skipped = problem.topk_idx < 0
    assert torch.all(out.dtw[skipped] == 0)


def test_fp8_bwd_forward_is_the_bf16_reference():
    problem = make_problem(tokens=37, **SHAPE, routing="masked", seed=24)
    args = (problem.x, problem.topk_idx, problem.topk_weights, problem.w1, problem.w2)
    y = moe_fp8(*args, fp8_forward=False)
    assert y.dtype == torch.bfloat16 and torch.equal(y, primemoe.reference.moe(*args))
    # ... while its backward is FP8 (from the bf16 forward's h), within the FP8 tolerance.
    out, ref = fp8_outputs(problem, fp8_forward=False), reference64(problem)
    full = fp8_outputs(problem)
    for name in ("dx", "dtw", "dw1", "dw2"):
        assert FP8_FLOOR < rel_err(getattr(out, name), getattr(ref, name)) <= FP8_TOL[name], name
        assert not torch.equal(getattr(out, name), getattr(full, name)), name  # h differs from the fp8 forward's


def test_fp8_backward_false_is_the_bf16_backward():
    problem = make_problem(tokens=37, **SHAPE, routing="masked", seed=25)
    args = (problem.x, problem.topk_idx, problem.topk_weights, problem.w1, problem.w2)
    got = moe_fp8_backward(problem.dy, *args, fp8_backward=False)
    want = primemoe.reference.moe_backward(problem.dy, *args)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_fp8_reference_autograd_is_its_backward():
    problem = make_problem(tokens=20, **SHAPE, routing="masked", seed=26)
    out = run_moe(moe_fp8, problem)
    direct = fp8_outputs(problem)
    assert torch.equal(out.y, direct.y)
    for name in ("dx", "dtw", "dw1", "dw2"):
        got, want = getattr(out, name), getattr(direct, name)
        assert torch.equal(got, want.to(got.dtype)), name


@pytest.mark.parametrize("routing,tokens", [("all_skipped", 5), ("uniform", 0), ("uniform", 1)])
def test_fp8_reference_degenerate(routing, tokens):
    problem = make_problem(tokens=tokens, **SHAPE, routing=routing, seed=27)
    out = fp8_outputs(problem)
    assert out.y.shape == (tokens, 256) and out.dtw.shape == (tokens, 2)
    if routing == "all_skipped":
        for name in OUTPUT_NAMES:
            assert torch.all(getattr(out, name) == 0), name
    counts = torch.bincount(problem.topk_idx[problem.topk_idx >= 0], minlength=4)
    assert torch.all(out.dw1[counts == 0] == 0) and torch.all(out.dw2[counts == 0] == 0)


def test_fp8_reference_rejects_sizes():
    problem = make_problem(tokens=4, hidden=192, inter=128, experts=2, top_k=1)
    with pytest.raises(ValueError, match="x: hidden size H=192"):
        moe_fp8(problem.x, problem.topk_idx, problem.topk_weights, problem.w1, problem.w2)
    problem = make_problem(tokens=4, hidden=128, inter=64, experts=2, top_k=1)
    with pytest.raises(ValueError, match="w1: intermediate size I=64"):
        moe_fp8_backward(problem.dy, problem.x, problem.topk_idx, problem.topk_weights, problem.w1, problem.w2)
    # fp8_bwd's forward is the bf16 one: no size constraint there.
    moe_fp8(problem.x, problem.topk_idx, problem.topk_weights, problem.w1, problem.w2, fp8_forward=False)


# ---------------------------------------------------------------- a naive loop over tokens and slots


def naive_fp8(problem, pow2=True):
    """The recipe of moe_fp8's docstring, one token and one slot at a time, on the naive quantiser above."""
    x, dy, w1, w2 = problem.x, problem.dy, problem.w1, problem.w2
    T, H = x.shape
    E, two_i, _ = w1.shape
    inter = two_i // 2
    K = problem.topk_idx.shape[1]
    xq, dyq = naive_1x128(x, pow2), naive_1x128(dy, pow2)
    w1q = [naive_128x128(w1[e], pow2) for e in range(E)]
    w2q = [naive_128x128(w2[e], pow2) for e in range(E)]
    y = torch.zeros(T, H, dtype=torch.float32)
    dx = torch.zeros(T, H, dtype=torch.float32)
    dtw = torch.zeros(T, K, dtype=torch.float32)
    rows = {e: [] for e in range(E)}  # per expert, (dy row, aw row, dh row, x row) in slot order
    for t in range(T):
        for k in range(K):
            e = int(problem.topk_idx[t, k])
            if e < 0:
                continue
            w = torch.tensor(float(problem.topk_weights[t, k]), dtype=torch.float32)
            h = (w1q[e] @ xq[t]).float().bfloat16().float()
            gate, up = h[:inter], h[inter:]
            a = (F.silu(gate) * up).bfloat16()
            o = (w2q[e] @ naive_1x128(a[None], pow2)[0]).float()
            y[t] += (o * w).bfloat16().float()
            da = (w2q[e].t() @ dyq[t]).float()
            dtw[t, k] = float((da.double() * a.double()).sum())
            sig = torch.sigmoid(gate)
            dw = da * w
            dh = torch.cat([dw * up * sig * (1 + gate * (1 - sig)), dw * gate * sig]).bfloat16()
            aw = (w * a.float()).bfloat16()
            dx[t] += (w1q[e].t() @ naive_1x128(dh[None], pow2)[0]).float().bfloat16().float()
            rows[e].append((dy[t], aw, dh, x[t]))
    dw1 = torch.zeros(w1.shape, dtype=torch.float32)
    dw2 = torch.zeros(w2.shape, dtype=torch.float32)
    for e, expert_rows in rows.items():
        if not expert_rows:
            continue
        pad = -len(expert_rows) % 128
        dy_e, aw_e, dh_e, x_e = (naive_128x1(F.pad(torch.stack(c).float(), (0, 0, 0, pad)), pow2)
                                 for c in zip(*expert_rows))
        acc1 = torch.zeros(w1.shape[1:], dtype=torch.float64)
        acc2 = torch.zeros(w2.shape[1:], dtype=torch.float64)
        for r in range(dy_e.shape[0]):
            acc2 += torch.outer(dy_e[r], aw_e[r])
            acc1 += torch.outer(dh_e[r], x_e[r])
        dw1[e], dw2[e] = acc1.float(), acc2.float()
    return Outputs(y.bfloat16(), dx.bfloat16(), dtw, dw1, dw2)


@pytest.mark.parametrize("pow2", [True, False])
def test_fp8_reference_matches_naive_loop(pow2):
    # Masked routing over 3 experts, remapped so that expert 0 gets 4 of every 5 routed slots (more than 128
    # rows: its wgrad tiles span 2 x 128 rows, the last one padded), expert 1 the rest and expert 2 none.
    problem = make_problem(tokens=120, hidden=128, inter=128, experts=3, top_k=2, routing="masked", seed=28)
    routed = problem.topk_idx >= 0
    every_fifth = (torch.arange(problem.topk_idx.numel()) % 5 == 0).view(problem.topk_idx.shape)
    problem.topk_idx[routed] = torch.where(every_fifth, 1, 0)[routed]
    assert int((problem.topk_idx == 0).sum()) > 128 and int((problem.topk_idx == 1).sum()) > 0
    got, want = fp8_outputs(problem, pow2=pow2), naive_fp8(problem, pow2)
    for name in OUTPUT_NAMES:
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype and g.shape == w.shape, name
        # The same roundings; only the float64 summation order differs, which could flip a float32 (then bf16)
        # rounding once in a long while (bitwise equal on this problem today).
        assert rel_err(g, w) <= 1e-6, f"{name}: {rel_err(g, w):.3e}"
        assert (g == w).float().mean() >= 0.999, f"{name}: {(g != w).sum()} of {g.numel()} values differ"

