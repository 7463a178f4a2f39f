"""The strongest plain-PyTorch MoE path: the yardstick every benchmark compares against.

Sort slots by expert on the device, ``torch._grouped_mm`` for both GEMMs (and for
both weight gradients), weighted un-permute and a batched K-reduction for the
combine (no float atomics). For EP > 1, NCCL ``all_to_all_single`` moves rows to
the experts' ranks and back; that needs the per-rank row counts on the host (one
sync per direction), which is exactly the cost the fused kernels remove.

``forward`` returns ``(y, ctx)`` and ``backward(ctx, dy)`` the four gradients, so the
benchmark can time each half; ``moe`` wraps them in an autograd function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from ._fallback import grouped_wgrad, swiglu, swiglu_backward

__all__ = ["moe", "forward", "backward", "Context"]


@dataclass
class Context:
    """What the backward pass needs from the forward pass."""

    x: torch.Tensor
    topk_weights: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    slot_order: torch.Tensor  # slots sorted by (global expert, slot); skipped slots last
    sorted_weights: torch.Tensor  # routing weight per sorted slot, 0 for skipped slots
    expert_ends: torch.Tensor  # int32 [E_local]: cumulative row ends of the local GEMM groups
    fc1_out: torch.Tensor  # [rows, 2I] FC1 pre-activations in expert-grouped order
    combine_in: torch.Tensor  # [T, K, H] expert outputs per slot before weighting (0 for skipped)
    group: Optional[dist.ProcessGroup] = None
    local_order: Optional[torch.Tensor] = None  # EP: received rows -> expert-grouped order
    send_splits: Optional[List[int]] = None
    recv_splits: Optional[List[int]] = None


def _expert_mlp(xs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, ends: torch.Tensor):
    h = torch._grouped_mm(xs, w1.transpose(1, 2), offs=ends)
    o = torch._grouped_mm(swiglu(h), w2.transpose(1, 2), offs=ends)
    return h, o


def _expert_mlp_backward(xs, h, do, w1, w2, ends):
    """Row and weight gradients of the grouped expert MLP. Rows past ``ends[-1]`` are garbage."""
    a = swiglu(h)
    da = torch._grouped_mm(do, w2, offs=ends)
    dh = swiglu_backward(h, da)
    dxs = torch._grouped_mm(dh, w1, offs=ends)
    return dxs, grouped_wgrad(dh, xs, ends), grouped_wgrad(do, a, ends)


def _mask_rows(rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    # _grouped_mm leaves rows past the last group unwritten; they may hold NaN.
    return torch.where(valid.unsqueeze(1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def _weighted_sum(rows_tkh: torch.Tensor, weights_tk: torch.Tensor) -> torch.Tensor:
    """y[t] = sum_k w[t,k] * rows[t,k] with fp32 accumulation, deterministic."""
    T, K, H = rows_tkh.shape
    if rows_tkh.is_cuda:
        y = torch.bmm(weights_tk.view(T, 1, K).to(rows_tkh.dtype), rows_tkh)
        return y.view(T, H)
    return torch.bmm(weights_tk.view(T, 1, K).float(), rows_tkh.float()).view(T, H).to(rows_tkh.dtype)


def _slot_dots(rows_tkh: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """d_topk_weights[t,k] = <rows[t,k], dy[t]> in fp32."""
    T, K, H = rows_tkh.shape
    if rows_tkh.is_cuda:
        return torch.bmm(rows_tkh, dy.view(T, H, 1), out_dtype=torch.float32).view(T, K)
    return torch.bmm(rows_tkh.float(), dy.view(T, H, 1).float()).view(T, K)


def _sort_slots(topk_idx: torch.Tensor, num_experts: int):
    flat = topk_idx.reshape(-1).long()
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    sorted_key, order = torch.sort(key, stable=True)
    return key, sorted_key, order


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def forward(x, topk_idx, topk_weights, w1, w2, *, group=None):
    """Returns ``(y, ctx)``. ``group`` = the EP process group (None: all experts local)."""
    if _world(group) == 1:
        return _forward_local(x, topk_idx, topk_weights, w1, w2)
    return _forward_ep(x, topk_idx, topk_weights, w1, w2, group)


def backward(ctx: Context, dy: torch.Tensor):
    """Returns ``(dx, d_topk_weights fp32, dw1, dw2)``."""
    dy = dy.contiguous()
    T, K, H = ctx.combine_in.shape
    d_topk_weights = _slot_dots(ctx.combine_in, dy)
    if ctx.group is None:
        return _backward_local(ctx, dy, d_topk_weights)
    return _backward_ep(ctx, dy, d_topk_weights)


def _forward_local(x, topk_idx, topk_weights, w1, w2):
    T, H = x.shape
    K = topk_idx.shape[1]
    E = w1.shape[0]
    key, sorted_key, order = _sort_slots(topk_idx, E)
    ends = torch.bincount(key, minlength=E + 1)[:E].cumsum(0).to(torch.int32)
    valid = sorted_key < E
    sorted_weights = torch.where(valid, topk_weights.reshape(-1).float()[order], 0.0)
    if T * K == 0:
        h = x.new_empty(0, w1.shape[1])
        combine_in = x.new_zeros(T, K, H)
    else:
        xs = x.index_select(0, order // K)
        h, o = _expert_mlp(xs, w1, w2, ends)
        combine_in = torch.empty_like(o).index_copy_(0, order, _mask_rows(o, valid)).view(T, K, H)
    y = _weighted_sum(combine_in, topk_weights)
    ctx = Context(x, topk_weights, w1, w2, order, sorted_weights, ends, h, combine_in)
    return y, ctx


def _backward_local(ctx: Context, dy, d_topk_weights):
    T, K, H = ctx.combine_in.shape
    w1, w2 = ctx.w1, ctx.w2
    if T * K == 0:
        return torch.zeros_like(ctx.x), d_topk_weights, torch.zeros_like(w1), torch.zeros_like(w2)
    order = ctx.slot_order
    tokens = order // K
    xs = ctx.x.index_select(0, tokens)
    do = dy.index_select(0, tokens) * ctx.sorted_weights.to(dy.dtype).unsqueeze(1)
    dxs, dw1, dw2 = _expert_mlp_backward(xs, ctx.fc1_out, do, w1, w2, ctx.expert_ends)
    dx_slots = torch.empty_like(dxs).index_copy_(0, order, _mask_rows(dxs, _valid_sorted(ctx)))
    dx = dx_slots.view(T, K, H).sum(dim=1)
    return dx, d_topk_weights, dw1, dw2


def _valid_sorted(ctx: Context) -> torch.Tensor:
    n = ctx.slot_order.numel()
    rows = torch.arange(n, device=ctx.slot_order.device)
    return rows < ctx.expert_ends[-1]


def _all_to_all(rows: torch.Tensor, out_splits, in_splits, group) -> torch.Tensor:
    out = rows.new_empty((sum(out_splits),) + tuple(rows.shape[1:]))
    dist.all_to_all_single(out, rows, out_splits, in_splits, group=group)
    return out


def _forward_ep(x, topk_idx, topk_weights, w1, w2, group):
    W = dist.get_world_size(group)
    T, H = x.shape
    K = topk_idx.shape[1]
    E_local = w1.shape[0]
    E = W * E_local
    key, sorted_key, order = _sort_slots(topk_idx, E)
    dest = sorted_key // E_local  # W for skipped slots
    send_counts = torch.bincount(dest, minlength=W + 1)[:W]
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    counts = torch.stack([send_counts, recv_counts]).tolist()  # the host sync NCCL needs
    send_splits, recv_splits = counts[0], counts[1]
    n_send = sum(send_splits)

    valid = sorted_key < E
    sorted_weights = torch.where(valid, topk_weights.reshape(-1).float()[order], 0.0)
    tokens = order[:n_send] // K
    recv_x = _all_to_all(x.index_select(0, tokens), recv_splits, send_splits, group)
    local_expert = (sorted_key[:n_send] % E_local).to(torch.int32)
    recv_expert = _all_to_all(local_expert, recv_splits, send_splits, group).long()
    local_order = torch.sort(recv_expert, stable=True).indices
    ends = torch.bincount(recv_expert, minlength=E_local).cumsum(0).to(torch.int32)

    if recv_x.shape[0]:
        xs = recv_x.index_select(0, local_order)
        h, o = _expert_mlp(xs, w1, w2, ends)
        o_recv = torch.empty_like(o).index_copy_(0, local_order, o)
    else:
        h = x.new_empty(0, w1.shape[1])
        o_recv = x.new_empty(0, H)
    o_back = _all_to_all(o_recv, send_splits, recv_splits, group)
    combine_in = x.new_zeros(T * K, H).index_copy_(0, order[:n_send], o_back).view(T, K, H)
    y = _weighted_sum(combine_in, topk_weights)
    ctx = Context(x, topk_weights, w1, w2, order, sorted_weights, ends, h, combine_in,
                  group, local_order, send_splits, recv_splits)
    return y, ctx


def _backward_ep(ctx: Context, dy, d_topk_weights):
    T, K, H = ctx.combine_in.shape
    group, w1, w2 = ctx.group, ctx.w1, ctx.w2
    n_send = sum(ctx.send_splits)
    tokens = ctx.slot_order[:n_send] // K
    do_send = dy.index_select(0, tokens) * ctx.sorted_weights[:n_send].to(dy.dtype).unsqueeze(1)
    x_send = ctx.x.index_select(0, tokens)
    do_recv = _all_to_all(do_send, ctx.recv_splits, ctx.send_splits, group)
    x_recv = _all_to_all(x_send, ctx.recv_splits, ctx.send_splits, group)
    if do_recv.shape[0]:
        lo = ctx.local_order
        dxs, dw1, dw2 = _expert_mlp_backward(
            x_recv.index_select(0, lo), ctx.fc1_out, do_recv.index_select(0, lo), w1, w2, ctx.expert_ends)
        dx_recv = torch.empty_like(dxs).index_copy_(0, lo, dxs)
    else:
        dw1, dw2 = torch.zeros_like(w1), torch.zeros_like(w2)
        dx_recv = dy.new_empty(0, H)
    dx_back = _all_to_all(dx_recv, ctx.send_splits, ctx.recv_splits, group)
    dx = dy.new_zeros(T * K, H).index_copy_(0, ctx.slot_order[:n_send], dx_back).view(T, K, H).sum(dim=1)
    return dx, d_topk_weights, dw1, dw2


class _BaselineMoE(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, topk_idx, topk_weights, w1, w2, group):
        y, ctx = forward(x, topk_idx, topk_weights, w1, w2, group=group)
        fctx.moe_ctx = ctx
        return y

    @staticmethod
    def backward(fctx, dy):
        dx, dtw, dw1, dw2 = backward(fctx.moe_ctx, dy)
        del fctx.moe_ctx
        return dx, None, dtw, dw1, dw2, None


def moe(x, topk_idx, topk_weights, w1, w2, *, group=None):
    """Differentiable baseline MoE (see module docstring)."""
    return _BaselineMoE.apply(x, topk_idx, topk_weights, w1, w2, group)
