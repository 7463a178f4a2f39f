"""The FP8 quantisation ops' fake kernels and CPU kernels (torch.ops.primemoe.quantize_fp8_*).

The CPU kernels are the reference quantisers of :mod:`primemoe.fp8`, which the CUDA kernels
(csrc/kernels/quantize.cu) equal bitwise. Each first runs, through ``_check_args``, the C++ argument check the
CUDA impl runs (csrc/binding/quant_ops.cpp), so both devices reject the same arguments with the same message.
"""

from __future__ import annotations

import torch

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


# ---------------------------------------------------------------- fake kernels


@torch.library.register_fake("primemoe::quantize_fp8_1x128")
def _quantize_1x128_fake(x, pow2=True):
    M, K = x.shape
    return x.new_empty(M, K, dtype=fp8.FP8_DTYPE), x.new_empty(M, K // fp8.BLOCK, dtype=torch.float32)


@torch.library.register_fake("primemoe::quantize_fp8_128x1")
def _quantize_128x1_fake(x, pow2=True):
    M, K = x.shape
    return x.new_empty(K, M, dtype=fp8.FP8_DTYPE), x.new_empty(K, M // fp8.BLOCK, dtype=torch.float32)


@torch.library.register_fake("primemoe::quantize_fp8_128x128")
def _quantize_128x128_fake(w, pow2=True):
    *lead, N, K = w.shape
    return (w.new_empty(w.shape, dtype=fp8.FP8_DTYPE),
            w.new_empty(*lead, N // fp8.BLOCK, K // fp8.BLOCK, dtype=torch.float32))


# ---------------------------------------------------------------- CPU kernels


@torch.library.impl("primemoe::quantize_fp8_1x128", "cpu")
def _quantize_1x128_cpu(x, pow2=True):
    _check("quantize_fp8_1x128", [x], [pow2])
    q, s = fp8.quantize_1x128(x, pow2, name="x")
    return _dense(q), _dense(s)


@torch.library.impl("primemoe::quantize_fp8_128x1", "cpu")
def _quantize_128x1_cpu(x, pow2=True):
    _check("quantize_fp8_128x1", [x], [pow2])
    q_t, s = fp8.quantize_128x1(x, pow2, name="x")
    return _dense(q_t), _dense(s)


@torch.library.impl("primemoe::quantize_fp8_128x128", "cpu")
def _quantize_128x128_cpu(w, pow2=True):
    _check("quantize_fp8_128x128", [w], [pow2])
    q, s = fp8.quantize_128x128(w, pow2, name="w")
    return _dense(q), _dense(s)
