"""``primemoe.moe(..., buffer=buf)``: expert parallelism over the NVSHMEM workspace of a Buffer.

Forward: ``ep_dispatch`` writes every routed row into its expert's rank, in expert-major
order (``recv_rows``, each expert's range padded with zero rows to ``buffer.row_align``);
the local experts run on the expert GEMM engine over that region (``torch._grouped_mm``
where the engine does not apply: see ``ops.use_engine`` and ``row_align``), FC2 applying
each row's routing weight; ``ep_combine`` pushes each result row back to its source slot
(``combine_rows``) and the deterministic ``combine_reduce`` kernel sums a token's K slots. Backward dispatches
``dy`` with the same routing, so it lands in the same receive layout as ``x`` did, and
combines the row gradients (plus the routing-weight gradients as per-row scalars) back.

Every rank takes part in every dispatch and combine, whatever its token count: they
are collective. Nothing reads routing data on the host, so a step can be captured in
a CUDA graph.
"""

from __future__ import annotations

import torch

from ._validate import check_moe_inputs
from .ops import ROW_ALIGN, expert_backward, expert_fc1, expert_fc2, use_engine

lib = torch.ops.primemoe


def check_buffer_problem(shape, device, precision, buffer) -> None:
    """The problem (``MoeShape`` from ``check_moe_inputs``) must be the one ``buffer`` was made for."""
    if buffer.closed:
        raise RuntimeError("buffer: this primemoe.Buffer is closed")
    if precision != buffer.precision:
        raise ValueError(f"precision: got {precision!r}, but the buffer was created with "
                         f"precision={buffer.precision!r}")
    if device != buffer.device:
        raise ValueError(f"x: expected a tensor on the buffer's device {buffer.device}, got {device}")
    if shape.hidden != buffer.hidden:
        raise ValueError(f"x: hidden size H={shape.hidden} does not match the buffer's hidden={buffer.hidden}")
    if shape.intermediate != buffer.intermediate:
        raise ValueError(f"w1: intermediate size I={shape.intermediate} does not match the buffer's "
                         f"intermediate={buffer.intermediate}")
    if shape.top_k != buffer.top_k:
        raise ValueError(f"topk_idx: {shape.top_k} slots per token do not match the buffer's top_k={buffer.top_k}")
    if shape.local_experts != buffer.local_experts:
        raise ValueError(f"w1: expected this rank's {buffer.local_experts} experts (num_experts={buffer.num_experts} "
                         f"over {buffer.world} ranks), got {shape.local_experts}")


def moe(x, topk_idx, topk_weights, w1, w2, *, buffer, precision="bf16", keep_fc1=True):
    """See ``primemoe.moe``: w1, w2 hold this rank's ``buffer.local_experts`` experts; ids in
    ``topk_idx`` are global (expert ``g`` lives on rank ``g // local_experts``)."""
    shape = check_moe_inputs(x, topk_idx, topk_weights, w1, w2, precision=precision, num_ranks=buffer.world,
                             max_tokens=buffer.max_tokens_per_rank)
    check_buffer_problem(shape, x.device, precision, buffer)
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weights, w1, w2))
    return _ExpertParallelMoE.apply(x, topk_idx, topk_weights, w1, w2, buffer, keep_fc1, wants_grad)


def _slot_map(slot_valid: torch.Tensor) -> torch.Tensor:
    """int32 [T, K]: the slot's own index into ``combine_rows``, -1 for slots that were not routed."""
    slots = torch.arange(slot_valid.numel(), dtype=torch.int32, device=slot_valid.device).view(slot_valid.shape)
    return torch.where(slot_valid, slots, -1)


class _ExpertParallelMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, w1, w2, buffer, keep_fc1, wants_grad):
        T, K = topk_idx.shape
        engine = use_engine(x, w1) and buffer.row_align % ROW_ALIGN == 0
        # With the engine, FC1's producer waits for each expert's rows itself (the arrival counters),
        # so its tiles start as soon as their expert's rows have landed.
        _, offsets, slot_valid = buffer.dispatch(x, topk_idx, topk_weights, wait=not engine)
        xs = buffer.region("recv_rows")
        # The receive region is sized for the worst case and only its routed rows are read downstream:
        # the GEMMs leave the rows past them unwritten (zero_unrouted=False) instead of zeroing them.
        a, h = expert_fc1(xs, w1, offsets, keep_fc1, engine, buffer.rows_ready() if engine else None,
                          zero_unrouted=False)
        # Read by FC2, after FC1 has waited for every expert's rows: their weights have landed too.
        # Padding rows have weight 0 (the dispatch writes it); rows past the last expert are never sent back.
        o = expert_fc2(a, w2, offsets, buffer.region("recv_weights"), engine, zero_unrouted=False)
        buffer.combine(o, offsets)
        y = lib.combine_reduce(buffer.region("combine_rows")[:T * K], _slot_map(slot_valid), None)
        if wants_grad:
            ctx.buffer = buffer
            ctx.engine = engine
            # The next dispatch (of any layer sharing the buffer) overwrites the receive region. Only the
            # routed rows [0, offsets[-1]) are copied: the backward reads no row past them.
            xs_routed = lib.copy_routed_rows(xs, offsets)
            ctx.save_for_backward(xs_routed, h if keep_fc1 else None, topk_idx, topk_weights, w1, w2)
        return y

    @staticmethod
    def backward(ctx, dy):
        xs, h, topk_idx, topk_weights, w1, w2 = ctx.saved_tensors
        buffer = ctx.buffer
        T, K = topk_idx.shape
        # Same routing as the forward, hence the same receive layout: dy's rows line up with xs and h.
        # The views below are read before this rank's next dispatch, and no rank writes into this
        # rank's receive region before that dispatch has exchanged its counts: no copies needed.
        counts, offsets, slot_valid = buffer.dispatch(dy.contiguous(), topk_idx, topk_weights)
        dy_rows = buffer.region("recv_rows")
        row_weight = buffer.region("recv_weights")
        # dtw_rows: one fp32 dot per received row, sent back to its slot as the routing-weight gradient.
        dxs, dw1, dw2, dtw_rows = expert_backward(xs, h, dy_rows, row_weight, w1, w2, offsets, counts, ctx.engine,
                                                  zero_unrouted=False)
        buffer.combine(dxs, offsets, dtw_rows)
        dx = lib.combine_reduce(buffer.region("combine_rows")[:T * K], _slot_map(slot_valid), None)
        d_topk_weights = torch.where(slot_valid, buffer.region("combine_scalars")[:T * K].view(T, K), 0.0)
        return dx, None, d_topk_weights.to(topk_weights.dtype), dw1, dw2, None, None, None
