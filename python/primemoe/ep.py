"""The transport of ``primemoe.moe(..., buffer=buf)``: the NVSHMEM workspace of a ``primemoe.Buffer``.

``BufferTransport`` is what the layer's composition (layer.py) sees of a Buffer. Its dispatch
(``ep_dispatch``) writes every routed row into its expert's rank, in expert-major order
(``recv_rows``, each expert's range padded with zero rows to ``buffer.row_align``, weight 0 on
padding rows in ``recv_weights``); its combine (``ep_combine``) pushes each result row back to its
source slot (``combine_rows``), but for the rows of this rank's own slots, which stay where they are,
and the deterministic ``combine_reduce`` kernel sums a token's K slots by the map the dispatch wrote
(``combine_map``). The backward dispatches ``dy`` with the same routing, so it lands in the same receive layout
as ``x`` did, and combines the row gradients (plus the routing-weight gradients as per-row scalars)
back.

Every rank takes part in every dispatch and combine, whatever its token count: they are
collective. Nothing reads routing data on the host, so a step can be captured in a CUDA graph.

The layer's ops take a Buffer by its ``handle`` (an int: custom ops take no Python objects);
``register_buffer`` / ``lookup_buffer`` keep the handles of this process's open buffers.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Dict

import torch

from . import _C  # noqa: F401  (loads the library that defines the schemas)

__all__ = ["BufferTransport", "check_buffer_problem", "register_buffer", "unregister_buffer", "lookup_buffer"]

lib = torch.ops.primemoe

_handles: Dict[int, "weakref.ref"] = {}
_next_handle = itertools.count(1)


def register_buffer(buffer) -> int:
    """A new handle for ``buffer`` (anything with primemoe.Buffer's interface), for the layer's ops."""
    handle = next(_next_handle)
    _handles[handle] = weakref.ref(buffer)
    return handle


def unregister_buffer(handle: int) -> None:
    _handles.pop(handle, None)


def lookup_buffer(handle: int):
    """The open buffer ``handle`` names; a clear error for a closed or unknown one."""
    ref = _handles.get(handle)
    buffer = None if ref is None else ref()
    if buffer is None or buffer.closed:
        raise RuntimeError(f"buffer: no open primemoe.Buffer has handle {handle} in this process "
                           "(it was closed, or the handle is not one of Buffer.handle)")
    return buffer


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


class BufferTransport:
    """The Buffer's dispatch in, its combine + ``combine_reduce`` out (see the module docstring and
    ``layer.LocalTransport`` for the interface). One per forward or backward: it keeps the layout of
    its last dispatch."""

    # Collective: every rank takes part in the dispatch and the combine, even without tokens.
    idle = False
    # fc1_out stays between the layer's ops, which read only its routed rows: the rows past them are
    # left undefined (not zeroed).
    zero_fc1_out_tail = False

    def __init__(self, buffer, topk_idx):
        self.buffer, self.topk_idx = buffer, topk_idx
        self.row_align = buffer.row_align
        # The GEMM after a dispatch runs alongside it, which holds the Buffer's SMs (none: after it). With one rank
        # nothing travels: the dispatch is a local copy on every SM (memory-bound; beside FC1 it would only take
        # FC1's SMs) and the combine sends nothing (every slot is this rank's, read in place).
        self.local = buffer.world == 1
        self.overlap_sms = buffer.num_sms if buffer.overlap and not self.local else 0
        self.counts = self.offsets = self.slot_valid = None

    def dispatch(self, src, topk_weights, *, wait=True):
        """``(rows, expert_counts, expert_offsets)``: the receive region after ``src`` [T, H] was dispatched.
        ``wait=False``: the stream does not wait for the peers' rows (FC1 waits on ``rows_ready``).
        In the backward, the views are read before this rank's next dispatch, and no rank writes into this
        rank's receive region before that dispatch has exchanged its counts: no copies needed."""
        self.counts, self.offsets, self.slot_valid = self.buffer.dispatch(src, self.topk_idx, topk_weights, wait=wait,
                                                                          copy_rows=not self.local)
        # Held with the layout for the pass: the dispatch may still read them while the GEMM after it allocates.
        self.src, self.topk_weights = src, topk_weights
        if self.local:
            # One rank: the rows are copied token-major (each row of src read once, as the single-GPU layer's
            # gather) by the receive layout the dispatch wrote: recv_meta names each row's slot (-1: padding).
            T, K = self.topk_idx.shape
            slot_map = self.buffer.region("combine_map")[:T * K].view(T, K)  # -2 - row for every routed slot
            slot_to_row = torch.where(slot_map <= -2, -2 - slot_map, -1)
            rows = lib.gather_rows(src, self.buffer.region("recv_meta"), K, None, slot_to_row, self.offsets)
            return rows, self.counts, self.offsets
        # The receive region is sized for the worst case; only its routed rows are read downstream.
        return self.buffer.region("recv_rows"), self.counts, self.offsets

    def rows_ready(self):
        # One rank: the dispatch has waited for its rows, and the GEMM takes the single-GPU layer's schedule.
        return None if self.local else self.buffer.rows_ready()

    def row_weight(self, topk_weights):
        # Read after FC1, which has waited for every expert's rows: their weights have landed too.
        # Padding rows have weight 0 (the dispatch writes it).
        return self.buffer.region("recv_weights")

    def results_done(self):
        """Where the GEMM whose rows the next combine sends publishes them (``expert_gemm``'s ``done_*``):
        ``(flags, counts, epoch, sms)`` with ``Buffer.overlap_combine`` (the combine then runs alongside that
        GEMM on the Buffer's SMs), else None."""
        if not self.overlap_sms or not self.buffer.overlap_combine:
            return None
        b = self.buffer
        return b.region("result_flags"), b.region("result_counts"), b.epoch, self.overlap_sms

    def combine_start(self, rows, row_scalars=None, published=False):
        """Starts sending each received row of ``rows`` back (``published``: ``rows`` is being written by the
        GEMM launched just before, which publishes its row blocks; nothing may come between the two)."""
        self._combined = (rows, row_scalars)
        if not self.local:
            self.buffer.combine(rows, self.offsets, row_scalars, published=published, wait=False)

    def combine_finish(self):
        """``combine``'s result, after ``combine_start``."""
        rows, row_scalars = self._combined
        del self._combined
        if not self.local:
            self.buffer.combine(rows, self.offsets, row_scalars, send=False)  # until every peer has pushed ours back
        T, K = self.topk_idx.shape
        slot_map = self.buffer.region("combine_map")[:T * K].view(T, K)
        out = lib.combine_reduce(self.buffer.region("combine_rows")[:T * K], slot_map, None, rows)
        if row_scalars is None:
            return out, None
        if self.local:  # every routed slot's scalar is in row_scalars, at row -2 - map
            own = row_scalars.index_select(0, (-2 - slot_map).clamp_min(0).reshape(-1)).view(T, K)
            return out, torch.where(slot_map <= -2, own, 0.0)
        return out, torch.where(self.slot_valid, self.buffer.region("combine_scalars")[:T * K].view(T, K), 0.0)

    def combine(self, rows, row_scalars=None, published=False):
        """``(out [T, H], slot scalars fp32 [T, K] or None)``: each token's sum of its slots' rows, and
        each slot's scalar (0 for slots that were not routed). Rows past the last expert are never sent."""
        self.combine_start(rows, row_scalars, published)
        return self.combine_finish()

    def save_rows(self, rows):
        """What the backward needs of the forward's rows: the next dispatch (of any layer sharing the
        buffer) overwrites the receive region. Only the routed rows are copied: the backward reads no
        row past them. With one rank nothing is kept: every row came from this rank's ``x``, and the
        backward gathers them from it again (``backward_rows``)."""
        if self.buffer.world == 1:
            return rows.new_empty(0, rows.shape[1])
        return lib.copy_routed_rows(rows, self.offsets)

    def relayout(self, rows, row_align):
        """Every pass over a Buffer uses its one receive layout: ``fc1_out`` is already in it."""
        if row_align != self.row_align:
            raise ValueError(f"buffer: rows of a layout at row_align={row_align}, but this buffer's receive layout "
                             f"has row_align={self.row_align}")
        return rows

    def backward_rows(self, source):
        """The forward's rows in the backward's receive layout (the same routing gives the same layout), from
        ``source`` = ``(x, saved)``: the rows ``save_rows`` kept, or with one rank, ``x``'s rows gathered into
        the receive layout, which is then the local layout at the buffer's row alignment."""
        x, saved = source
        if saved is not None and saved.shape[0]:
            return saved
        if self.buffer.world != 1:
            raise RuntimeError("buffer: the forward kept no rows for a backward (no input required grad)")
        E = self.buffer.local_experts
        _, offsets, slot_to_row, row_to_slot = lib.dispatch_layout(self.topk_idx, E, 0, E, self.row_align)
        # As tall as the receive region (the other row operands'); the gather writes only the routed rows.
        padded = row_to_slot.new_full((self.buffer.region("recv_rows").shape[0],), -1)
        padded[:row_to_slot.shape[0]] = row_to_slot
        return lib.gather_rows(x, padded, self.topk_idx.shape[1], None, slot_to_row, offsets)
