"""The FP8 expert GEMMs' fake kernels and CPU kernels (torch.ops.primemoe.fp8_expert_gemm / fp8_expert_wgrad).

The CPU kernels are the specification of the CUDA kernels in the rounding terms of ``reference._FP8_SPEC``: every
operand dequantised to float64 (exact: e4m3 values times power-of-two or float32 scales), each expert's product in
float64, rounded once to float32 (``reference._gemm``: the CUDA kernels' fp32 accumulator differs from it only in
its summation order and the per-128-K promotion of the scales), then the optional row weight multiplies the float32
result, then the output dtype. Rows of ``fp8_expert_gemm``'s output at or past ``expert_offsets[-1]`` are zeros
here (the CUDA kernels leave them unwritten), and their row weights are not read.

Each CPU kernel first runs, through ``_check_args``, the C++ argument check of its CUDA impl, so both devices
reject the same arguments with the same message.
"""

from __future__ import annotations

import torch

from . import _C  # noqa: F401  (loads the library that defines the schemas)
from .fp8 import BLOCK

lib = torch.ops.primemoe

__all__ = ["fp8_expert_gemm", "fp8_expert_wgrad", "fp8_expert_wgrad_accumulate"]


def _check(op, tensors, ints=()):
    lib._check_args(op, list(tensors), [int(v) for v in ints])


# ---------------------------------------------------------------- fake kernels


@torch.library.register_fake("primemoe::fp8_expert_gemm")
def _fp8_expert_gemm_fake(a, a_scale, b, b_scale, expert_offsets, row_weight=None, out_fp32=False):
    return a.new_empty(a.shape[0], b.shape[1], dtype=torch.float32 if out_fp32 else torch.bfloat16)


@torch.library.register_fake("primemoe::fp8_expert_wgrad")
def _fp8_expert_wgrad_fake(a_t, a_scale, b_t, b_scale, expert_offsets, expert_rows=None, out_fp32=True):
    return a_t.new_empty(expert_offsets.shape[0] - 1, a_t.shape[0], b_t.shape[0],
                         dtype=torch.float32 if out_fp32 else torch.bfloat16)


# ---------------------------------------------------------------- CPU kernels


def _row_range(lo: int, hi: int, rows: int):
    """An expert's row range clamped to the rows that exist (the checks reject offsets past them anyway)."""
    return max(0, min(lo, rows)), max(0, min(hi, rows))


def _deq_mn_major(q: torch.Tensor, scale: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows ``[lo, hi)`` of ``q [R, K]`` dequantised in float64 with the 1x128 tiles' MN-major scales
    ``scale [K/128, R]``: ``q[r, k] * scale[k // 128, r]``."""
    s = scale[:, lo:hi].t().to(torch.float64).repeat_interleave(BLOCK, dim=1)  # [n, K]
    return q[lo:hi].to(torch.float64) * s


def _deq_rows_t(q_t: torch.Tensor, scale: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows ``[lo, hi)`` of a 128x1-quantised operand, transposed: ``q_t [C, R]`` with ``scale [R/128, C]`` ->
    float64 ``[C, hi - lo]``, ``q_t[c, r] * scale[r // 128, c]``."""
    tile = torch.arange(lo, hi) // BLOCK
    return q_t[:, lo:hi].to(torch.float64) * scale.index_select(0, tile).t().to(torch.float64)


def _deq_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One expert's 128x128-quantised ``q [N, K]`` with ``scale [N/128, K/128]`` in float64."""
    s = scale.to(torch.float64).repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)
    return q.to(torch.float64) * s


@torch.library.impl("primemoe::fp8_expert_gemm", "cpu")
def fp8_expert_gemm(a, a_scale, b, b_scale, expert_offsets, row_weight=None, out_fp32=False):
    """``out[r] = round_out(fp32(deq(a)[r] @ deq(b[e(r)])^T) * row_weight[r])`` per expert's rows; zeros past
    ``expert_offsets[-1]``."""
    _check("fp8_expert_gemm", [a, a_scale, b, b_scale, expert_offsets, row_weight], [out_fp32])
    rows, n = a.shape[0], b.shape[1]
    out = torch.zeros(rows, n, dtype=torch.float32)
    offsets = expert_offsets.tolist()
    for e, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
        lo, hi = _row_range(lo, hi, rows)
        if hi > lo:
            out[lo:hi] = (_deq_mn_major(a, a_scale, lo, hi) @ _deq_blocks(b[e], b_scale[e]).t()).to(torch.float32)
    if row_weight is not None:
        _, end = _row_range(0, offsets[-1], rows)
        out[:end] *= row_weight[:end].to(torch.float32).unsqueeze(1)
    return out if out_fp32 else out.to(torch.bfloat16)


@torch.library.register_fake("primemoe::fp8_expert_wgrad_accumulate")
def _fp8_expert_wgrad_accumulate_fake(a_t, a_scale, b_t, b_scale, expert_offsets, expert_rows, main_grad):
    return None


@torch.library.impl("primemoe::fp8_expert_wgrad_accumulate", "cpu")
def fp8_expert_wgrad_accumulate(a_t, a_scale, b_t, b_scale, expert_offsets, expert_rows, main_grad):
    """``main_grad += fp8_expert_wgrad(..., out_fp32=True)``."""
    _check("fp8_expert_wgrad_accumulate", [a_t, a_scale, b_t, b_scale, expert_offsets, expert_rows, main_grad])
    main_grad += torch.ops.primemoe.fp8_expert_wgrad(a_t, a_scale, b_t, b_scale, expert_offsets, expert_rows, True)


@torch.library.impl("primemoe::fp8_expert_wgrad", "cpu")
def fp8_expert_wgrad(a_t, a_scale, b_t, b_scale, expert_offsets, expert_rows=None, out_fp32=True):
    """``out[e] = fp32(sum over expert e's rows r of deq(a)[r]^T deq(b)[r])`` ``[E, M, N]``; with ``expert_rows``
    only the 128-row tiles that hold a routed row (the rest are skipped, as on the GPU). Experts without rows:
    zeros."""
    _check("fp8_expert_wgrad", [a_t, a_scale, b_t, b_scale, expert_offsets, expert_rows], [out_fp32])
    rows = a_t.shape[1]
    offsets = expert_offsets.tolist()
    routed = None if expert_rows is None else expert_rows.tolist()
    out = torch.zeros(len(offsets) - 1, a_t.shape[0], b_t.shape[0], dtype=torch.float32)
    for e, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
        if routed is not None:
            hi = min(hi, lo + -(-max(routed[e], 0) // BLOCK) * BLOCK)
        lo, hi = _row_range(lo, hi, rows)
        if hi > lo:
            out[e] = (_deq_rows_t(a_t, a_scale, lo, hi) @ _deq_rows_t(b_t, b_scale, lo, hi).t()).to(torch.float32)
    return out if out_fp32 else out.to(torch.bfloat16)
