"""Python side of the torch.ops.primemoe library.

The schemas live in C++ (csrc/). Here: fake (meta) kernels so torch.compile traces every op,
and the implementations of the public ops ``moe_forward`` / ``moe_backward`` with their
autograd formula: on CPU the reference (primemoe.reference), on CUDA the layer's composition
over ``layer.LocalTransport`` (layer.py). The internal ops of the ``buffer=`` path
(``_ep_moe_forward`` / ``_ep_moe_backward``) are registered in layer.py.

The primitives the composition is made of: the ``dispatch_layout`` kernel (device-side counts and
row maps, no host sync), ``gather_rows`` into expert-major order, the expert GEMM engine (persistent
warp-specialised sm_90a kernels, csrc/gemm/) and the deterministic ``combine_reduce`` kernel, which
sums each token's already weighted rows. The engine's ops:

- ``fc1_swiglu``: FC1 with SwiGLU in the epilogue over rows in expert-major order
  (pre-activations kept on request), with the producer's wait on arrival counters for
  expert parallelism;
- ``expert_gemm``: FC2 forward (routing weight applied in the epilogue) and FC1 dgrad;
- ``fc2_dgrad_swiglu``: FC2 dgrad with the SwiGLU backward, the routing weight and the
  ``<da, a>`` routing-weight gradient partials in the epilogue;
- ``expert_wgrad``: both weight gradients, each expert's rows reduced inside one tile (given
  the layout's counts, only up to the last 64-row k-slice holding a routed row);
  ``expert_wgrad_accumulate`` adds them in fp32 into a weight's fp32 main gradient instead.

``fc1_out`` is ``[rows, 2I]`` in the expert-major row order of
``dispatch_layout(topk_idx, E, 0, E, layer.forward_row_align(precision))`` (``ROW_ALIGN``; 128 for precision
"fp8"; see layer.py), rows past the padded total zeros.

Precisions "fp8" and "fp8_bwd" (DESIGN.md section 2): on CUDA the layer's FP8 composition (sm_90); on the CPU the
FP8-emulating reference (``reference.moe_fp8`` / ``moe_fp8_backward``, ``fp8_forward`` for "fp8" only).
"""

from __future__ import annotations

import torch

from . import _C  # noqa: F401  (loads the library that defines the schemas)
from . import _cpu  # noqa: F401  (registers the primitives' CPU kernels)
from . import _quant_ops  # noqa: F401  (the FP8 quantisation ops' fakes and CPU kernels)
from . import _fp8_ops  # noqa: F401  (the FP8 expert GEMMs' fakes and CPU kernels)
from . import layer, reference
from ._constants import ROW_ALIGN, TILE_N, layout_max_rows  # noqa: F401  (ROW_ALIGN: re-exported for the tests)
from ._validate import FP8_PRECISIONS, check_precision

lib = torch.ops.primemoe


# ---------------------------------------------------------------- fake kernels


@torch.library.register_fake("primemoe::moe_forward")
def _moe_forward_fake(x, topk_idx, topk_weights, w1, w2, precision="bf16", keep_fc1=True):
    T, K = topk_idx.shape
    rows = layout_max_rows(T * K, w1.shape[0], layer.forward_row_align(precision)) if keep_fc1 else 0
    return x.new_empty(x.shape), x.new_empty(rows, w1.shape[1])


@torch.library.register_fake("primemoe::moe_backward")
def _moe_backward_fake(dy, x, topk_idx, topk_weights, w1, w2, fc1_out, precision="bf16", w1_main_grad=None,
                       w2_main_grad=None):
    return (x.new_empty(x.shape), topk_weights.new_empty(topk_weights.shape, dtype=torch.float32),
            *layer.weight_grad_outputs((w1.new_empty(w1.shape), w2.new_empty(w2.shape)), (w1, w2),
                                       (w1_main_grad, w2_main_grad)))


@torch.library.register_fake("primemoe::dispatch_layout")
def _dispatch_layout_fake(topk_idx, num_experts, expert_begin, num_local_experts, row_align):
    rows = layout_max_rows(topk_idx.numel(), num_local_experts, row_align)
    new = lambda *shape: topk_idx.new_empty(shape, dtype=torch.int32)  # noqa: E731
    return new(num_local_experts), new(num_local_experts + 1), new(*topk_idx.shape), new(rows)


@torch.library.register_fake("primemoe::gather_rows")
def _gather_rows_fake(src, row_to_slot, top_k, scale, slot_to_row=None, expert_offsets=None):
    return src.new_empty(row_to_slot.shape[0], src.shape[1])


@torch.library.register_fake("primemoe::combine_reduce")
def _combine_reduce_fake(rows, slot_to_row, weights, local_rows=None):
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
def _expert_gemm_fake(rows, w, expert_offsets, w_kn, row_weight=None, zero_unrouted=True, done_flags=None,
                      done_counts=None, done_epoch=None, done_sms=0):
    return rows.new_empty(rows.shape[0], w.shape[2] if w_kn else w.shape[1])


@torch.library.register_fake("primemoe::fc1_swiglu")
def _fc1_swiglu_fake(rows, w1, expert_offsets, keep_fc1, rows_ready=None, epoch=None, per_epoch=1, rank=0,
                     zero_unrouted=True, tile_counter=None, overlap_sms=0):
    inter = w1.shape[1] // 2
    return rows.new_empty(rows.shape[0], inter), rows.new_empty(rows.shape[0] if keep_fc1 else 0, 2 * inter)


@torch.library.register_fake("primemoe::fc2_dgrad_swiglu")
def _fc2_dgrad_swiglu_fake(dy_rows, w2, h, row_weight, expert_offsets, zero_unrouted=True, rows_ready=None,
                           epoch=None, per_epoch=1, rank=0, overlap_sms=0):
    R, inter = dy_rows.shape[0], w2.shape[2]
    return (dy_rows.new_empty(R, 2 * inter), dy_rows.new_empty(R, inter),
            dy_rows.new_empty(R, inter // TILE_N, dtype=torch.float32))


@torch.library.register_fake("primemoe::expert_wgrad")
def _expert_wgrad_fake(a_rows, b_rows, expert_offsets, expert_rows=None):
    return a_rows.new_empty(expert_offsets.shape[0] - 1, a_rows.shape[1], b_rows.shape[1])


@torch.library.register_fake("primemoe::expert_wgrad_accumulate")
def _expert_wgrad_accumulate_fake(a_rows, b_rows, expert_offsets, expert_rows, main_grad):
    return None


@torch.library.register_fake("primemoe::ep_dispatch")
def _ep_dispatch_fake(workspace, epoch, x, topk_idx, topk_weights, rank, world, max_tokens, local_experts,
                      row_align, num_sms, wait_arrivals=True, put_peers=False, force_put=False, copy_rows=True,
                      recv_capacity=0):
    new = lambda *shape: x.new_empty(shape, dtype=torch.int32)  # noqa: E731
    return new(local_experts), new(local_experts + 1), topk_idx.new_empty(topk_idx.shape, dtype=torch.bool)


@torch.library.register_fake("primemoe::ep_combine")
def _ep_combine_fake(workspace, epoch, rows, row_scalars, expert_offsets, rank, world, max_tokens, hidden, top_k,
                     local_experts, row_align, num_sms, put_peers=False, force_put=False, published=False, send=True,
                     wait=True, recv_capacity=0):
    return None


# ---------------------------------------------------------------- CPU: the reference


def _fc1_rows_cpu(x, topk_idx, w1, precision="bf16", w2=None):
    """FC1's pre-activations in moe_forward's layout: the bf16 path's (float32 products), or for "fp8" the
    FP8-emulating reference's (spec step 2: quantised operands, float64 products rounded to float32, then bf16)."""
    E = w1.shape[0]
    K = topk_idx.shape[1]
    counts, offsets, _, row_to_slot = lib.dispatch_layout(topk_idx, E, 0, E, layer.forward_row_align(precision))
    acc = reference.compute_dtype(x.dtype)
    fp8_operands = reference._Fp8Operands(x, w1, w2, True, True) if precision == "fp8" else None
    out = x.new_zeros(row_to_slot.numel(), w1.shape[1])
    for e in range(E):
        lo, n = int(offsets[e]), int(counts[e])
        if n:
            tokens = row_to_slot[lo:lo + n].long() // K
            if fp8_operands is not None:
                out[lo:lo + n] = fp8_operands.fc1(e, tokens).to(x.dtype)
            else:
                out[lo:lo + n] = (x[tokens].to(acc) @ w1[e].to(acc).t()).to(x.dtype)
    return out


def _moe_forward_cpu(x, topk_idx, topk_weights, w1, w2, precision="bf16", keep_fc1=True):
    check_precision(precision)
    if precision == "fp8":
        with torch.no_grad():
            y = reference.moe_fp8(x, topk_idx, topk_weights, w1, w2, fp8_forward=True)
    else:  # "bf16", and "fp8_bwd"'s forward, which is the bf16 one
        y = reference.moe(x, topk_idx, topk_weights, w1, w2)
    fc1 = _fc1_rows_cpu(x, topk_idx, w1, precision, w2) if keep_fc1 else x.new_empty(0, w1.shape[1])
    return y, fc1


def _moe_backward_cpu(dy, x, topk_idx, topk_weights, w1, w2, fc1_out, precision="bf16", w1_main_grad=None,
                      w2_main_grad=None):
    check_precision(precision)
    main_grads = layer.check_main_grads((w1, w2), (w1_main_grad, w2_main_grad))
    if precision in FP8_PRECISIONS:
        dx, dtw, dw1, dw2 = reference.moe_fp8_backward(dy, x, topk_idx, topk_weights, w1, w2,
                                                      fp8_forward=precision == "fp8")
        dx = dx.to(x.dtype)
    else:
        dx, dtw, dw1, dw2 = reference.moe_backward(dy, x, topk_idx, topk_weights, w1, w2)
    # The reference's gradients come rounded to the weights' dtype: the CPU adds those.
    dws = layer._into_main_grads((dw1, dw2), main_grads)
    dws = [dw if dw is None else dw.to(w.dtype) for dw, w in zip(dws, (w1, w2))]
    return (dx, dtw, *layer.weight_grad_outputs(dws, (w1, w2), main_grads))


# ---------------------------------------------------------------- CUDA: the layer's composition


def _moe_forward_cuda(x, topk_idx, topk_weights, w1, w2, precision="bf16", keep_fc1=True):
    check_precision(precision)
    transport = layer.LocalTransport(topk_idx, w1.shape[0], layer.forward_row_align(precision))
    y, fc1_out, _ = layer.forward(transport, x, topk_weights, w1, w2, keep_fc1=keep_fc1, precision=precision)
    return y, fc1_out


def _moe_backward_cuda(dy, x, topk_idx, topk_weights, w1, w2, fc1_out, precision="bf16", w1_main_grad=None,
                       w2_main_grad=None):
    check_precision(precision)
    main_grads = layer.check_main_grads((w1, w2), (w1_main_grad, w2_main_grad))
    transport = layer.LocalTransport(topk_idx, w1.shape[0], layer.backward_row_align(precision))
    dx, dtw, dw1, dw2 = layer.backward(transport, dy, x, topk_weights, w1, w2, fc1_out, precision=precision,
                                       fc1_row_align=layer.forward_row_align(precision), main_grads=main_grads)
    return (dx, dtw, *layer.weight_grad_outputs((dw1, dw2), (w1, w2), main_grads))


# Registered as plain calls (the decorator form returns None) so the functions stay importable.
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
    # fc1_out gets no gradient: without this, autograd would fill a zero tensor of its size for every backward.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, topk_idx, topk_weights, w1, w2, fc1_out if keep_fc1 else None)
    ctx.main_grads = layer.MainGrads.of(w1, w2)


def _backward(ctx, dy, _d_fc1_out):
    x, topk_idx, topk_weights, w1, w2, fc1_out = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(x)
    dx, dtw, dw1, dw2 = lib.moe_backward(dy.contiguous(), x, topk_idx, topk_weights, w1, w2,
                                         fc1_out if ctx.keep_fc1 else None, ctx.precision, *ctx.main_grads.tensors)
    dw1, dw2 = ctx.main_grads.weight_grads(dw1, dw2)
    return dx, None, dtw.to(ctx.weights_dtype), dw1, dw2, None, None


torch.library.register_autograd("primemoe::moe_forward", _backward, setup_context=_setup_context)
