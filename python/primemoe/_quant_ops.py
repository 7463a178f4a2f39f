"""The FP8 quantisation ops' fake kernels and CPU kernels (torch.ops.primemoe.quantize_fp8_*, fp8_swiglu_quant,
fp8_swiglu_backward).

The CPU kernels are the reference quantisers of :mod:`primemoe.fp8`, which the CUDA kernels
(csrc/kernels/quantize.cu) equal bitwise, and the FP8 SwiGLU epilogues (reference.moe_fp8, steps 3-4 and 9-11),
the spec of csrc/kernels/fp8_rows.cu. Each first runs, through ``_check_args``, the C++ argument check the
CUDA impl runs (csrc/binding/quant_ops.cpp), so both devices reject the same arguments with the same message.

Options: ``scale_mn_major`` returns the scale transposed (``[K/128, M]`` for 1x128, ``[M/128, K]`` for 128x1,
contiguous); ``expert_offsets``: the rows at or past ``expert_offsets[-1]`` (128x1: the 128-row tiles starting
there) are left unwritten by the CUDA impls, and are zeros here (q and scale alike).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _C  # noqa: F401  (loads the library that defines the schemas)
from . import fp8

lib = torch.ops.primemoe


def _check(op, tensors, ints=()):
    lib._check_args(op, list(tensors), [int(v) for v in ints])


def _dense_strides(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _dense(t):
    """``t`` with the strides of a fresh allocation, as the CUDA impls' outputs (``contiguous()`` keeps a
    transposed empty tensor's strides)."""
    return t if t.stride() == _dense_strides(t.shape) else t.clone(memory_format=torch.contiguous_format)


def _rows_end(expert_offsets, rows):
    """The routed row count ``expert_offsets[-1]`` clamped to ``[0, rows]`` (all rows without offsets)."""
    if expert_offsets is None:
        return rows
    return min(max(int(expert_offsets[-1]), 0), rows)


def _zero_fp8(q):
    q.view(torch.uint8).zero_()


# ---------------------------------------------------------------- fake kernels


@torch.library.register_fake("primemoe::quantize_fp8_1x128")
def _quantize_1x128_fake(x, pow2=True, scale_mn_major=False, expert_offsets=None):
    M, K = x.shape
    s_shape = (K // fp8.BLOCK, M) if scale_mn_major else (M, K // fp8.BLOCK)
    return x.new_empty(M, K, dtype=fp8.FP8_DTYPE), x.new_empty(s_shape, dtype=torch.float32)


@torch.library.register_fake("primemoe::quantize_fp8_128x1")
def _quantize_128x1_fake(x, pow2=True, scale_mn_major=False, expert_offsets=None):
    M, K = x.shape
    s_shape = (M // fp8.BLOCK, K) if scale_mn_major else (K, M // fp8.BLOCK)
    return x.new_empty(K, M, dtype=fp8.FP8_DTYPE), x.new_empty(s_shape, dtype=torch.float32)


@torch.library.register_fake("primemoe::quantize_fp8_128x128")
def _quantize_128x128_fake(w, pow2=True):
    *lead, N, K = w.shape
    return (w.new_empty(w.shape, dtype=fp8.FP8_DTYPE),
            w.new_empty(*lead, N // fp8.BLOCK, K // fp8.BLOCK, dtype=torch.float32))


@torch.library.register_fake("primemoe::fp8_swiglu_quant")
def _fp8_swiglu_quant_fake(h, expert_offsets, pow2=True):
    R, I = h.shape[0], h.shape[1] // 2
    return h.new_empty(R, I, dtype=fp8.FP8_DTYPE), h.new_empty(I // fp8.BLOCK, R, dtype=torch.float32)


@torch.library.register_fake("primemoe::fp8_swiglu_backward")
def _fp8_swiglu_backward_fake(da, h, row_weight, expert_offsets, pow2=True):
    R, I2 = h.shape
    return (h.new_empty(R, I2, dtype=torch.bfloat16), h.new_empty(R, I2, dtype=fp8.FP8_DTYPE),
            h.new_empty(I2 // fp8.BLOCK, R, dtype=torch.float32), h.new_empty(R, I2 // 2, dtype=torch.bfloat16),
            h.new_empty(R, dtype=torch.float32))


# ---------------------------------------------------------------- CPU kernels


@torch.library.impl("primemoe::quantize_fp8_1x128", "cpu")
def _quantize_1x128_cpu(x, pow2=True, scale_mn_major=False, expert_offsets=None):
    _check("quantize_fp8_1x128", [x, expert_offsets], [pow2, scale_mn_major])
    q, s = fp8.quantize_1x128(x, pow2, name="x")
    n = _rows_end(expert_offsets, x.shape[0])
    _zero_fp8(q[n:])
    s[n:] = 0
    return _dense(q), _dense(s.t() if scale_mn_major else s)


@torch.library.impl("primemoe::quantize_fp8_128x1", "cpu")
def _quantize_128x1_cpu(x, pow2=True, scale_mn_major=False, expert_offsets=None):
    _check("quantize_fp8_128x1", [x, expert_offsets], [pow2, scale_mn_major])
    q_t, s = fp8.quantize_128x1(x, pow2, name="x")  # q_t [K, M], s [K, M/128]
    tiles = -(-_rows_end(expert_offsets, x.shape[0]) // fp8.BLOCK)  # the row tiles starting before the bound
    _zero_fp8(q_t[:, tiles * fp8.BLOCK:])
    s[:, tiles:] = 0
    return _dense(q_t), _dense(s.t() if scale_mn_major else s)


@torch.library.impl("primemoe::quantize_fp8_128x128", "cpu")
def _quantize_128x128_cpu(w, pow2=True):
    _check("quantize_fp8_128x128", [w], [pow2])
    q, s = fp8.quantize_128x128(w, pow2, name="w")
    return _dense(q), _dense(s)


def _swiglu_terms(h):
    """``(g, u, a)`` of ``h [n, 2I]`` bf16: the float32 halves and ``a = bf16(silu(g) * u)`` (torch's F.silu)."""
    gate, up = h.float().chunk(2, dim=-1)
    return gate, up, (F.silu(gate) * up).to(torch.bfloat16)


@torch.library.impl("primemoe::fp8_swiglu_quant", "cpu")
def _fp8_swiglu_quant_cpu(h, expert_offsets, pow2=True):
    """``a = bf16(silu(g) * u)`` of ``h [R, 2I]``, quantised 1x128 along I: ``(a_q [R, I] e4m3, a_scale [I/128, R])``
    (MN-major); rows at or past ``expert_offsets[-1]`` zeros."""
    _check("fp8_swiglu_quant", [h, expert_offsets], [pow2])
    R, I = h.shape[0], h.shape[1] // 2
    n = _rows_end(expert_offsets, R)
    a_q = torch.zeros(R, I, dtype=fp8.FP8_DTYPE)
    a_scale = torch.zeros(I // fp8.BLOCK, R, dtype=torch.float32)
    _, _, a = _swiglu_terms(h[:n])
    q, s = fp8.quantize_1x128(a, pow2, name="a")
    a_q[:n] = q
    a_scale[:, :n] = s.t()
    return a_q, a_scale


@torch.library.impl("primemoe::fp8_swiglu_backward", "cpu")
def _fp8_swiglu_backward_cpu(da, h, row_weight, expert_offsets, pow2=True):
    """The SwiGLU backward of FC2 dgrad's FP8 epilogue, per row with ``w = row_weight[r]``, ``sig = sigmoid(g)``,
    ``dw = da * w`` (float32, operations in the order written):
    ``dh = bf16([((dw * u) * sig) * (1 + g * (1 - sig)) | (dw * g) * sig])`` ``[R, 2I]``, its 1x128 quantisation
    ``(dh_q, dh_scale [2I/128, R])`` (MN-major), ``aw = bf16(w * a)`` ``[R, I]`` and
    ``dot = fp32(sum_i float64(da[i]) * float64(a[i]))`` ``[R]``; rows at or past ``expert_offsets[-1]`` zeros."""
    _check("fp8_swiglu_backward", [da, h, row_weight, expert_offsets], [pow2])
    R, I2 = h.shape
    n = _rows_end(expert_offsets, R)
    dh = torch.zeros(R, I2, dtype=torch.bfloat16)
    dh_q = torch.zeros(R, I2, dtype=fp8.FP8_DTYPE)
    dh_scale = torch.zeros(I2 // fp8.BLOCK, R, dtype=torch.float32)
    aw = torch.zeros(R, I2 // 2, dtype=torch.bfloat16)
    dot = torch.zeros(R, dtype=torch.float32)
    gate, up, a = _swiglu_terms(h[:n])
    d, w = da[:n], row_weight[:n].unsqueeze(1)
    sig = torch.sigmoid(gate)
    dw = d * w
    dh[:n] = torch.cat([dw * up * sig * (1 + gate * (1 - sig)), dw * gate * sig], dim=1).to(torch.bfloat16)
    q, s = fp8.quantize_1x128(dh[:n], pow2, name="dh")
    dh_q[:n] = q
    dh_scale[:, :n] = s.t()
    aw[:n] = (w * a.float()).to(torch.bfloat16)
    dot[:n] = (d.double() * a.double()).sum(1).float()
    return dh, dh_q, dh_scale, aw, dot
