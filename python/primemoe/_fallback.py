"""The expert GEMMs on ``torch._grouped_mm``, where the engine does not run a problem (not an sm_90 GPU,
sizes that are not multiples of its tiles, the CPU): the same three steps as the engine's ops, over the
same expert-major rows (``offsets``: int32 [E + 1], expert ``e``'s rows are ``[offsets[e], offsets[e+1])``).

A grouped GEMM reads only the rows inside its groups and leaves the output rows past ``offsets[-1]``
unwritten (undefined), as the engine's ops do with ``zero_unrouted=False``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _C  # noqa: F401  (loads the library that defines slot_dot)

__all__ = ["swiglu", "swiglu_backward", "grouped_wgrad", "fc1", "fc2", "expert_backward"]


def swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_backward(h: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """d/dh of silu(gate) * up, written straight into the two halves of dh (bf16,
    the same kernels autograd would run)."""
    gate, up = h.chunk(2, dim=-1)
    dh = torch.empty_like(h)
    d_gate, d_up = dh.chunk(2, dim=-1)
    torch.mul(da, F.silu(gate), out=d_up)
    d_gate.copy_(torch.ops.aten.silu_backward(da * up, gate))
    return dh


def grouped_wgrad(lhs_rows: torch.Tensor, rhs_rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """[E, m, n]: per expert, the sum over its rows of lhs_row^T rhs_row. A grouped GEMM over an
    empty row range need not write its output block, so experts without rows are zeroed."""
    dw = torch._grouped_mm(lhs_rows.t(), rhs_rows, offs=ends)
    empty = torch.diff(ends, prepend=ends.new_zeros(1)) == 0
    return dw.masked_fill_(empty.view(-1, 1, 1), 0)


def fc1(xs, w1, offsets, keep_fc1):
    """FC1 + SwiGLU per expert: ``(a, h or an empty [0, 2I])`` (the engine's ``fc1_swiglu``)."""
    h = torch._grouped_mm(xs, w1.transpose(1, 2), offs=offsets[1:])
    return swiglu(h), (h if keep_fc1 else h.new_empty(0, h.shape[1]))


def fc2(a, w2, offsets, row_weight):
    """``row_weight * FC2(a)`` per expert (the engine's ``expert_gemm`` with a row weight)."""
    o = torch._grouped_mm(a, w2.transpose(1, 2), offs=offsets[1:])
    return (o.float() * row_weight.unsqueeze(1)).to(o.dtype)


def expert_backward(xs, h, dy_rows, row_weight, w1, w2, offsets):
    """``(dxs, dw1, dw2, dtw_rows)`` as ``layer.expert_backward`` defines them; ``h`` None: recomputed."""
    ends = offsets[1:]
    if h is None:
        h = torch._grouped_mm(xs, w1.transpose(1, 2), offs=ends)
    a = swiglu(h)
    weight = row_weight.unsqueeze(1)
    da_unweighted = torch._grouped_mm(dy_rows, w2, offs=ends)
    dh = swiglu_backward(h, (da_unweighted * weight).to(h.dtype))
    dw2 = grouped_wgrad(dy_rows, (a.float() * weight).to(a.dtype), ends)
    dxs = torch._grouped_mm(dh, w1, offs=ends)
    dw1 = grouped_wgrad(dh, xs, ends)
    every_row = torch.arange(h.shape[0], dtype=torch.int32, device=h.device).unsqueeze(1)
    return dxs, dw1, dw2, torch.ops.primemoe.slot_dot(da_unweighted, a, every_row).view(-1)
