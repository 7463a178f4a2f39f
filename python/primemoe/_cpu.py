"""CPU kernels of the primitives, in ATen ops: the specification the CUDA kernels are tested against.

Each first runs, through ``_check_args``, the C++ argument check its CUDA kernel runs (csrc/binding/), so
both devices reject the same arguments with the same message. ``_check_args`` takes the op's tensor
arguments, then its int and bool arguments, in schema order.
"""

from __future__ import annotations

import torch

from . import _C  # noqa: F401  (loads the library that defines the schemas)
from ._constants import TILE_N, layout_max_rows

lib = torch.ops.primemoe


def _cpu_kernel(name):
    def register(kernel):
        torch.library.impl(f"primemoe::{name}", "cpu", kernel)
        return kernel
    return register


def _check(op, tensors, ints=()):
    lib._check_args(op, list(tensors), [int(v) for v in ints])


# ---------------------------------------------------------------- layout


@_cpu_kernel("dispatch_layout")
def dispatch_layout(topk_idx, num_experts, expert_begin, num_local_experts, row_align):
    """The layout on the host; an id out of range raises at once (the data is already here)."""
    _check("dispatch_layout", [topk_idx], [num_experts, expert_begin, num_local_experts, row_align])
    ids = topk_idx.reshape(-1).long()
    bad = ((ids < -1) | (ids >= num_experts)).nonzero()
    if bad.numel():
        slot, top_k = int(bad[0]), topk_idx.shape[1]
        raise RuntimeError(f"topk_idx[{slot // top_k}, {slot % top_k}] = {int(ids[slot])} is not an expert id "
                           f"(expected -1 or a value in [0, {num_experts}))")
    local = ids - expert_begin
    routed = (ids >= 0) & (local >= 0) & (local < num_local_experts)
    key = torch.where(routed, local, num_local_experts)  # slots not routed here sort last
    counts = torch.bincount(key, minlength=num_local_experts + 1)[:num_local_experts]
    offsets = torch.zeros(num_local_experts + 1, dtype=torch.long)
    offsets[1:] = ((counts + row_align - 1) // row_align * row_align).cumsum(0)
    first = torch.zeros(num_local_experts + 1, dtype=torch.long)  # each expert's first slot in `order`
    first[1:] = counts.cumsum(0)
    order = torch.sort(key, stable=True).indices  # each expert's slots in slot order
    routed_slots = int(first[-1])
    slots, experts = order[:routed_slots], key[order[:routed_slots]]
    rows = offsets[experts] + torch.arange(routed_slots) - first[experts]
    slot_to_row = torch.full((ids.numel(),), -1, dtype=torch.int32)
    slot_to_row[slots] = rows.int()
    row_to_slot = torch.full((layout_max_rows(ids.numel(), num_local_experts, row_align),), -1, dtype=torch.int32)
    row_to_slot[rows] = slots.int()
    return counts.int(), offsets.int(), slot_to_row.view(topk_idx.shape), row_to_slot


# ---------------------------------------------------------------- rows


@_cpu_kernel("gather_rows")
def gather_rows(src, row_to_slot, top_k, scale, slot_to_row=None, expert_offsets=None):
    """Rows in row order (slot_to_row is not needed); the rows past expert_offsets[-1] are written too (zeros are
    one of the undefined values). A row naming no slot of the T * K (-1, or past them) is zeros, as on the GPU."""
    _check("gather_rows", [src, row_to_slot, scale, slot_to_row, expert_offsets], [top_k])
    slots = src.shape[0] * top_k
    if slots == 0:
        return src.new_zeros(row_to_slot.shape[0], src.shape[1])
    slot_ids = row_to_slot.long()  # T * K may pass int32
    valid = (slot_ids >= 0) & (slot_ids < slots)
    slot = slot_ids.clamp(0, slots - 1)
    rows = src.index_select(0, slot.div(top_k, rounding_mode="floor")).float()
    if scale is not None:
        rows = rows * scale.reshape(-1).float().index_select(0, slot).unsqueeze(1)
    return torch.where(valid.unsqueeze(1), rows, rows.new_zeros(())).to(src.dtype)


def _slot_rows(rows, slot_to_row, local_rows=None):
    """Rows of the slots, [T, K, H] in fp32, zero where a slot has no row; ``local_rows[-2 - r]`` for r <= -2."""
    valid = (slot_to_row >= 0).unsqueeze(-1)
    index = slot_to_row.clamp_min(0).reshape(-1).long()
    taken = rows.index_select(0, index).float().view(slot_to_row.shape[0], slot_to_row.shape[1], rows.shape[1])
    taken = torch.where(valid, taken, taken.new_zeros(()))
    if local_rows is None:  # every negative entry is "no row"
        return taken
    local = (slot_to_row <= -2).unsqueeze(-1)
    index = (-2 - slot_to_row).clamp_min(0).reshape(-1).long()
    from_local = local_rows.index_select(0, index).float().view(taken.shape)
    return torch.where(local, from_local, taken)


@_cpu_kernel("combine_reduce")
def combine_reduce(rows, slot_to_row, weights, local_rows=None):
    _check("combine_reduce", [rows, slot_to_row, weights, local_rows])
    taken = _slot_rows(rows, slot_to_row, local_rows)
    if weights is not None:
        taken = taken * weights.float().unsqueeze(-1)
    return taken.sum(1).to(rows.dtype)


@_cpu_kernel("slot_dot")
def slot_dot(a, b, slot_to_row):
    _check("slot_dot", [a, b, slot_to_row])
    return (_slot_rows(a, slot_to_row) * _slot_rows(b, slot_to_row)).sum(-1)


@_cpu_kernel("gather_scalars")
def gather_scalars(values, index):
    _check("gather_scalars", [values, index])
    n = values.shape[0]
    out = torch.zeros(index.shape, dtype=torch.float32)
    if n == 0:
        return out
    taken = values.index_select(0, index.clamp(0, n - 1).reshape(-1).long()).float()
    return torch.where((index >= 0) & (index < n), taken.view(index.shape), out)


@_cpu_kernel("copy_routed_rows")
def copy_routed_rows(rows, expert_offsets):
    """Every row: whatever a consumer reads past the bound stays what the source held there."""
    _check("copy_routed_rows", [rows, expert_offsets])
    return rows.clone()


@_cpu_kernel("zero_unrouted_rows")
def zero_unrouted_rows(rows, expert_offsets):
    _check("zero_unrouted_rows", [rows, expert_offsets])
    bound = min(max(int(expert_offsets[-1]), 0), rows.shape[0])
    rows[bound:].zero_()


# ---------------------------------------------------------------- expert GEMMs


def _expert_products(rows, w, expert_offsets, w_kn):
    """fp32 products of each expert's rows with its weight; rows outside every expert stay 0."""
    out = torch.zeros(rows.shape[0], w.shape[2] if w_kn else w.shape[1], dtype=torch.float32)
    offsets = expert_offsets.tolist()
    for e, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
        if hi > lo:
            out[lo:hi] = rows[lo:hi].float() @ (w[e].float() if w_kn else w[e].float().t())
    return out


@_cpu_kernel("expert_gemm")
def expert_gemm(rows, w, expert_offsets, w_kn, row_weight=None, zero_unrouted=True, done_flags=None, done_counts=None,
                done_epoch=None, done_sms=0):
    """The rows past the routed ones are zeros either way (zeros are one of the undefined values). With done_*: every
    64-row block is published (done_flags = the epoch, done_counts back to 0), as the GPU kernel leaves them."""
    _check("expert_gemm", [rows, w, expert_offsets, row_weight, done_flags, done_counts, done_epoch],
           [w_kn, zero_unrouted, done_sms])
    out = _expert_products(rows, w, expert_offsets, w_kn)
    if row_weight is not None:
        out *= row_weight.unsqueeze(1)
    if done_flags is not None:
        blocks = rows.shape[0] // 64 + 1
        done_flags[:blocks] = done_epoch.reshape(())
        done_counts[:blocks] = 0
    return out.to(torch.bfloat16)


@_cpu_kernel("fc1_swiglu")
def fc1_swiglu(rows, w1, expert_offsets, keep_fc1, rows_ready=None, epoch=None, per_epoch=1, rank=0,
               zero_unrouted=True, tile_counter=None, overlap_sms=0):
    """Every row is in memory already: the wait hook's arguments are checked, nothing waits."""
    _check("fc1_swiglu", [rows, w1, expert_offsets, rows_ready, epoch, tile_counter],
           [keep_fc1, per_epoch, rank, zero_unrouted, overlap_sms])
    inter = w1.shape[1] // 2
    h = _expert_products(rows, w1, expert_offsets, False).to(torch.bfloat16)
    hf = h.float()
    a = (torch.nn.functional.silu(hf[:, :inter]) * hf[:, inter:]).to(torch.bfloat16)
    return a, h if keep_fc1 else h[:0].contiguous()


@_cpu_kernel("fc2_dgrad_swiglu")
def fc2_dgrad_swiglu(dy_rows, w2, h, row_weight, expert_offsets, zero_unrouted=True, rows_ready=None, epoch=None,
                     per_epoch=1, rank=0, overlap_sms=0):
    """Rows past the last expert give zeros whatever their inputs, as on the GPU. Every row is in memory already:
    the wait hook's arguments are checked, nothing waits."""
    _check("fc2_dgrad_swiglu", [dy_rows, w2, h, row_weight, expert_offsets, rows_ready, epoch],
           [zero_unrouted, per_epoch, rank, overlap_sms])
    rows, inter = dy_rows.shape[0], w2.shape[2]
    da = _expert_products(dy_rows, w2, expert_offsets, True)
    inside = (torch.arange(rows) < int(expert_offsets[-1])).unsqueeze(1)
    hf = torch.where(inside, h.float(), 0.0)
    g, u = hf[:, :inter], hf[:, inter:]
    s = torch.sigmoid(g)
    a = (g * s * u).to(torch.bfloat16).float()
    dot = (da * a).view(rows, inter // TILE_N, TILE_N).sum(-1)
    w = torch.where(inside, row_weight.unsqueeze(1), 0.0)
    daw = da * w
    dh = torch.cat([daw * u * s * (1 + g * (1 - s)), daw * g * s], 1).to(torch.bfloat16)
    return dh, (a * w).to(torch.bfloat16), dot


@_cpu_kernel("expert_wgrad_accumulate")
def expert_wgrad_accumulate(a_rows, b_rows, expert_offsets, expert_rows, main_grad):
    """``main_grad[e] += `` the fp32 weight gradient of expert e, unrounded; experts without rows add nothing."""
    _check("expert_wgrad_accumulate", [a_rows, b_rows, expert_offsets, expert_rows, main_grad])
    offsets = expert_offsets.tolist()
    for e, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
        if hi > lo:
            main_grad[e] += a_rows[lo:hi].float().t() @ b_rows[lo:hi].float()


@_cpu_kernel("expert_wgrad")
def expert_wgrad(a_rows, b_rows, expert_offsets, expert_rows=None):
    _check("expert_wgrad", [a_rows, b_rows, expert_offsets, expert_rows])
    offsets = expert_offsets.tolist()
    out = torch.zeros(len(offsets) - 1, a_rows.shape[1], b_rows.shape[1], dtype=a_rows.dtype)
    for e, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
        if hi > lo:
            out[e] = (a_rows[lo:hi].float().t() @ b_rows[lo:hi].float()).to(torch.bfloat16)
    return out
