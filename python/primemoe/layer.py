"""``primemoe.moe``: the layer, one forward/backward composition over two transports.

Forward, per rank::

    rows, counts, offsets = transport.dispatch(x)     # the routed rows, expert-major (zero padding rows)
    a, h = FC1 + SwiGLU (rows)                         # h: FC1's pre-activations, kept or recomputed
    o = row_weight * FC2(a)                            # the routing weight in FC2's epilogue
    y = transport.combine(o)                           # each token's sum of its slots' rows

Backward: the same dispatch of ``dy`` (same routing, same layout as the forward's rows), then FC2
dgrad with the SwiGLU backward, the two weight gradients and FC1 dgrad, and the combine of the row
gradients and of each row's routing-weight gradient ``<dy_row, FC2 output_row>``.

The transports (the only difference between the two paths):

- ``LocalTransport`` (``buffer=None``, all experts on this device): ``dispatch_layout`` over all E
  experts + ``gather_rows`` in, ``combine_reduce`` out. Behind the public ops
  ``torch.ops.primemoe.moe_forward`` / ``moe_backward`` (registered in ops.py).
- ``ep.BufferTransport`` (``buffer=primemoe.Buffer``): the Buffer's NVSHMEM dispatch in (with the engine,
  FC1 waits per expert on the arrival counters), its combine + ``combine_reduce`` out; the forward's rows
  are saved for the backward (``copy_routed_rows``). Behind the internal ops ``_ep_moe_forward`` /
  ``_ep_moe_backward`` (registered here), which take the Buffer by its ``handle``.

Both paths' forward ops differentiate through ``torch.library.register_autograd``.

The expert GEMMs run on the engine (persistent warp-specialised sm_90a kernels, csrc/gemm/) where it
covers the problem (``engine_supports``) and the layout's alignment is a multiple of ``ROW_ALIGN``;
else on ``torch._grouped_mm`` (_fallback.py). Either way the GEMMs skip the rows past the routed
ones (``zero_unrouted=False``): downstream reads only the slots' rows (the combine, the scalars) and
each expert's routed rows (the weight gradients).

Precisions (DESIGN.md section 2): ``"bf16"`` as above; ``"fp8"`` the same composition on the blockwise FP8
ops (``reference._FP8_SPEC``: ``quantize_fp8_1x128`` of the dispatched bf16 rows, ``fp8_expert_gemm`` with the
cached 128x128 weight quantisation ``fp8.quantized_weights``, ``fp8_swiglu_quant`` between FC1 and FC2) over a
layout whose experts start at multiples of ``FP8_ROW_ALIGN`` (128); ``"fp8_bwd"`` the bf16 forward unchanged
(its layout, its kernels: bitwise the ``"bf16"`` forward) and the FP8 backward. The FP8 backward (both modes):
FC2 dgrad on ``quantize_fp8_1x128(dy rows)`` (fp32 ``da``), ``fp8_swiglu_backward`` (``dh`` in bf16 and
quantised, ``aw``, the rows' ``<da, a>``), FC1 dgrad, and the weight gradients ``fp8_expert_wgrad`` on the
operands re-quantised 128x1 along the rows from bf16. The FP8 ops have no rows-ready hook: the FP8 forward
dispatches with the transport's wait. Nothing reads device data on the host (a step is CUDA-graph capturable);
during a capture the weights are quantised inside the graph instead of being taken from the cache.

``fc1_out`` is ``[rows, 2I]`` in the transport's row order; ``moe_forward``'s is the layout of
``dispatch_layout(topk_idx, E, 0, E, forward_row_align(precision))`` (``ROW_ALIGN``, the GEMM tile
height; ``FP8_ROW_ALIGN`` for "fp8"): experts in order, each expert's slots in slot order, each
expert's range padded with zero rows to a multiple of the alignment, rows past the padded total
zeros. Kept by default (``keep_fc1=True``): the backward then skips a third of the forward's FLOPs
for 2·I·2 bytes per row; ``keep_fc1=False`` recomputes FC1 in the backward to save that memory.
"fp8_bwd"'s backward runs on the FP8 layout and moves the kept rows into it (``LocalTransport.relayout``).
"""

from __future__ import annotations

import functools

import torch

from . import _C  # noqa: F401  (loads the library that defines the schemas)
from . import _fallback, fp8
from ._constants import FP8_ROW_ALIGN, ROW_ALIGN
from ._validate import FP8_PRECISIONS, check_moe_inputs, check_precision
from .buffer import Buffer
from .ep import BufferTransport, check_buffer_problem, lookup_buffer

__all__ = ["moe", "ep_moe", "forward", "backward", "LocalTransport", "engine_supports", "ROW_ALIGN", "FP8_ROW_ALIGN",
           "forward_row_align", "backward_row_align"]

lib = torch.ops.primemoe


# ---------------------------------------------------------------- the user's entry


def moe(x, topk_idx, topk_weights, w1, w2, *, buffer=None, precision="bf16", keep_fc1=True):
    """Expert part of an MoE layer (DESIGN.md section 1), differentiable w.r.t.
    ``x``, ``topk_weights``, ``w1`` and ``w2``.

    x [T, H] bf16; topk_idx [T, K] int64/int32 (-1 = skip); topk_weights [T, K] fp32/bf16;
    w1 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]. Returns y [T, H]. All contiguous; on CUDA
    x, w1 and w2 16-byte aligned.
    ``keep_fc1``: keep the FC1 pre-activations for backward (memory) instead of
    recomputing FC1 there (compute). ``buffer=None``: all experts on this GPU. With a
    ``primemoe.Buffer``: expert parallelism over its group; w1, w2 hold this rank's
    ``buffer.local_experts`` experts and ids in ``topk_idx`` stay global.
    A weight with a ``main_grad`` attribute (fp32, its shape; Megatron's gradient-accumulation fusion) gets its
    gradient added into it by the backward, unrounded, instead of a ``.grad`` (``MainGrads``).
    """
    if buffer is not None:
        if not isinstance(buffer, Buffer):
            raise TypeError(f"buffer: expected a primemoe.Buffer or None, got {type(buffer).__name__}")
        return ep_moe(x, topk_idx, topk_weights, w1, w2, buffer=buffer, precision=precision, keep_fc1=keep_fc1)
    check_moe_inputs(x, topk_idx, topk_weights, w1, w2, precision=precision)
    wants_grad = _wants_grad(x, topk_weights, w1, w2)
    y, _ = lib.moe_forward(x, topk_idx, topk_weights, w1, w2, precision, keep_fc1 and wants_grad)
    return y


def ep_moe(x, topk_idx, topk_weights, w1, w2, *, buffer, precision="bf16", keep_fc1=True):
    """``moe(..., buffer=buffer)`` for any object with primemoe.Buffer's interface and a ``handle`` from
    ``ep.register_buffer`` (the CPU tests' model of a Buffer): w1, w2 hold this rank's
    ``buffer.local_experts`` experts; ids in ``topk_idx`` are global (expert ``g`` lives on rank
    ``g // local_experts``)."""
    shape = check_moe_inputs(x, topk_idx, topk_weights, w1, w2, precision=precision, num_ranks=buffer.world,
                             max_tokens=buffer.max_tokens_per_rank)
    check_buffer_problem(shape, x.device, precision, buffer)
    wants_grad = _wants_grad(x, topk_weights, w1, w2)
    y, _, _ = lib._ep_moe_forward(x, topk_idx, topk_weights, w1, w2, buffer.handle, precision,
                                  keep_fc1 and wants_grad, wants_grad)
    return y


def _wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ---------------------------------------------------------------- the expert part


@functools.lru_cache(maxsize=None)
def _engine_unsupported(device_index: int, hidden: int, intermediate: int) -> str:
    return lib.expert_gemm_unsupported(device_index, hidden, intermediate)


def engine_supports(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """Whether the expert GEMM engine covers this problem (else the GEMMs run on ``torch._grouped_mm``)."""
    return x.is_cuda and _engine_unsupported(x.device.index, x.shape[1], w1.shape[1] // 2) == ""


def expert_fc1(xs, w1, offsets, keep_fc1, engine, rows_ready=None, overlap_sms=0):
    """FC1 + SwiGLU per expert over the expert-major rows: ``(a, h or an empty [0, 2I])``.
    ``rows_ready`` (engine only): ``(counters, epoch, per_epoch, rank, tile_counter)``: FC1's producer waits for
    ``counters[e] >= epoch * per_epoch`` before it loads expert ``e``'s rows; ``overlap_sms`` > 0: FC1 starts while
    the dispatch that made ``xs`` still runs on that many SMs (it must be the last thing on the stream). Rows past
    ``offsets[-1]`` of the outputs are left undefined (here and below)."""
    if engine:
        if rows_ready is None:
            return lib.fc1_swiglu(xs, w1, offsets, keep_fc1, zero_unrouted=False)
        counters, epoch, per_epoch, rank, tile_counter = rows_ready
        return lib.fc1_swiglu(xs, w1, offsets, keep_fc1, counters, epoch, per_epoch, rank, zero_unrouted=False,
                              tile_counter=tile_counter, overlap_sms=overlap_sms)
    return _fallback.fc1(xs, w1, offsets, keep_fc1)


def _done_args(done):
    """``expert_gemm``'s publishing arguments from a transport's ``results_done()``."""
    if done is None:
        return {}
    flags, counts, epoch, sms = done
    return dict(done_flags=flags, done_counts=counts, done_epoch=epoch, done_sms=sms)


def expert_fc2(a, w2, offsets, row_weight, engine, done=None):
    """``row_weight * FC2(a)`` per expert: the routing weight is applied here (in the engine's
    epilogue), so the combine only sums a token's rows. ``done`` (engine only): ``results_done()``,
    where the rows are published for a combine started right after."""
    if engine:
        return lib.expert_gemm(a, w2, offsets, False, row_weight, zero_unrouted=False, **_done_args(done))
    return _fallback.fc2(a, w2, offsets, row_weight)


def expert_backward(operands, row_weight, w1, w2, offsets, counts, engine, rows_ready=None, overlap_sms=0,
                    done=None, on_dxs=None, main_grads=(None, None)):
    """Backward of ``row_weight * FC2(swiglu(FC1(xs)))`` in the expert-major row space, given ``operands`` =
    ``[xs, h, dy_rows]``: the rows, the kept pre-activations ``h`` (None: recomputed) and the *unweighted*
    ``dy_rows``. The list is emptied here and each operand dropped after its last use, so that the later outputs
    take their memory (the caller must hold no other reference to them for that to happen); ``counts``: the
    layout's routed rows per expert (the engine's weight gradients skip the padding with them). Returns
    ``(dxs, dw1, dw2, dtw_rows)``; ``dtw_rows[r] = <dy_r, FC2 output_r>`` = ``<da_r, a_r>``
    (unweighted), the routing-weight gradient of the row, so FC2's output need not be kept. ``rows_ready`` and
    ``overlap_sms`` (engine only, as ``expert_fc1``'s): FC2's dgrad waits for ``dy_rows`` per expert and, with
    ``overlap_sms``, runs alongside their dispatch (then ``h`` is given: nothing may come between the two).
    ``on_dxs(dxs, dtw_rows)`` (engine only) is called right after FC1's dgrad, before ``dw1``: the combine starts
    there, alongside that GEMM when ``done`` (``results_done()``) has it publish ``dxs``.
    ``main_grads`` = ``(w1's, w2's)`` fp32 main gradients or None each: that weight's gradient is added into it
    (the engine: by the weight-gradient GEMM, unrounded) and returned as None.
    Reads no row of ``xs`` past ``offsets[-1]`` (the Buffer path saves only those): the engine skips
    tiles past the routed rows, ``torch._grouped_mm`` reads only the rows inside its groups."""
    xs, h, dy_rows = operands
    operands.clear()
    if not engine:
        dxs, dw1, dw2, dtw_rows = _fallback.expert_backward(xs, h, dy_rows, row_weight, w1, w2, offsets)
        return (dxs, *_into_main_grads((dw1, dw2), main_grads), dtw_rows)
    if h is None:  # the pre-activations only: FC1 without its SwiGLU epilogue
        h = lib.expert_gemm(xs, w1, offsets, False, zero_unrouted=False)
    hook = () if rows_ready is None else rows_ready[:4]  # FC2's dgrad claims no tiles: no tile counter
    dh, aw, dot = lib.fc2_dgrad_swiglu(dy_rows, w2, h, row_weight, offsets, False, *hook, overlap_sms=overlap_sms)
    del h
    # The rows past offsets[-1] of dot are undefined, and so are their sums; nobody reads those rows.
    dtw_rows = dot.sum(1)
    dw2 = _wgrad(dy_rows, aw, offsets, counts, main_grads[1])
    # Freed in stream order (every kernel that reads them is queued): dxs and dw1 are allocated into them.
    del dy_rows, aw, dot
    dxs = lib.expert_gemm(dh, w1, offsets, True, zero_unrouted=False, **_done_args(done))
    if on_dxs is not None:
        on_dxs(dxs, dtw_rows)
    dw1 = _wgrad(dh, xs, offsets, counts, main_grads[0])
    return dxs, dw1, dw2, dtw_rows


class MainGrads:
    """The fp32 main gradients of ``w1`` and ``w2`` (Megatron's ``param.main_grad``, gradient-accumulation fusion)
    seen at the forward, for its backward: a weight with one has its gradient added into it (by the
    weight-gradient GEMM, in fp32) and gets no gradient from autograd, except, as Megatron's layers do, a weight
    with a ``grad_added_to_main_grad`` attribute: that is set True and the weight gets a placeholder gradient of
    its shape (zeros where ``zero_out_wgrad`` is set, else uninitialised), so that its backward hooks (a
    data-parallel wrapper's) still fire. Under torch.compile the traced weights carry no ``main_grad``: plain
    gradients."""

    __slots__ = ("tensors", "_flagged")

    def __init__(self, tensors, flagged):
        self.tensors, self._flagged = tensors, flagged

    @classmethod
    def of(cls, w1, w2) -> "MainGrads":
        weights = (w1, w2)
        tensors = check_main_grads(weights, tuple(getattr(w, "main_grad", None) for w in weights))
        flagged = tuple(w if t is not None and hasattr(w, "grad_added_to_main_grad") else None
                        for w, t in zip(weights, tensors))
        return cls(tensors, flagged)

    def weight_grads(self, dw1, dw2):
        """What the backward returns for ``w1`` / ``w2``: where the gradient went into a main gradient, None, or
        Megatron's placeholder for a weight with ``grad_added_to_main_grad``."""
        out = []
        for dw, main_grad, weight in zip((dw1, dw2), self.tensors, self._flagged):
            if main_grad is not None:
                dw = None
                if weight is not None:
                    weight.grad_added_to_main_grad = True
                    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
                    dw = make(weight.shape, dtype=weight.dtype, device=weight.device)
            out.append(dw)
        return out


def check_main_grads(weights, main_grads):
    """``main_grads`` (None each, or an fp32 tensor of its weight's shape and device), as a tuple."""
    for name, w, main_grad in zip(("w1", "w2"), weights, main_grads):
        if main_grad is None:
            continue
        if not isinstance(main_grad, torch.Tensor):
            raise TypeError(f"{name}.main_grad: expected a tensor, got {type(main_grad).__name__}")
        if main_grad.dtype != torch.float32 or main_grad.shape != w.shape or main_grad.device != w.device:
            raise ValueError(f"{name}.main_grad: expected a float32 tensor of {name}'s shape {tuple(w.shape)} on "
                             f"{w.device}, got {main_grad.dtype} {tuple(main_grad.shape)} on {main_grad.device}")
        if not main_grad.is_contiguous():
            raise ValueError(f"{name}.main_grad: expected a contiguous tensor")
    return tuple(main_grads)


def weight_grad_outputs(dws, weights, main_grads):
    """The ops' dw outputs: an empty tensor where the gradient went into a main gradient (ops return tensors)."""
    return tuple(w.new_empty(0) if main_grad is not None else dw
                 for dw, w, main_grad in zip(dws, weights, main_grads))


def _wgrad(a_rows, b_rows, offsets, counts, main_grad):
    """The engine's weight gradient, or None after adding it into ``main_grad`` (fp32)."""
    if main_grad is None:
        return lib.expert_wgrad(a_rows, b_rows, offsets, counts)
    lib.expert_wgrad_accumulate(a_rows, b_rows, offsets, counts, main_grad)
    return None


def _into_main_grads(dws, main_grads):
    """``dws`` with each one that has a main gradient added into it (fp32) and replaced by None."""
    out = []
    for dw, main_grad in zip(dws, main_grads):
        if main_grad is not None:
            main_grad.add_(dw.float())
            dw = None
        out.append(dw)
    return out


# ---------------------------------------------------------------- the FP8 expert part


def forward_row_align(precision: str) -> int:
    """The row alignment of ``moe_forward``'s layout (and of its ``fc1_out``) for ``precision``."""
    return FP8_ROW_ALIGN if precision == "fp8" else ROW_ALIGN


def backward_row_align(precision: str) -> int:
    """The row alignment of ``moe_backward``'s layout for ``precision`` (the FP8 backward's for both FP8 modes)."""
    return FP8_ROW_ALIGN if precision in FP8_PRECISIONS else ROW_ALIGN


def fp8_weights(w: torch.Tensor) -> fp8.QuantizedWeights:
    """The 128x128 quantisation of a weight (pow2 scales): cached until the weight changes
    (``fp8.quantized_weights``, one quantisation per optimizer step; CUDA weights by the CUDA kernel), except
    during a CUDA-graph capture, where it is quantised inside the graph: a replay must see the weights' values at
    replay time, not the cache's at capture time."""
    if w.is_cuda:
        if torch.cuda.is_current_stream_capturing():
            return fp8.QuantizedWeights(*lib.quantize_fp8_128x128(w, True), True)
        return fp8.quantized_weights(w, True, quantize=lib.quantize_fp8_128x128)
    return fp8.quantized_weights(w, True)


def fp8_fc1(xs, w1, offsets):
    """FC1's bf16 pre-activations ``h [rows, 2I]`` on the FP8 operands (spec steps 1-2): the bf16 rows quantised
    1x128 along H (scales MN-major, as the GEMM loads them), ``w1``'s cached 128x128 blocks."""
    xq, x_scale = lib.quantize_fp8_1x128(xs, True, True, offsets)
    w1q = fp8_weights(w1)
    return lib.fp8_expert_gemm(xq, x_scale, w1q.q, w1q.s, offsets)


def fp8_fc2(h, w2, offsets, row_weight):
    """``row_weight * FC2(swiglu(h))`` (spec steps 3-5): the SwiGLU output quantised 1x128 along I, the weight
    applied to the GEMM's fp32 result, bf16 rows."""
    a_q, a_scale = lib.fp8_swiglu_quant(h, offsets, True)
    w2q = fp8_weights(w2)
    return lib.fp8_expert_gemm(a_q, a_scale, w2q.q, w2q.s, offsets, row_weight)


def _tile_rows(rows: torch.Tensor) -> torch.Tensor:
    """The leading rows of ``rows`` in whole 128-row tiles (a view): the 128x1 quantiser and the weight-gradient
    GEMM take tiles of rows, and every expert's rows (``< offsets[-1]``, a multiple of 128 no larger than the
    layout's rows) lie inside them."""
    return rows[:rows.shape[0] // FP8_ROW_ALIGN * FP8_ROW_ALIGN]


def fp8_expert_backward(operands, row_weight, w1, w2, offsets, counts, main_grads=(None, None)):
    """``(dxs, dw1, dw2, dtw_rows)`` as ``expert_backward`` defines them (``dw`` in the weights' dtypes), on the FP8
    recipe (spec steps 7-12), given ``operands`` = ``[xs, h, dy_rows]`` with the bf16 pre-activations ``h`` (kept or
    recomputed by the caller), emptied and dropped after their last uses as ``expert_backward``'s; ``main_grads`` as
    there."""
    xs, h, dy_rows = operands
    operands.clear()
    w1q, w2q = fp8_weights(w1), fp8_weights(w2)
    dy_q, dy_scale = lib.quantize_fp8_1x128(dy_rows, True, True, offsets)
    w2q_t, w2s_t = w2q.transposed_contiguous()  # [E, I, H]: FC2 dgrad contracts over H
    da = lib.fp8_expert_gemm(dy_q, dy_scale, w2q_t, w2s_t, offsets, None, True)  # fp32, unweighted
    del dy_q, dy_scale, w2q_t, w2s_t
    dh, dh_q, dh_scale, aw, dot = lib.fp8_swiglu_backward(da, h, row_weight, offsets, True)
    del da, h
    w1q_t, w1s_t = w1q.transposed_contiguous()  # [E, H, 2I]: FC1 dgrad contracts over 2I
    dxs = lib.fp8_expert_gemm(dh_q, dh_scale, w1q_t, w1s_t, offsets)
    del dh_q, dh_scale, w1q_t, w1s_t
    # Weight gradients: both operands re-quantised from bf16 in 128x1 tiles along each expert's rows.
    dy_t, dy_t_scale = lib.quantize_fp8_128x1(_tile_rows(dy_rows), True, True, offsets)
    aw_t, aw_t_scale = lib.quantize_fp8_128x1(_tile_rows(aw), True, True, offsets)
    del dy_rows, aw
    dw2 = _fp8_wgrad(dy_t, dy_t_scale, aw_t, aw_t_scale, offsets, counts, w2, main_grads[1])  # [E, H, I]
    del dy_t, dy_t_scale, aw_t, aw_t_scale
    dh_t, dh_t_scale = lib.quantize_fp8_128x1(_tile_rows(dh), True, True, offsets)
    del dh
    xs_t, xs_t_scale = lib.quantize_fp8_128x1(_tile_rows(xs), True, True, offsets)
    del xs
    dw1 = _fp8_wgrad(dh_t, dh_t_scale, xs_t, xs_t_scale, offsets, counts, w1, main_grads[0])  # [E, 2I, H]
    return dxs, dw1, dw2, dot


def _fp8_wgrad(a_t, a_scale, b_t, b_scale, offsets, counts, w, main_grad):
    """The FP8 weight gradient in ``w``'s dtype (rounded to bf16 by the GEMM for bf16 weights: no fp32 copy of a
    weight's size), or None after the GEMM added it in fp32 into ``main_grad``."""
    if main_grad is not None:
        lib.fp8_expert_wgrad_accumulate(a_t, a_scale, b_t, b_scale, offsets, counts, main_grad)
        return None
    return lib.fp8_expert_wgrad(a_t, a_scale, b_t, b_scale, offsets, counts, w.dtype != torch.bfloat16).to(w.dtype)


def _check_fp8_layout(transport) -> None:
    if transport.row_align % FP8_ROW_ALIGN:
        raise ValueError(f"the FP8 composition needs a layout whose experts start at multiples of {FP8_ROW_ALIGN} "
                         f"rows, got the transport's row_align={transport.row_align}")


# ---------------------------------------------------------------- the transports


class LocalTransport:
    """All experts on this device: ``dispatch_layout`` over all E experts + ``gather_rows`` in,
    ``combine_reduce`` out. Also the interface a transport gives the composition:

    - ``idle``: nothing is routed and no peer waits on this rank: the composition returns zeros;
    - ``row_align``: each expert's rows start at a multiple of it (the engine needs ``ROW_ALIGN``'s);
    - ``zero_fc1_out_tail``: zero the rows of ``fc1_out`` past the routed ones (it leaves the layer);
    - ``dispatch(src, topk_weights, wait=)`` -> ``(rows, expert_counts, expert_offsets)``: ``src``'s rows
      (``x`` or ``dy``) in expert-major order; ``rows_ready()``: the GEMMs' wait hook (or None); ``overlap_sms``:
      with the hook, the first GEMM runs alongside a dispatch that does not wait, which holds that many SMs (0:
      after one that does);
    - ``row_weight(topk_weights)``: each row's routing weight, fp32, 0 on padding rows;
    - ``combine(rows, row_scalars=None, published=False)`` -> ``(out [T, H], slot scalars fp32 [T, K] or
      None)``, also in two halves, ``combine_start(...)`` then ``combine_finish()``; ``results_done()``: where
      the GEMM that makes ``rows`` publishes them for a combine started right after it (``expert_gemm``'s
      ``done_*``; None: no overlap), which ``published=True`` says;
    - ``save_rows(rows)``: what the forward keeps of its rows for the backward (None: nothing), and
      ``backward_rows(source)``: the forward's rows again, from ``x`` (here) or from what was kept;
    - ``relayout(rows, row_align)``: rows of this routing's layout at another alignment (the kept ``fc1_out`` of
      a forward that ran at ``row_align``) moved into this one.
    """

    zero_fc1_out_tail = True  # moe_forward returns fc1_out: no row of it is left undefined
    overlap_sms = 0

    def __init__(self, topk_idx, num_experts, row_align=ROW_ALIGN):
        self.topk_idx, self.num_experts = topk_idx, num_experts
        self.top_k = topk_idx.shape[1]
        self.row_align = row_align
        self.counts, self.offsets, self.slot_to_row, self.row_to_slot = lib.dispatch_layout(
            topk_idx, num_experts, 0, num_experts, row_align)
        self.idle = topk_idx.numel() == 0
        self.num_rows = self.row_to_slot.numel()

    def dispatch(self, src, topk_weights=None, *, wait=True):
        # The gather also stops at the routed rows (expert_offsets): the rows past them stay undefined.
        rows = lib.gather_rows(src, self.row_to_slot, self.top_k, None, self.slot_to_row, self.offsets)
        return rows, self.counts, self.offsets

    def rows_ready(self):
        return None

    def row_weight(self, topk_weights):
        return lib.gather_scalars(topk_weights.reshape(-1), self.row_to_slot)

    def combine(self, rows, row_scalars=None, published=False):
        scalars = None if row_scalars is None else lib.gather_scalars(row_scalars, self.slot_to_row)
        return lib.combine_reduce(rows, self.slot_to_row, None), scalars

    def results_done(self):
        return None

    def combine_start(self, rows, row_scalars=None, published=False):
        self._combined = (rows, row_scalars)

    def combine_finish(self):
        rows, row_scalars = self._combined
        del self._combined
        return self.combine(rows, row_scalars)

    def save_rows(self, rows):
        return None  # the backward gathers x again: the rows are K times x

    def backward_rows(self, x):
        return self.dispatch(x)[0]

    def relayout(self, rows, row_align):
        """``rows`` [R', C] in the layout of the same routing at ``row_align`` -> this layout [R, C]: each routed
        row moved to its slot's row here, zeros on padding rows, the rows past the routed ones left undefined.
        Without a host sync: the row map ``this row -> slot -> row there`` is built on the device and the move is
        ``gather_rows`` with one "slot" per source row (top_k = 1)."""
        if row_align == self.row_align:
            return rows
        E = self.num_experts
        slot_to_row_there = lib.dispatch_layout(self.topk_idx, E, 0, E, row_align)[2].reshape(-1)
        slot = self.row_to_slot.long()
        source_row = torch.where(slot >= 0, slot_to_row_there.index_select(0, slot.clamp_min(0)), -1)
        return lib.gather_rows(rows, source_row.to(torch.int32), 1, None, None, self.offsets)


# ---------------------------------------------------------------- the composition


def _use_engine(engine, x, w1, transport) -> bool:
    """``engine``: None, where the engine covers the problem; False: ``torch._grouped_mm`` (tests);
    True: the engine's ops (the CPU tests run them through their CPU kernels)."""
    if engine is None:
        return engine_supports(x, w1) and transport.row_align % ROW_ALIGN == 0
    return engine


def forward(transport, x, topk_weights, w1, w2, *, keep_fc1=True, save_rows=False, engine=None, precision="bf16"):
    """The layer's forward: ``(y [T, H], fc1_out, saved)``, ``saved`` = ``transport.save_rows`` of the
    dispatched rows when ``save_rows`` (else None), for ``backward``'s ``source``. ``precision`` "fp8": the FP8
    forward (``engine`` does not apply; the transport's layout must be 128-aligned); "bf16" and "fp8_bwd": the
    bf16 forward."""
    if precision == "fp8":
        return _fp8_forward(transport, x, topk_weights, w1, w2, keep_fc1=keep_fc1, save_rows=save_rows)
    engine = _use_engine(engine, x, w1, transport)
    if transport.idle:
        return x.new_zeros(x.shape), x.new_zeros(transport.num_rows if keep_fc1 else 0, w1.shape[1]), None
    # Overlapped (the engine): the dispatch does not wait, and FC1's producer waits for each expert's rows itself
    # (the arrival counters), so its tiles start as soon as their expert's rows have landed.
    overlap_sms = transport.overlap_sms if engine else 0
    xs, _, offsets = transport.dispatch(x, topk_weights, wait=not overlap_sms)
    a, h = expert_fc1(xs, w1, offsets, keep_fc1, engine, transport.rows_ready() if engine else None, overlap_sms)
    if keep_fc1 and transport.zero_fc1_out_tail:
        lib.zero_unrouted_rows(h, offsets)
    # Overlapped: FC2 publishes its row blocks and the combine, started right after it, sends them as they come.
    done = transport.results_done() if engine else None
    o = expert_fc2(a, w2, offsets, transport.row_weight(topk_weights), engine, done)
    y, _ = transport.combine(o, published=done is not None)
    return y, h, (transport.save_rows(xs) if save_rows else None)


def _fp8_forward(transport, x, topk_weights, w1, w2, *, keep_fc1, save_rows):
    _check_fp8_layout(transport)
    if transport.idle:
        return x.new_zeros(x.shape), x.new_zeros(transport.num_rows if keep_fc1 else 0, w1.shape[1]), None
    # The FP8 GEMMs have no rows-ready hook: the dispatch waits for the rows itself.
    xs, _, offsets = transport.dispatch(x, topk_weights, wait=True)
    h = fp8_fc1(xs, w1, offsets)
    if keep_fc1 and transport.zero_fc1_out_tail:
        lib.zero_unrouted_rows(h, offsets)
    o = fp8_fc2(h, w2, offsets, transport.row_weight(topk_weights))
    y, _ = transport.combine(o)
    fc1_out = h if keep_fc1 else x.new_empty(0, w1.shape[1])
    return y, fc1_out, (transport.save_rows(xs) if save_rows else None)


def backward(transport, dy, source, topk_weights, w1, w2, fc1_out, *, engine=None, precision="bf16",
             fc1_row_align=None, main_grads=(None, None)):
    """The layer's backward: ``(dx, d_topk_weights fp32, dw1, dw2)``. ``source``: ``x`` (local) or the
    forward's ``saved`` (Buffer); ``fc1_out``: the forward's (None or empty: FC1 is recomputed).
    ``precision`` "fp8" / "fp8_bwd": the FP8 backward (the transport's layout must be 128-aligned; the
    recomputed FC1 is the forward's: FP8 for "fp8", bf16 for "fp8_bwd"); ``fc1_row_align``: the alignment of the
    layout ``fc1_out`` is in (None: the transport's), moved into the transport's layout when it differs.
    ``main_grads``: ``expert_backward``'s (a weight with one gets None for its gradient)."""
    if precision in FP8_PRECISIONS:
        return _fp8_backward(transport, dy, source, topk_weights, w1, w2, fc1_out, engine=engine,
                             precision=precision, fc1_row_align=fc1_row_align, main_grads=main_grads)
    engine = _use_engine(engine, dy, w1, transport)
    if transport.idle:
        T, K = topk_weights.shape
        return _idle_backward(dy, T, K, w1, w2, main_grads)
    # The local layout and rows are rebuilt, not kept from the forward: the rows are K times x.
    xs = transport.backward_rows(source)
    h = fc1_out if fc1_out is not None and fc1_out.numel() else None
    # Overlapped (the engine, h kept): FC2's dgrad runs alongside dy's dispatch. With FC1 recomputed, that GEMM
    # comes between them.
    overlap_sms = transport.overlap_sms if engine and h is not None else 0
    # Same routing as the forward, hence the same layout: dy's rows line up with xs and h.
    dy_rows, counts, offsets = transport.dispatch(dy.contiguous(), topk_weights, wait=not overlap_sms)
    row_weight = transport.row_weight(topk_weights)
    rows_ready = transport.rows_ready() if engine else None
    # Overlapped: FC1's dgrad publishes dx's rows and the combine, started right after it, runs alongside it.
    # Its sending starts right after FC1's dgrad, beside it; without that overlap the whole combine comes after dw1,
    # which then does not wait for the slowest peer.
    done = transport.results_done() if engine else None
    start = None if done is None else (lambda dxs, dtw_rows: transport.combine_start(dxs, dtw_rows, published=True))
    operands = [xs, h, dy_rows]
    del xs, h, dy_rows  # expert_backward drops each after its last use
    dxs, dw1, dw2, dtw_rows = expert_backward(operands, row_weight, w1, w2, offsets, counts, engine, rows_ready,
                                              overlap_sms, done, start, main_grads)
    if done is None:
        transport.combine_start(dxs, dtw_rows)
    dx, d_topk_weights = transport.combine_finish()
    return dx, d_topk_weights, dw1, dw2


def _idle_backward(dy, T, K, w1, w2, main_grads):
    """Nothing routed: zero gradients (a main gradient gains nothing: None)."""
    dws = [None if main_grad is not None else torch.zeros_like(w) for w, main_grad in zip((w1, w2), main_grads)]
    return (dy.new_zeros(dy.shape), torch.zeros(T, K, dtype=torch.float32, device=dy.device), *dws)


def _fp8_backward(transport, dy, source, topk_weights, w1, w2, fc1_out, *, engine, precision, fc1_row_align,
                  main_grads):
    _check_fp8_layout(transport)
    if transport.idle:
        T, K = topk_weights.shape
        return _idle_backward(dy, T, K, w1, w2, main_grads)
    xs = transport.backward_rows(source)
    dy_rows, counts, offsets = transport.dispatch(dy.contiguous(), topk_weights)
    row_weight = transport.row_weight(topk_weights)
    if fc1_out is not None and fc1_out.numel():
        align = transport.row_align if fc1_row_align is None else fc1_row_align
        h = transport.relayout(fc1_out, align)
    elif precision == "fp8":
        h = fp8_fc1(xs, w1, offsets)
    elif _use_engine(engine, dy, w1, transport):  # fp8_bwd: the bf16 forward's pre-activations
        h = lib.expert_gemm(xs, w1, offsets, False, zero_unrouted=False)
    else:
        h = torch._grouped_mm(xs, w1.transpose(1, 2), offs=offsets[1:])  # _fallback.fc1's h
    operands = [xs, h, dy_rows]
    del xs, h, dy_rows  # fp8_expert_backward drops each after its last use
    dxs, dw1, dw2, dtw_rows = fp8_expert_backward(operands, row_weight, w1, w2, offsets, counts, main_grads)
    dx, d_topk_weights = transport.combine(dxs, dtw_rows)
    return dx, d_topk_weights, dw1, dw2


# ---------------------------------------------------------------- the buffer= path's ops
# Schemas in csrc/binding/registrar.cpp.


def _ep_moe_forward(x, topk_idx, topk_weights, w1, w2, buffer, precision="bf16", keep_fc1=True, save_rows=True):
    """``(y, fc1_out, saved_rows)`` over the Buffer whose handle is ``buffer``; ``saved_rows`` [0, H]
    unless ``save_rows`` (no backward follows)."""
    check_precision(precision)
    transport = BufferTransport(lookup_buffer(buffer), topk_idx)
    y, fc1_out, saved = forward(transport, x, topk_weights, w1, w2, keep_fc1=keep_fc1, save_rows=save_rows,
                                precision=precision)
    return y, fc1_out, (x.new_empty(0, x.shape[1]) if saved is None else saved)


def _ep_moe_backward(dy, x, topk_idx, topk_weights, w1, w2, fc1_out, saved_rows, buffer, precision="bf16",
                     w1_main_grad=None, w2_main_grad=None):
    check_precision(precision)
    main_grads = check_main_grads((w1, w2), (w1_main_grad, w2_main_grad))
    transport = BufferTransport(lookup_buffer(buffer), topk_idx)
    dx, dtw, dw1, dw2 = backward(transport, dy, (x, saved_rows), topk_weights, w1, w2, fc1_out, precision=precision,
                                 main_grads=main_grads)
    return (dx, dtw, *weight_grad_outputs((dw1, dw2), (w1, w2), main_grads))


@torch.library.register_fake("primemoe::_ep_moe_forward")
def _ep_moe_forward_fake(x, topk_idx, topk_weights, w1, w2, buffer, precision="bf16", keep_fc1=True,
                         save_rows=True):
    buf = lookup_buffer(buffer)
    rows = buf.region("recv_rows").shape[0]  # the receive layout's worst case
    saved = rows if save_rows and buf.world > 1 else 0  # BufferTransport.save_rows
    return (x.new_empty(x.shape), x.new_empty(rows if keep_fc1 else 0, w1.shape[1]), x.new_empty(saved, x.shape[1]))


@torch.library.register_fake("primemoe::_ep_moe_backward")
def _ep_moe_backward_fake(dy, x, topk_idx, topk_weights, w1, w2, fc1_out, saved_rows, buffer, precision="bf16",
                          w1_main_grad=None, w2_main_grad=None):
    return (dy.new_empty(dy.shape), topk_weights.new_empty(topk_weights.shape, dtype=torch.float32),
            *weight_grad_outputs((w1.new_empty(w1.shape), w2.new_empty(w2.shape)), (w1, w2),
                                 (w1_main_grad, w2_main_grad)))


# Plain calls (the decorator form returns None): the functions stay importable. The CPU kernels run
# the same composition over a CPU model of the Buffer (tests/test_ep_cpu.py).
for _device in ("cpu", "cuda"):
    torch.library.impl("primemoe::_ep_moe_forward", _device, _ep_moe_forward)
    torch.library.impl("primemoe::_ep_moe_backward", _device, _ep_moe_backward)


def _ep_setup_context(ctx, inputs, output):
    x, topk_idx, topk_weights, w1, w2, buffer, precision, keep_fc1, save_rows = inputs
    _, fc1_out, saved_rows = output
    ctx.set_materialize_grads(False)  # only y has a gradient: no zeros are made for the other outputs
    ctx.buffer, ctx.precision, ctx.weights_dtype = buffer, precision, topk_weights.dtype
    # x: with one rank the backward gathers its rows again instead of keeping them (BufferTransport.save_rows).
    ctx.save_for_backward(x, topk_idx, topk_weights, w1, w2, fc1_out if keep_fc1 else None, saved_rows)
    ctx.main_grads = MainGrads.of(w1, w2)


def _ep_backward(ctx, dy, _d_fc1_out, _d_saved_rows):
    x, topk_idx, topk_weights, w1, w2, fc1_out, saved_rows = ctx.saved_tensors
    if dy is None:  # every rank still takes part in the backward's dispatch and combine
        dy = w1.new_zeros(topk_idx.shape[0], w1.shape[2])
    dx, dtw, dw1, dw2 = lib._ep_moe_backward(dy.contiguous(), x, topk_idx, topk_weights, w1, w2, fc1_out,
                                             saved_rows, ctx.buffer, ctx.precision, *ctx.main_grads.tensors)
    dw1, dw2 = ctx.main_grads.weight_grads(dw1, dw2)
    return dx, None, dtw.to(ctx.weights_dtype), dw1, dw2, None, None, None, None


torch.library.register_autograd("primemoe::_ep_moe_forward", _ep_backward, setup_context=_ep_setup_context)
