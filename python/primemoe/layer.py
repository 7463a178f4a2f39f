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

``fc1_out`` is ``[rows, 2I]`` in the transport's row order; ``moe_forward``'s is the layout of
``dispatch_layout(topk_idx, E, 0, E, ROW_ALIGN)``: experts in order, each expert's slots in slot
order, each expert's range padded with zero rows to a multiple of ``ROW_ALIGN`` (the GEMM tile
height), rows past the padded total zeros. Kept by default (``keep_fc1=True``): the backward then
skips a third of the forward's FLOPs for 2·I·2 bytes per row; ``keep_fc1=False`` recomputes FC1 in
the backward to save that memory.
"""

from __future__ import annotations

import functools

import torch

from . import _C  # noqa: F401  (loads the library that defines the schemas)
from . import _fallback
from ._constants import ROW_ALIGN
from ._validate import check_moe_inputs, check_precision
from .buffer import Buffer
from .ep import BufferTransport, check_buffer_problem, lookup_buffer

__all__ = ["moe", "ep_moe", "forward", "backward", "LocalTransport", "engine_supports", "ROW_ALIGN"]

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


def expert_fc1(xs, w1, offsets, keep_fc1, engine, rows_ready=None):
    """FC1 + SwiGLU per expert over the expert-major rows: ``(a, h or an empty [0, 2I])``.
    ``rows_ready`` (engine only): ``(counters, epoch, per_epoch, rank)``: FC1's producer waits for
    ``counters[e] >= epoch * per_epoch`` before it loads expert ``e``'s rows. Rows past
    ``offsets[-1]`` of the outputs are left undefined (here and below)."""
    if engine:
        return lib.fc1_swiglu(xs, w1, offsets, keep_fc1, *(rows_ready or ()), zero_unrouted=False)
    return _fallback.fc1(xs, w1, offsets, keep_fc1)


def expert_fc2(a, w2, offsets, row_weight, engine):
    """``row_weight * FC2(a)`` per expert: the routing weight is applied here (in the engine's
    epilogue), so the combine only sums a token's rows."""
    if engine:
        return lib.expert_gemm(a, w2, offsets, False, row_weight, zero_unrouted=False)
    return _fallback.fc2(a, w2, offsets, row_weight)


def expert_backward(xs, h, dy_rows, row_weight, w1, w2, offsets, counts, engine):
    """Backward of ``row_weight * FC2(swiglu(FC1(xs)))`` in the expert-major row space, given the
    *unweighted* ``dy_rows`` and the kept pre-activations ``h`` (None: recomputed); ``counts``: the
    layout's routed rows per expert (the engine's weight gradients skip the padding with them). Returns
    ``(dxs, dw1, dw2, dtw_rows)``; ``dtw_rows[r] = <dy_r, FC2 output_r>`` = ``<da_r, a_r>``
    (unweighted), the routing-weight gradient of the row, so FC2's output need not be kept.
    Reads no row of ``xs`` past ``offsets[-1]`` (the Buffer path saves only those): the engine skips
    tiles past the routed rows, ``torch._grouped_mm`` reads only the rows inside its groups."""
    if not engine:
        return _fallback.expert_backward(xs, h, dy_rows, row_weight, w1, w2, offsets)
    if h is None:  # the pre-activations only: FC1 without its SwiGLU epilogue
        h = lib.expert_gemm(xs, w1, offsets, False, zero_unrouted=False)
    dh, aw, dot = lib.fc2_dgrad_swiglu(dy_rows, w2, h, row_weight, offsets, zero_unrouted=False)
    dw2 = lib.expert_wgrad(dy_rows, aw, offsets, counts)
    dxs = lib.expert_gemm(dh, w1, offsets, True, zero_unrouted=False)
    dw1 = lib.expert_wgrad(dh, xs, offsets, counts)
    # The rows past offsets[-1] of dot are undefined, and so are their sums; nobody reads those rows.
    return dxs, dw1, dw2, dot.sum(1)


# ---------------------------------------------------------------- the transports


class LocalTransport:
    """All experts on this device: ``dispatch_layout`` over all E experts + ``gather_rows`` in,
    ``combine_reduce`` out. Also the interface a transport gives the composition:

    - ``idle``: nothing is routed and no peer waits on this rank: the composition returns zeros;
    - ``row_align``: each expert's rows start at a multiple of it (the engine needs ``ROW_ALIGN``'s);
    - ``zero_fc1_out_tail``: zero the rows of ``fc1_out`` past the routed ones (it leaves the layer);
    - ``dispatch(src, topk_weights, wait=)`` -> ``(rows, expert_counts, expert_offsets)``: ``src``'s rows
      (``x`` or ``dy``) in expert-major order; ``rows_ready()``: FC1's wait hook (or None);
    - ``row_weight(topk_weights)``: each row's routing weight, fp32, 0 on padding rows;
    - ``combine(rows, row_scalars=None)`` -> ``(out [T, H], slot scalars fp32 [T, K] or None)``;
    - ``save_rows(rows)``: what the forward keeps of its rows for the backward (None: nothing), and
      ``backward_rows(source)``: the forward's rows again, from ``x`` (here) or from what was kept.
    """

    zero_fc1_out_tail = True  # moe_forward returns fc1_out: no row of it is left undefined

    def __init__(self, topk_idx, num_experts, row_align=ROW_ALIGN):
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

    def combine(self, rows, row_scalars=None):
        scalars = None if row_scalars is None else lib.gather_scalars(row_scalars, self.slot_to_row)
        return lib.combine_reduce(rows, self.slot_to_row, None), scalars

    def save_rows(self, rows):
        return None  # the backward gathers x again: the rows are K times x

    def backward_rows(self, x):
        return self.dispatch(x)[0]


# ---------------------------------------------------------------- the composition


def _use_engine(engine, x, w1, transport) -> bool:
    """``engine``: None, where the engine covers the problem; False: ``torch._grouped_mm`` (tests);
    True: the engine's ops (the CPU tests run them through their CPU kernels)."""
    if engine is None:
        return engine_supports(x, w1) and transport.row_align % ROW_ALIGN == 0
    return engine


def forward(transport, x, topk_weights, w1, w2, *, keep_fc1=True, save_rows=False, engine=None):
    """The layer's forward: ``(y [T, H], fc1_out, saved)``, ``saved`` = ``transport.save_rows`` of the
    dispatched rows when ``save_rows`` (else None), for ``backward``'s ``source``."""
    engine = _use_engine(engine, x, w1, transport)
    if transport.idle:
        return x.new_zeros(x.shape), x.new_zeros(transport.num_rows if keep_fc1 else 0, w1.shape[1]), None
    # wait=False with the engine: FC1's producer waits for each expert's rows itself (the arrival
    # counters), so its tiles start as soon as their expert's rows have landed.
    xs, _, offsets = transport.dispatch(x, topk_weights, wait=not engine)
    a, h = expert_fc1(xs, w1, offsets, keep_fc1, engine, transport.rows_ready() if engine else None)
    if keep_fc1 and transport.zero_fc1_out_tail:
        lib.zero_unrouted_rows(h, offsets)
    o = expert_fc2(a, w2, offsets, transport.row_weight(topk_weights), engine)
    y, _ = transport.combine(o)
    return y, h, (transport.save_rows(xs) if save_rows else None)


def backward(transport, dy, source, topk_weights, w1, w2, fc1_out, *, engine=None):
    """The layer's backward: ``(dx, d_topk_weights fp32, dw1, dw2)``. ``source``: ``x`` (local) or the
    forward's ``saved`` (Buffer); ``fc1_out``: the forward's (None or empty: FC1 is recomputed)."""
    engine = _use_engine(engine, dy, w1, transport)
    if transport.idle:
        T, K = topk_weights.shape
        return (dy.new_zeros(dy.shape), torch.zeros(T, K, dtype=torch.float32, device=dy.device),
                torch.zeros_like(w1), torch.zeros_like(w2))
    # The local layout and rows are rebuilt, not kept from the forward: the rows are K times x.
    xs = transport.backward_rows(source)
    h = fc1_out if fc1_out is not None and fc1_out.numel() else None
    # Same routing as the forward, hence the same layout: dy's rows line up with xs and h.
    dy_rows, counts, offsets = transport.dispatch(dy.contiguous(), topk_weights)
    row_weight = transport.row_weight(topk_weights)
    dxs, dw1, dw2, dtw_rows = expert_backward(xs, h, dy_rows, row_weight, w1, w2, offsets, counts, engine)
    dx, d_topk_weights = transport.combine(dxs, dtw_rows)
    return dx, d_topk_weights, dw1, dw2


# ---------------------------------------------------------------- the buffer= path's ops
# Schemas in csrc/binding/registrar.cpp.


def _ep_moe_forward(x, topk_idx, topk_weights, w1, w2, buffer, precision="bf16", keep_fc1=True, save_rows=True):
    """``(y, fc1_out, saved_rows)`` over the Buffer whose handle is ``buffer``; ``saved_rows`` [0, H]
    unless ``save_rows`` (no backward follows)."""
    check_precision(precision)
    transport = BufferTransport(lookup_buffer(buffer), topk_idx)
    y, fc1_out, saved = forward(transport, x, topk_weights, w1, w2, keep_fc1=keep_fc1, save_rows=save_rows)
    return y, fc1_out, (x.new_empty(0, x.shape[1]) if saved is None else saved)


def _ep_moe_backward(dy, topk_idx, topk_weights, w1, w2, fc1_out, saved_rows, buffer, precision="bf16"):
    check_precision(precision)
    transport = BufferTransport(lookup_buffer(buffer), topk_idx)
    return backward(transport, dy, saved_rows, topk_weights, w1, w2, fc1_out)


@torch.library.register_fake("primemoe::_ep_moe_forward")
def _ep_moe_forward_fake(x, topk_idx, topk_weights, w1, w2, buffer, precision="bf16", keep_fc1=True,
                         save_rows=True):
    rows = lookup_buffer(buffer).region("recv_rows").shape[0]  # the receive layout's worst case
    return (x.new_empty(x.shape), x.new_empty(rows if keep_fc1 else 0, w1.shape[1]),
            x.new_empty(rows if save_rows else 0, x.shape[1]))


@torch.library.register_fake("primemoe::_ep_moe_backward")
def _ep_moe_backward_fake(dy, topk_idx, topk_weights, w1, w2, fc1_out, saved_rows, buffer, precision="bf16"):
    return (dy.new_empty(dy.shape), topk_weights.new_empty(topk_weights.shape, dtype=torch.float32),
            w1.new_empty(w1.shape), w2.new_empty(w2.shape))


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
    ctx.save_for_backward(topk_idx, topk_weights, w1, w2, fc1_out if keep_fc1 else None, saved_rows)


def _ep_backward(ctx, dy, _d_fc1_out, _d_saved_rows):
    topk_idx, topk_weights, w1, w2, fc1_out, saved_rows = ctx.saved_tensors
    if dy is None:  # every rank still takes part in the backward's dispatch and combine
        dy = w1.new_zeros(topk_idx.shape[0], w1.shape[2])
    dx, dtw, dw1, dw2 = lib._ep_moe_backward(dy.contiguous(), topk_idx, topk_weights, w1, w2, fc1_out, saved_rows,
                                             ctx.buffer, ctx.precision)
    return dx, None, dtw.to(ctx.weights_dtype), dw1, dw2, None, None, None, None


torch.library.register_autograd("primemoe::_ep_moe_forward", _ep_backward, setup_context=_ep_setup_context)
