"""Python side of the torch.ops.primemoe library.

The schemas live in C++ (csrc/binding.cpp). Here: fake (meta) kernels so
torch.compile traces every op, the CPU and CUDA implementations of
``moe_forward`` / ``moe_backward``, and their autograd formula.

CUDA path today: the ``dispatch_layout`` kernel (device-side counts and row maps,
no host sync), ``gather_rows`` into expert-major order, ``torch._grouped_mm`` for the
GEMMs, and the deterministic ``combine_reduce`` / ``slot_dot`` kernels. The fused
Hopper kernels replace the GEMM stages when they land.

``fc1_out`` (the FC1 pre-activations kept for backward) is ``[rows, 2I]`` in the
expert-major row order of ``dispatch_layout(topk_idx, E, 0, E, 1)``: experts in
order, each expert's slots in slot order, rows past the routed total unused.
"""

from __future__ import annotations

import torch

from . import _C  # noqa: F401  (loads the library that defines the schemas)
from . import reference
from .baseline import grouped_wgrad, swiglu, swiglu_backward
from ._validate import check_precision

lib = torch.ops.primemoe


def _layout_rows(num_slots: int, num_local: int, row_align: int) -> int:
    return num_slots + num_local * (row_align - 1)


# ---------------------------------------------------------------- fake kernels


@torch.library.register_fake("primemoe::moe_forward")
def _moe_forward_fake(x, topk_idx, topk_weights, w1, w2, precision="bf16", keep_fc1=True):
    T, K = topk_idx.shape
    rows = _layout_rows(T * K, w1.shape[0], 1) if keep_fc1 else 0
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
def _gather_rows_fake(src, row_to_slot, top_k, scale):
    return src.new_empty(row_to_slot.shape[0], src.shape[1])


@torch.library.register_fake("primemoe::combine_reduce")
def _combine_reduce_fake(rows, slot_to_row, weights):
    return rows.new_empty(slot_to_row.shape[0], rows.shape[1])


@torch.library.register_fake("primemoe::slot_dot")
def _slot_dot_fake(a, b, slot_to_row):
    return a.new_empty(slot_to_row.shape, dtype=torch.float32)


@torch.library.register_fake("primemoe::ep_dispatch")
def _ep_dispatch_fake(workspace, epoch, x, topk_idx, topk_weights, rank, world, max_tokens, local_experts,
                      row_align, num_sms):
    new = lambda *shape: x.new_empty(shape, dtype=torch.int32)  # noqa: E731
    return new(local_experts), new(local_experts + 1), topk_idx.new_empty(topk_idx.shape, dtype=torch.bool)


@torch.library.register_fake("primemoe::ep_combine")
def _ep_combine_fake(workspace, epoch, rows, row_scalars, expert_offsets, rank, world, max_tokens, hidden, top_k,
                     local_experts, row_align, num_sms):
    return None


# ---------------------------------------------------------------- CPU: the reference


def _fc1_rows_cpu(x, topk_idx, w1):
    E = w1.shape[0]
    K = topk_idx.shape[1]
    counts, offsets, _, row_to_slot = lib.dispatch_layout(topk_idx, E, 0, E, 1)
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


def weighted_expert_backward(xs, h, dy_rows, row_weight, w1, w2, ends):
    """Backward of ``row_weight * FC2(swiglu(FC1(xs)))`` in the expert-major row space, given the
    *unweighted* ``dy_rows``. Returns ``(dxs, dw1, dw2, da_unweighted, a)``: the routing-weight
    gradient of a row is ``<da_unweighted, a>`` (= <dy, FC2 output>), so FC2's output need not be kept."""
    a = swiglu(h)
    da_unweighted = torch._grouped_mm(dy_rows, w2, offs=ends)
    dh = swiglu_backward(h, (da_unweighted * row_weight).to(h.dtype))
    dw2 = grouped_wgrad(dy_rows, (a.float() * row_weight).to(a.dtype), ends)
    dxs = torch._grouped_mm(dh, w1, offs=ends)
    dw1 = grouped_wgrad(dh, xs, ends)
    return dxs, dw1, dw2, da_unweighted, a


def _moe_forward_cuda(x, topk_idx, topk_weights, w1, w2, precision="bf16", keep_fc1=True):
    check_precision(precision)
    T, H = x.shape
    K = topk_idx.shape[1]
    E, two_i, _ = w1.shape
    _, offsets, slot_to_row, row_to_slot = lib.dispatch_layout(topk_idx, E, 0, E, 1)
    if T * K == 0:
        return x.new_zeros(T, H), x.new_empty(T * K if keep_fc1 else 0, two_i)
    ends = offsets[1:]
    xs = lib.gather_rows(x, row_to_slot, K, None)
    h = torch._grouped_mm(xs, w1.transpose(1, 2), offs=ends)
    o = torch._grouped_mm(swiglu(h), w2.transpose(1, 2), offs=ends)
    y = lib.combine_reduce(o, slot_to_row, topk_weights)
    return y, (h if keep_fc1 else h.new_empty(0, two_i))


def _moe_backward_cuda(dy, x, topk_idx, topk_weights, w1, w2, fc1_out, precision="bf16"):
    check_precision(precision)
    T, H = x.shape
    K = topk_idx.shape[1]
    E = w1.shape[0]
    _, offsets, slot_to_row, row_to_slot = lib.dispatch_layout(topk_idx, E, 0, E, 1)
    if T * K == 0:
        return (torch.zeros_like(x), torch.zeros(T, K, dtype=torch.float32, device=x.device),
                torch.zeros_like(w1), torch.zeros_like(w2))
    ends = offsets[1:]
    xs = lib.gather_rows(x, row_to_slot, K, None)
    h = fc1_out if fc1_out is not None and fc1_out.numel() else torch._grouped_mm(xs, w1.transpose(1, 2), offs=ends)
    dy_rows = lib.gather_rows(dy.contiguous(), row_to_slot, K, None)
    row_weight = topk_weights.reshape(-1).float()[row_to_slot.clamp(min=0).long()]
    row_weight = torch.where(row_to_slot >= 0, row_weight, 0.0).unsqueeze(1)
    dxs, dw1, dw2, da_unweighted, a = weighted_expert_backward(xs, h, dy_rows, row_weight, w1, w2, ends)
    d_topk_weights = lib.slot_dot(da_unweighted, a, slot_to_row)
    dx = lib.combine_reduce(dxs, slot_to_row, None)
    return dx, d_topk_weights, dw1, dw2


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
