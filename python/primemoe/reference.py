"""Pure-PyTorch reference of the MoE expert computation (DESIGN.md section 1).

Single process, all experts local. Computes in float32 (float64 when the inputs
are float64) and returns ``y`` in the dtype of ``x``. Differentiable through
autograd with respect to ``x``, ``topk_weights``, ``w1`` and ``w2``. It is the CPU
implementation of ``torch.ops.primemoe.moe_forward`` and the yardstick of every test.

``moe_fp8`` / ``moe_fp8_backward``: the FP8-emulating reference of DESIGN.md section 2 (the
blockwise quantisation of ``primemoe.fp8``, dequantised, fp64 GEMMs), the spec of the FP8 kernels.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from . import fp8
from ._validate import check_fp8_problem

__all__ = ["moe", "moe_backward", "compute_dtype", "moe_fp8", "moe_fp8_backward"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _slots(x, topk_idx, topk_weights, w1):
    """Per-slot views shared by forward and backward: (expert id, weight, token) of each slot t*K+k."""
    E = w1.shape[0]
    flat_idx = topk_idx.reshape(-1).long()
    if flat_idx.numel() and (bool((flat_idx < -1).any()) or bool((flat_idx >= E).any())):
        bad = flat_idx[(flat_idx < -1) | (flat_idx >= E)][0].item()
        raise ValueError(f"topk_idx holds expert id {bad}, outside [-1, {E})")
    flat_w = topk_weights.reshape(-1).to(compute_dtype(x.dtype))
    token_of_slot = torch.arange(topk_idx.numel(), device=x.device) // topk_idx.shape[1]
    return flat_idx, flat_w, token_of_slot


def moe(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """y[t] = sum_k w[t,k] * w2[e] @ (silu(w1[e,:I] @ x[t]) * (w1[e,I:] @ x[t])).

    Slots with ``topk_idx == -1`` add nothing. Ids outside ``[-1, E)`` raise.
    """
    T, H = x.shape
    E, two_i, _ = w1.shape
    inter = two_i // 2
    acc = compute_dtype(x.dtype)
    flat_idx, flat_w, token_of_slot = _slots(x, topk_idx, topk_weights, w1)

    y = torch.zeros(T, H, dtype=acc, device=x.device)
    xa = x.to(acc)
    # unbind once: indexing w1[e] per expert would make autograd build a full-size
    # gradient per expert.
    w1s, w2s = w1.unbind(0), w2.unbind(0)
    for e in range(E):
        slots = (flat_idx == e).nonzero(as_tuple=True)[0]
        if slots.numel() == 0:
            continue
        tokens = token_of_slot[slots]
        xe = xa.index_select(0, tokens)
        h = xe @ w1s[e].to(acc).t()
        a = F.silu(h[:, :inter]) * h[:, inter:]
        o = a @ w2s[e].to(acc).t()
        y = y.index_add(0, tokens, o * flat_w[slots].unsqueeze(1))
    return y.to(x.dtype)


def moe_backward(dy, x, topk_idx, topk_weights, w1, w2):
    """Gradients of :func:`moe` written out by hand (no autograd, so it can run inside an
    op kernel): returns ``(dx, d_topk_weights fp32, dw1, dw2)``."""
    T, H = x.shape
    K = topk_idx.shape[1]
    E, two_i, _ = w1.shape
    inter = two_i // 2
    acc = compute_dtype(x.dtype)
    flat_idx, flat_w, token_of_slot = _slots(x, topk_idx, topk_weights, w1)
    xa, dya = x.to(acc), dy.to(acc)
    dx = torch.zeros(T, H, dtype=acc, device=x.device)
    d_weights = torch.zeros(T * K, dtype=acc, device=x.device)
    dw1 = torch.zeros(w1.shape, dtype=acc, device=x.device)
    dw2 = torch.zeros(w2.shape, dtype=acc, device=x.device)
    for e in range(E):
        slots = (flat_idx == e).nonzero(as_tuple=True)[0]
        if slots.numel() == 0:
            continue
        tokens = token_of_slot[slots]
        xe, dye = xa.index_select(0, tokens), dya.index_select(0, tokens)
        w1e, w2e = w1[e].to(acc), w2[e].to(acc)
        h = xe @ w1e.t()
        gate, up = h[:, :inter], h[:, inter:]
        sig = torch.sigmoid(gate)
        silu = gate * sig
        a = silu * up
        d_weights[slots] = ((a @ w2e.t()) * dye).sum(1)
        do = dye * flat_w[slots].unsqueeze(1)
        dw2[e] = do.t() @ a
        da = do @ w2e
        dh = torch.cat([da * up * sig * (1 + gate * (1 - sig)), da * silu], dim=1)
        dw1[e] = dh.t() @ xe
        dx.index_add_(0, tokens, dh @ w1e)
    return dx.to(x.dtype), d_weights.view(T, K).float(), dw1.to(w1.dtype), dw2.to(w2.dtype)


# ---------------------------------------------------------------- the FP8-emulating reference

_FP8_SPEC = """
The FP8 recipe as these functions compute it (DESIGN.md section 2), the spec of the FP8 kernels. Notation:
``Q1(t)`` = ``fp8.quantize_1x128`` (1x128 tiles along the last dim), ``Q128(w)`` = ``fp8.quantize_128x128``
(128x128 blocks), ``Qt(t)`` = ``fp8.quantize_128x1`` (128x1 tiles along the rows), each with ``pow2`` and
followed by its dequantisation to float64 (exact); ``GEMM`` = a float64 matrix product of such operands
rounded once to float32 (the kernels' fp32 accumulator: the only allowed difference between the kernels and
this reference is that accumulator's order and the per-128-K promotion of the scales); ``bf16(v)`` /
``fp32(v)`` = round to nearest-even. ``w`` = the slot's routing weight in float32. Per expert ``e``, its rows
are its slots in slot order (slot ``t * K + k``); skipped slots (``-1``) have no row. ``H`` and ``I`` must be
multiples of 128 (``_validate.check_fp8_problem``: ValueError naming ``x`` / ``w1``).

Forward (``fp8_forward=True``, precision "fp8"):

1. ``xq = Q1(x)`` per token along H, once, before dispatch (the same tiles for every slot of a token).
2. ``h = bf16(GEMM(xq[rows], Q128(w1[e])^T))`` ``[n_e, 2I]`` (FC1; ``h`` is what the bf16 path keeps).
3. ``a = bf16(fp32(silu(g)) * u)``, ``g, u = fp32(h[:, :I]), fp32(h[:, I:])`` (SwiGLU in float32 from the
   bf16 ``h``; ``silu`` = torch's float32 ``F.silu``, the kernels' approximate exp differs by an fp32 ulp).
4. ``aq = Q1(a)`` along I (FC1's epilogue quantises it, 1x128 tiles: never straddling the gate/up halves).
5. ``o = bf16(fp32(GEMM(aq, Q128(w2[e])^T)) * w)`` ``[n_e, H]`` per slot (FC2, the routing weight applied to
   its fp32 output, then the bf16 row).
6. ``y[t] = bf16(((0 + o[t, 0]) + o[t, 1]) + ... + o[t, K-1])``: the combine, a float32 sum over the token's
   slots in slot order (skipped slots add exact zeros).

``fp8_forward=False`` (precision "fp8_bwd"): ``y`` is :func:`moe` (the bf16 reference) exactly, and the
backward's ``h`` is ``bf16(GEMM(x[rows], w1[e]^T))`` on the unquantised operands (the bf16 path's kept h).

Backward (``fp8_backward=True``), given ``dy [T, H]``; ``h`` and ``a`` as in the forward (kept or recomputed,
the same values):

7. ``dyq = Q1(dy)`` per token along H, once, before dispatch.
8. ``da = GEMM(dyq[rows], Q128(w2[e]))`` ``[n_e, I]``, float32, *unweighted* (FC2 dgrad: contraction over H, the
   transposed orientation of the forward's ``w2`` blocks, the same blocks and bits).
9. ``d_topk_weights[slot] = fp32(sum_i float64(da[i]) * float64(a[i]))`` (``<da, a>`` in float64 with the
   bf16 ``a`` of step 3); 0 for skipped slots.
10. The SwiGLU backward in float32 from the bf16 ``h``, ``sig = sigmoid(g)``, ``dw = da * w``:
    ``dh = bf16([((dw * u) * sig) * (1 + g * (1 - sig)) | (dw * g) * sig])`` ``[n_e, 2I]`` (evaluation order as
    written, as FC2 dgrad's epilogue), and ``aw = bf16(w * a)`` ``[n_e, I]`` (the weighted SwiGLU output).
11. FC1 dgrad: ``dx_row = bf16(GEMM(Q1(dh), Q128(w1[e])))`` ``[n_e, H]`` (``dh`` quantised 1x128 along 2I; the
    transposed orientation of ``w1``'s blocks); ``dx[t] = bf16`` of the float32 sum of the token's rows in slot
    order, as in step 6.
12. Weight gradients, per expert, over its ``n_e`` rows padded with zero rows to ``n_pad = 128 * ceil(n_e / 128)``
    (the expert's first row starts a tile; zero rows add nothing, an all-zero tile gets scale 1 and q 0):
    ``dw2[e] = GEMM(Qt(dy[rows])^T, Qt(aw))`` ``[H, I]`` and ``dw1[e] = GEMM(Qt(dh)^T, Qt(x[rows]))`` ``[2I, H]``,
    float32; both operands re-quantised 128x1 along the tokens **from bf16** (``dy`` and ``x`` themselves, not
    the dequantised 1x128 FP8 copies of steps 1 and 7). Experts without rows get exact zeros.

``fp8_backward=False``: the gradients are :func:`moe_backward` (the bf16 reference) exactly.
"""


def _expert_rows(flat_idx, token_of_slot, num_experts):
    """(expert, its slots in slot order, their tokens) of every expert with at least one routed slot."""
    for e in range(num_experts):
        slots = (flat_idx == e).nonzero(as_tuple=True)[0]
        if slots.numel():
            yield e, slots, token_of_slot[slots]


def _gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float64 product of two float64 operands, rounded once to float32 (the kernels' accumulator)."""
    return (a @ b).to(torch.float32)


def _deq_1x128(t, pow2, name):
    return fp8.dequantize_1x128(*fp8.quantize_1x128(t, pow2, name=name), torch.float64)


def _deq_128x1_padded(rows, pow2, name):
    """``rows [n, C]`` padded with zero rows to a multiple of 128, re-quantised 128x1 along them, dequantised:
    ``[n_pad, C]`` float64."""
    n = rows.shape[0]
    pad = -n % fp8.BLOCK
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    return fp8.dequantize_128x1(*fp8.quantize_128x1(rows, pow2, name=name), torch.float64)


def _swiglu_bf16(h: torch.Tensor) -> torch.Tensor:
    """Step 3: ``bf16(silu(g) * u)`` in float32 from the bf16 pre-activations."""
    gate, up = h.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(torch.bfloat16)


class _Fp8Operands:
    """The dequantised (float64) operands the emulation shares between steps: x's 1x128 tiles (when FP8) and
    each expert's weight blocks, dequantised per expert on demand (the whole of w1 in float64 would be 4x its
    bf16 size)."""

    def __init__(self, x, w1, w2, fp8_forward, pow2):
        self.pow2, self.fp8_forward = pow2, fp8_forward
        self.x64 = _deq_1x128(x, pow2, "x") if fp8_forward else x.to(torch.float64)
        self.w1_unquantised = w1
        self.w1q = fp8.quantize_128x128(w1, pow2, name="w1")
        self.w2q = fp8.quantize_128x128(w2, pow2, name="w2")

    def w1_blocks(self, e):
        return fp8.dequantize_128x128(self.w1q[0][e], self.w1q[1][e], torch.float64)

    def w2_blocks(self, e):
        return fp8.dequantize_128x128(self.w2q[0][e], self.w2q[1][e], torch.float64)

    def fc1(self, e, tokens):
        """Step 2: the bf16 ``h`` of the expert's rows (FP8 operands, or the unquantised ones for fp8_bwd)."""
        w = self.w1_blocks(e) if self.fp8_forward else self.w1_unquantised[e].to(torch.float64)
        return _gemm(self.x64.index_select(0, tokens), w.t()).to(torch.bfloat16)


def _combine_bf16(rows: torch.Tensor, T: int, K: int) -> torch.Tensor:
    """Steps 6 / 11: ``rows [T * K, H]`` float32 (zeros on skipped slots) summed per token in slot order, bf16."""
    per_slot = rows.view(T, K, rows.shape[1])
    out = torch.zeros(T, rows.shape[1], dtype=torch.float32, device=rows.device)
    for k in range(K):
        out = out + per_slot[:, k]
    return out.to(torch.bfloat16)


def _fp8_forward(x, topk_idx, topk_weights, w1, w2, pow2):
    T, H = x.shape
    K = topk_idx.shape[1]
    check_fp8_problem(H, w1.shape[1] // 2)
    flat_idx, _, token_of_slot = _slots(x, topk_idx, topk_weights, w1)
    flat_w = topk_weights.reshape(-1).to(torch.float32)
    ops = _Fp8Operands(x, w1, w2, True, pow2)
    rows = torch.zeros(T * K, H, dtype=torch.float32, device=x.device)
    for e, slots, tokens in _expert_rows(flat_idx, token_of_slot, w1.shape[0]):
        a = _swiglu_bf16(ops.fc1(e, tokens))
        o = _gemm(_deq_1x128(a, pow2, "a"), ops.w2_blocks(e).t())
        rows[slots] = (o * flat_w[slots].unsqueeze(1)).to(torch.bfloat16).float()
    return _combine_bf16(rows, T, K).to(x.dtype)


def moe_fp8_backward(dy, x, topk_idx, topk_weights, w1, w2, *, fp8_forward=True, fp8_backward=True, pow2=True):
    """Gradients of :func:`moe_fp8`: ``(dx [T, H] in x's dtype (bf16 values), d_topk_weights [T, K] fp32,
    dw1, dw2 fp32)``; with ``fp8_backward=False``, :func:`moe_backward` (its dtypes). No autograd.
    """
    if not fp8_backward:
        return moe_backward(dy, x, topk_idx, topk_weights, w1, w2)
    T, H = x.shape
    K = topk_idx.shape[1]
    inter = w1.shape[1] // 2
    check_fp8_problem(H, inter)
    if tuple(dy.shape) != (T, H):
        raise ValueError(f"dy: expected shape {(T, H)} like x, got {tuple(dy.shape)}")
    flat_idx, _, token_of_slot = _slots(x, topk_idx, topk_weights, w1)
    flat_w = topk_weights.reshape(-1).to(torch.float32)
    ops = _Fp8Operands(x, w1, w2, fp8_forward, pow2)
    dy64 = _deq_1x128(dy, pow2, "dy")
    dx_rows = torch.zeros(T * K, H, dtype=torch.float32, device=x.device)
    d_weights = torch.zeros(T * K, dtype=torch.float32, device=x.device)
    dw1 = torch.zeros(w1.shape, dtype=torch.float32, device=x.device)
    dw2 = torch.zeros(w2.shape, dtype=torch.float32, device=x.device)
    for e, slots, tokens in _expert_rows(flat_idx, token_of_slot, w1.shape[0]):
        h = ops.fc1(e, tokens)
        a = _swiglu_bf16(h)
        da = _gemm(dy64.index_select(0, tokens), ops.w2_blocks(e))  # [n, I], unweighted
        d_weights[slots] = (da.double() * a.double()).sum(1).float()
        weight = flat_w[slots].unsqueeze(1)
        gate, up = h.float().chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        dw = da * weight
        dh = torch.cat([dw * up * sig * (1 + gate * (1 - sig)), dw * gate * sig], dim=1).to(torch.bfloat16)
        aw = (weight * a.float()).to(torch.bfloat16)
        dx_rows[slots] = _gemm(_deq_1x128(dh, pow2, "dh"), ops.w1_blocks(e)).to(torch.bfloat16).float()
        dy_rows, x_rows = dy.index_select(0, tokens), x.index_select(0, tokens)
        dw2[e] = _gemm(_deq_128x1_padded(dy_rows, pow2, "dy").t(), _deq_128x1_padded(aw, pow2, "aw"))
        dw1[e] = _gemm(_deq_128x1_padded(dh, pow2, "dh").t(), _deq_128x1_padded(x_rows, pow2, "x"))
    return _combine_bf16(dx_rows, T, K).to(x.dtype), d_weights.view(T, K), dw1, dw2


class _MoeFp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, w1, w2, fp8_forward, fp8_backward, pow2):
        ctx.save_for_backward(x, topk_idx, topk_weights, w1, w2)
        ctx.flags = dict(fp8_forward=fp8_forward, fp8_backward=fp8_backward, pow2=pow2)
        if not fp8_forward:
            return moe(x, topk_idx, topk_weights, w1, w2)
        return _fp8_forward(x, topk_idx, topk_weights, w1, w2, pow2)

    @staticmethod
    def backward(ctx, dy):
        x, topk_idx, topk_weights, w1, w2 = ctx.saved_tensors
        dx, dtw, dw1, dw2 = moe_fp8_backward(dy, x, topk_idx, topk_weights, w1, w2, **ctx.flags)
        return dx.to(x.dtype), None, dtw.to(topk_weights.dtype), dw1.to(w1.dtype), dw2.to(w2.dtype), None, None, None


def moe_fp8(x, topk_idx, topk_weights, w1, w2, *, fp8_forward=True, fp8_backward=True, pow2=True):
    """The FP8-emulating reference of the layer: ``y [T, H]`` in x's dtype (bf16 values), differentiable
    through autograd (the backward is :func:`moe_fp8_backward`; gradients cast to the inputs' dtypes).

    ``fp8_forward`` / ``fp8_backward``: precision "fp8" is both, "fp8_bwd" is ``fp8_forward=False``
    (the forward is then :func:`moe` exactly); ``pow2``: power-of-two scales (the default).
    """
    return _MoeFp8.apply(x, topk_idx, topk_weights, w1, w2, bool(fp8_forward), bool(fp8_backward), bool(pow2))


def _append_spec(fn):
    if fn.__doc__ is not None:  # python -OO strips docstrings
        fn.__doc__ = inspect.cleandoc(fn.__doc__) + "\n\n" + inspect.cleandoc(_FP8_SPEC) + "\n"


_append_spec(moe_fp8)
_append_spec(moe_fp8_backward)
