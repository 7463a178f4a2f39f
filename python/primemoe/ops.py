"""Python side of the torch.ops.primemoe library.

The schemas live in C++ (csrc/binding.cpp). Here: fake (meta) kernels so
torch.compile traces every op, the CPU and CUDA implementations of
``moe_forward`` / ``moe_backward``, and their autograd formula.

CUDA path: the ``dispatch_layout`` kernel (device-side counts and row maps, no host
sync), ``gather_rows`` into expert-major order, the expert GEMM engine (persistent warp-specialised sm_90a kernels,
csrc/gemm/) and the deterministic ``combine_reduce`` kernel, which sums each token's already
weighted rows. The engine's ops:

- ``fc1_swiglu``: FC1 with SwiGLU in the epilogue over rows in expert-major order
  (pre-activations kept on request), with the producer's wait on arrival counters for
  expert parallelism;
- ``fc1_swiglu_gather``: the same with its A rows gathered from the tokens by one
  producer warp's cp.async copies; not used by the layer, because on the H200 the
  separate ``gather_rows`` + TMA loads measured faster (1.4-1.6x, benchmarks/RESULTS.md);
- ``expert_gemm``: FC2 forward (routing weight applied in the epilogue) and FC1 dgrad;
- ``fc2_dgrad_swiglu``: FC2 dgrad with the SwiGLU backward, the routing weight and the
  ``<da, a>`` routing-weight gradient partials in the epilogue;
- ``expert_wgrad``: both weight gradients, each expert's rows reduced inside one tile (given
  the layout's counts, only up to the last 64-row k-slice holding a routed row).

Where the engine does not cover a problem (not an sm_90 GPU, sizes not multiples of
the tiles, ``PRIMEMOE_GEMM=torch``) the same composition runs on ``torch._grouped_mm``.

Kept or recomputed FC1 pre-activations: kept by default (``keep_fc1=True``): the
backward then skips a third of the forward's FLOPs for 2·I·2 bytes per routed row;
``keep_fc1=False`` recomputes them in the backward (FC1 + SwiGLU again) to save that
memory.

``fc1_out`` is ``[rows, 2I]`` in the expert-major row order of
``dispatch_layout(topk_idx, E, 0, E, ROW_ALIGN)``: experts in order, each expert's
slots in slot order, each expert's range padded with zero rows to a multiple of
``ROW_ALIGN`` (the GEMM tile height), rows past the padded total unused (zeros).
"""

from __future__ import annotations

import functools
import os

import torch

from . import _C  # noqa: F401  (loads the library that defines the schemas)
from . import reference
from .baseline import grouped_wgrad, swiglu, swiglu_backward
from ._validate import check_precision

lib = torch.ops.primemoe

ROW_ALIGN = 64  # kGemmRowAlign of csrc/gemm/grouped_gemm.cuh


def _layout_rows(num_slots: int, num_local: int, row_align: int) -> int:
    return num_slots + num_local * (row_align - 1)


# ---------------------------------------------------------------- fake kernels


@torch.library.register_fake("primemoe::moe_forward")
def _moe_forward_fake(x, topk_idx, topk_weights, w1, w2, precision="bf16", keep_fc1=True):
    T, K = topk_idx.shape
    rows = _layout_rows(T * K, w1.shape[0], ROW_ALIGN) if keep_fc1 else 0
    return x.new_empty(x.shape), x.new_empty(rows, w1.shape[1])


@torch.library.register_fake("primemoe::moe_backward")
def _moe_backward_fake(dy, x, topk_idx, topk_weights, w1, w2, fc1_out, precision="bf16"):
    return (x.new_empty(x.shape), topk_weights.new_empty(topk_weights.shape, dtype=torch.float32),
            w1.new_empty(w1.shape), w2.new_empty(w2.shape))


@torch.library.register_fake("primemoe::dispatch_layout")
def _dispatch_layout_fake(topk_idx, num_experts, expert_begin, num_local_experts, row_align):
    rows = _layout_rows(topk_idx.numel(), num_local_experts, row_align)
    new = lambda *shape: topk_idx.new_empty(shape, dtype=torch.int32)  # noqa: E731
    return new(num_local_experts), new(num_local_experts + 1), new(*topk_idx.shape), new(rows)


@torch.library.register_fake("primemoe::gather_rows")
def _gather_rows_fake(src, row_to_slot, top_k, scale, slot_to_row=None, expert_offsets=None):
    return src.new_empty(row_to_slot.shape[0], src.shape[1])


@torch.library.register_fake("primemoe::combine_reduce")
def _combine_reduce_fake(rows, slot_to_row, weights):
    return rows.new_empty(slot_to_row.shape[0], rows.shape[1])


@torch.library.register_fake("primemoe::slot_dot")
def _slot_dot_fake(a, b, slot_to_row):
    return a.new_empty(slot_to_row.shape, dtype=torch.float32)


@torch.library.register_fake("primemoe::gather_scalars")
def _gather_scalars_fake(values, index):
    return values.new_empty(index.shape, dtype=torch.float32)


@torch.library.register_fake("primemoe::copy_routed_rows")
def _copy_routed_rows_fake(rows, expert_offsets):
    return rows.new_empty(rows.shape)


@torch.library.register_fake("primemoe::zero_unrouted_rows")
def _zero_unrouted_rows_fake(rows, expert_offsets):
    return None


@torch.library.register_fake("primemoe::expert_gemm")
def _expert_gemm_fake(rows, w, expert_offsets, w_kn, row_weight=None, zero_unrouted=True):
    return rows.new_empty(rows.shape[0], w.shape[2] if w_kn else w.shape[1])


@torch.library.register_fake("primemoe::fc1_swiglu")
def _fc1_swiglu_fake(rows, w1, expert_offsets, keep_fc1, rows_ready=None, epoch=None, per_epoch=1, rank=0,
                     zero_unrouted=True):
    inter = w1.shape[1] // 2
    return rows.new_empty(rows.shape[0], inter), rows.new_empty(rows.shape[0] if keep_fc1 else 0, 2 * inter)


@torch.library.register_fake("primemoe::fc1_swiglu_gather")
def _fc1_swiglu_gather_fake(x, row_to_slot, top_k, w1, expert_offsets, keep_fc1):
    rows, inter = row_to_slot.shape[0], w1.shape[1] // 2
    return x.new_empty(rows, inter), x.new_empty(rows if keep_fc1 else 0, 2 * inter)


@torch.library.register_fake("primemoe::fc2_dgrad_swiglu")
def _fc2_dgrad_swiglu_fake(dy_rows, w2, h, row_weight, expert_offsets, zero_unrouted=True):
    R, inter = dy_rows.shape[0], w2.shape[2]
    return (dy_rows.new_empty(R, 2 * inter), dy_rows.new_empty(R, inter),
            dy_rows.new_empty(R, inter // 256, dtype=torch.float32))


@torch.library.register_fake("primemoe::expert_wgrad")
def _expert_wgrad_fake(a_rows, b_rows, expert_offsets, expert_rows=None):
    return a_rows.new_empty(expert_offsets.shape[0] - 1, a_rows.shape[1], b_rows.shape[1])


@torch.library.register_fake("primemoe::ep_dispatch")
def _ep_dispatch_fake(workspace, epoch, x, topk_idx, topk_weights, rank, world, max_tokens, local_experts,
                      row_align, num_sms, wait_arrivals=True, put_peers=False, force_put=False):
    new = lambda *shape: x.new_empty(shape, dtype=torch.int32)  # noqa: E731
    return new(local_experts), new(local_experts + 1), topk_idx.new_empty(topk_idx.shape, dtype=torch.bool)


@torch.library.register_fake("primemoe::ep_combine")
def _ep_combine_fake(workspace, epoch, rows, row_scalars, expert_offsets, rank, world, max_tokens, hidden, top_k,
                     local_experts, row_align, num_sms, put_peers=False, force_put=False):
    return None


# ---------------------------------------------------------------- CPU: the reference


def _fc1_rows_cpu(x, topk_idx, w1):
    E = w1.shape[0]
    K = topk_idx.shape[1]
    counts, offsets, _, row_to_slot = lib.dispatch_layout(topk_idx, E, 0, E, ROW_ALIGN)
    acc = reference.compute_dtype(x.dtype)
    out = x.new_zeros(row_to_slot.numel(), w1.shape[1])
    for e in range(E):
        lo, n = int(offsets[e]), int(counts[e])
        if n:
            tokens = row_to_slot[lo:lo + n].long() // K
            out[lo:lo + n] = (x[tokens].to(acc) @ w1[e].to(acc).t()).to(x.dtype)
    return out


def _moe_forward_cpu(x, topk_idx, topk_weights, w1, w2, precision="bf16", keep_fc1=True):
    check_precision(precision)
    y = reference.moe(x, topk_idx, topk_weights, w1, w2)
    fc1 = _fc1_rows_cpu(x, topk_idx, w1) if keep_fc1 else x.new_empty(0, w1.shape[1])
    return y, fc1


def _moe_backward_cpu(dy, x, topk_idx, topk_weights, w1, w2, fc1_out, precision="bf16"):
    check_precision(precision)
    return reference.moe_backward(dy, x, topk_idx, topk_weights, w1, w2)


# ---------------------------------------------------------------- CUDA


@functools.lru_cache(maxsize=None)
def _engine_unsupported(device_index: int, hidden: int, intermediate: int) -> str:
    return lib.expert_gemm_unsupported(device_index, hidden, intermediate)


def use_engine(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """Whether the expert GEMM engine runs this problem (else ``torch._grouped_mm``)."""
    if not x.is_cuda or os.environ.get("PRIMEMOE_GEMM", "engine") == "torch":
        return False
    return _engine_unsupported(x.device.index, x.shape[1], w1.shape[1] // 2) == ""


def row_weights(topk_weights, row_to_slot):
    """fp32 routing weight of each expert-major row, 0 on padding rows."""
    return lib.gather_scalars(topk_weights.reshape(-1), row_to_slot)


def expert_fc1(xs, w1, offsets, keep_fc1, engine, rows_ready=None, zero_unrouted=True):
    """FC1 + SwiGLU per expert over the expert-major rows: ``(a, h or an empty [0, 2I])``.
    ``rows_ready`` (engine only): ``(counters, epoch, per_epoch, rank)``: FC1's producer waits for
    ``counters[e] >= epoch * per_epoch`` before it loads expert ``e``'s rows.
    ``zero_unrouted=False`` (here and below): rows past ``offsets[-1]`` of the outputs are left
    undefined instead of zeroed, for callers that read only the routed rows."""
    if engine:
        return lib.fc1_swiglu(xs, w1, offsets, keep_fc1, *(rows_ready or ()), zero_unrouted=zero_unrouted)
    h = torch._grouped_mm(xs, w1.transpose(1, 2), offs=offsets[1:])
    return swiglu(h), (h if keep_fc1 else h.new_empty(0, h.shape[1]))


def expert_fc2(a, w2, offsets, row_weight, engine, zero_unrouted=True):
    """``row_weight * FC2(a)`` per expert: the routing weight is applied here (in the engine's
    epilogue), so the combine only sums a token's rows."""
    if engine:
        return lib.expert_gemm(a, w2, offsets, False, row_weight, zero_unrouted=zero_unrouted)
    o = torch._grouped_mm(a, w2.transpose(1, 2), offs=offsets[1:])
    return (o.float() * row_weight.unsqueeze(1)).to(o.dtype)


def expert_backward(xs, h, dy_rows, row_weight, w1, w2, offsets, counts, engine, zero_unrouted=True):
    """Backward of ``row_weight * FC2(swiglu(FC1(xs)))`` in the expert-major row space, given the
    *unweighted* ``dy_rows`` and the kept pre-activations ``h`` (None: recomputed); ``counts``: the
    layout's routed rows per expert (the engine's weight gradients skip the padding with them). Returns
    ``(dxs, dw1, dw2, dtw_rows)``; ``dtw_rows[r] = <dy_r, FC2 output_r>`` = ``<da_r, a_r>``
    (unweighted), the routing-weight gradient of the row, so FC2's output need not be kept.
    Reads no row of ``xs`` past ``offsets[-1]`` (ep.py saves only those): the engine skips tiles past
    the routed rows, ``torch._grouped_mm`` reads only the rows inside its groups."""
    if engine:
        if h is None:  # the pre-activations only: FC1 without its SwiGLU epilogue
            h = lib.expert_gemm(xs, w1, offsets, False, zero_unrouted=zero_unrouted)
        dh, aw, dot = lib.fc2_dgrad_swiglu(dy_rows, w2, h, row_weight, offsets, zero_unrouted=zero_unrouted)
        dw2 = lib.expert_wgrad(dy_rows, aw, offsets, counts)
        dxs = lib.expert_gemm(dh, w1, offsets, True, zero_unrouted=zero_unrouted)
        dw1 = lib.expert_wgrad(dh, xs, offsets, counts)
        # With zero_unrouted=False the rows past offsets[-1] of dot are undefined, and so are their
        # sums; nobody reads those rows.
        return dxs, dw1, dw2, dot.sum(1)
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
    return dxs, dw1, dw2, lib.slot_dot(da_unweighted, a, every_row).view(-1)


def moe_forward_composed(x, topk_idx, topk_weights, w1, w2, keep_fc1, engine, row_align=ROW_ALIGN,
                         zero_unrouted=False):
    """The layer's forward; ``row_align`` (a multiple of ROW_ALIGN) sets the layout of ``fc1_out``, which the
    backward must be given too (the ops use ROW_ALIGN). The GEMMs skip the rows past the routed ones
    (``zero_unrouted=False``: only the combine reads their outputs, through the slots' rows), and the unused
    rows of ``fc1_out`` are zeroed on their own; ``zero_unrouted=True``, for comparisons: the GEMMs write
    zeros there instead."""
    T, H = x.shape
    K = topk_idx.shape[1]
    E, two_i, _ = w1.shape
    _, offsets, slot_to_row, row_to_slot = lib.dispatch_layout(topk_idx, E, 0, E, row_align)
    if T * K == 0:
        return x.new_zeros(T, H), x.new_zeros(row_to_slot.numel() if keep_fc1 else 0, two_i)
    routed_end = None if zero_unrouted else offsets  # the gather leaves the rows past the routed ones too
    # Not fc1_swiglu_gather: on the H200 the separate gather + TMA loads are faster (benchmarks/RESULTS.md).
    xs = lib.gather_rows(x, row_to_slot, K, None, slot_to_row, routed_end)
    a, h = expert_fc1(xs, w1, offsets, keep_fc1, engine, zero_unrouted=zero_unrouted)
    if keep_fc1 and not zero_unrouted:
        lib.zero_unrouted_rows(h, offsets)  # fc1_out goes to the caller: no row of it is left undefined
    o = expert_fc2(a, w2, offsets, row_weights(topk_weights, row_to_slot), engine, zero_unrouted=zero_unrouted)
    return lib.combine_reduce(o, slot_to_row, None), h


def moe_backward_composed(dy, x, topk_idx, topk_weights, w1, w2, fc1_out, engine, row_align=ROW_ALIGN,
                          zero_unrouted=False):
    """The layer's backward; the GEMMs skip the rows past the routed ones as in the forward: the outputs
    read only the slots' rows (the combine, ``gather_scalars``) and each expert's routed rows (the weight
    gradients)."""
    T, H = x.shape
    K = topk_idx.shape[1]
    E = w1.shape[0]
    counts, offsets, slot_to_row, row_to_slot = lib.dispatch_layout(topk_idx, E, 0, E, row_align)
    if T * K == 0:
        return (torch.zeros_like(x), torch.zeros(T, K, dtype=torch.float32, device=x.device),
                torch.zeros_like(w1), torch.zeros_like(w2))
    # The layout and the gathered rows are rebuilt, not kept from the forward: xs is K times x.
    routed_end = None if zero_unrouted else offsets
    xs = lib.gather_rows(x, row_to_slot, K, None, slot_to_row, routed_end)
    h = fc1_out if fc1_out is not None and fc1_out.numel() else None
    dy_rows = lib.gather_rows(dy.contiguous(), row_to_slot, K, None, slot_to_row, routed_end)
    row_weight = row_weights(topk_weights, row_to_slot)
    dxs, dw1, dw2, dtw_rows = expert_backward(xs, h, dy_rows, row_weight, w1, w2, offsets, counts, engine,
                                              zero_unrouted)
    d_topk_weights = lib.gather_scalars(dtw_rows, slot_to_row)
    dx = lib.combine_reduce(dxs, slot_to_row, None)
    return dx, d_topk_weights, dw1, dw2


def _moe_forward_cuda(x, topk_idx, topk_weights, w1, w2, precision="bf16", keep_fc1=True):
    check_precision(precision)
    return moe_forward_composed(x, topk_idx, topk_weights, w1, w2, keep_fc1, use_engine(x, w1))


def _moe_backward_cuda(dy, x, topk_idx, topk_weights, w1, w2, fc1_out, precision="bf16"):
    check_precision(precision)
    return moe_backward_composed(dy, x, topk_idx, topk_weights, w1, w2, fc1_out, use_engine(x, w1))


# Registered as plain calls (the decorator form returns None) so the functions stay importable:
# the CPU tests run the CUDA compositions through the primitives' CPU kernels.
torch.library.impl("primemoe::moe_forward", "cpu", _moe_forward_cpu)
torch.library.impl("primemoe::moe_backward", "cpu", _moe_backward_cpu)
torch.library.impl("primemoe::moe_forward", "cuda", _moe_forward_cuda)
torch.library.impl("primemoe::moe_backward", "cuda", _moe_backward_cuda)


# ---------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    x, topk_idx, topk_weights, w1, w2, precision, keep_fc1 = inputs
    _, fc1_out = output
    ctx.precision = precision
    ctx.keep_fc1 = keep_fc1
    ctx.weights_dtype = topk_weights.dtype
    ctx.save_for_backward(x, topk_idx, topk_weights, w1, w2, fc1_out if keep_fc1 else None)


def _backward(ctx, dy, _d_fc1_out):
    x, topk_idx, topk_weights, w1, w2, fc1_out = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(x)
    dx, dtw, dw1, dw2 = lib.moe_backward(dy.contiguous(), x, topk_idx, topk_weights, w1, w2,
                                         fc1_out if ctx.keep_fc1 else None, ctx.precision)
    return dx, None, dtw.to(ctx.weights_dtype), dw1, dw2, None, None


torch.library.register_autograd("primemoe::moe_forward", _backward, setup_context=_setup_context)
