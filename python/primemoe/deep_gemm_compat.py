"""``primemoe.deep_gemm_compat`` (also importable as ``prime_mega_moe``): the names prime-rl's Mega MoE token
dispatcher calls on its DeepGEMM fork, over a ``primemoe.Buffer`` (DESIGN.md section 3, "Compatibility surface").

prime-rl's calling convention, which this module follows::

    buf = get_symm_buffer_for_mega_moe(group, num_experts, max_tokens_per_rank, top_k, hidden, intermediate,
                                       mma_type="bf16xbf16")                # once, cached per shape
    # every call (forward, and again before the backward):
    buf.x[:T].copy_(x); buf.topk_idx[:T].copy_(topk_idx); buf.topk_weights[:T].copy_(topk_weights)
    y = torch.empty(T, hidden, dtype=torch.bfloat16)
    bf16_mega_moe(y, l1, l2, buf, activation_clamp=None)
    dx, dw1, dw2, dtw = torch.empty_like(x), torch.empty_like(l1), torch.empty_like(l2), torch.empty(T, top_k)
    bf16_mega_moe_backward(dx, dw1, dw2, dtw, dy, l1, l2, buf)

- **T** (this rank's token count) is the first dim of the caller's output: ``y.shape[0]`` in the forward,
  ``dy.shape[0]`` in the backward (``dx`` and ``dtopk_weights`` must match it). Rows ``[T:]`` of the buffer's
  inputs are never read, whatever they hold (a previous, larger call's tokens). ``-1`` in ``topk_idx`` skips a
  slot, as in ``primemoe.moe``.
- ``l1`` = ``w1`` [E_local, 2I, H] (gate rows, then up rows: the natural ``[gate | up]`` layout, not
  upstream DeepGEMM's 8-row interleave), ``l2`` = ``w2`` [E_local, H, I], bf16; ``topk_idx`` ids are global
  (expert ``g`` lives on rank ``g // E_local``).
- Outputs are caller-allocated and **overwritten** (prime-rl allocates them with ``torch.empty``): ``y``,
  ``dx`` bf16 [T, H]; ``dtopk_weights`` [T, K] (fp32); ``dw1`` / ``dw2`` bf16 or fp32 shaped like ``l1`` /
  ``l2``. An fp32 ``dw`` holds the bf16 weight gradient widened (the expert GEMMs round wgrad to bf16).
- The backward reads the forward's tokens and routing back from the buffer (the caller reloads them),
  dispatches ``x`` again and recomputes FC1: the forward keeps nothing.

Each call runs the layer's composition (``layer.forward`` / ``layer.backward``) over the Buffer's NVSHMEM
dispatch and combine, as ``primemoe.moe(..., buffer=)`` does, so every rank of the group must make every call.
The result is copied into ``y`` (one extra [T, H] copy; likewise the backward's four outputs).

Not supported (yet): FP8 ``mma_type`` values and ``use_fp8_dispatch=True``, activations other than
``"swiglu"``, a finite ``activation_clamp`` (all NotImplementedError); shared experts. ``fast_math`` is
accepted and ignored (primemoe's SwiGLU has one implementation). ``set_num_sms`` / ``get_num_sms``: see there.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import layer
from ._validate import check_moe_inputs
from .buffer import DEFAULT_NUM_SMS, Buffer
from .ep import BufferTransport, check_buffer_problem
from .sm_budget import set_num_sms as set_gemm_sms

__all__ = ["SymmBuffer", "get_symm_buffer_for_mega_moe", "bf16_mega_moe", "bf16_mega_moe_backward", "set_num_sms",
           "get_num_sms", "BF16_MMA_TYPE"]

BF16_MMA_TYPE = "bf16xbf16"
_ACTIVATIONS = ("swiglu",)
_DW_DTYPES = (torch.bfloat16, torch.float32)


# ---------------------------------------------------------------- the SM budget

_num_sms: Optional[int] = None


def set_num_sms(n):
    """The SM budget of the Mega MoE kernels (DeepGEMM's ``set_num_sms``; prime-rl sets the device's SMs minus
    those it reserves for other communication). ``get_num_sms`` returns it. What reads it: the expert GEMMs'
    persistent grids (``primemoe.set_num_sms``, process-wide), and the dispatch/combine kernels of each Buffer
    ``get_symm_buffer_for_mega_moe`` creates afterwards, which run on ``min(buffer.DEFAULT_NUM_SMS, n)`` SMs."""
    global _num_sms
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"set_num_sms: expected an int, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"set_num_sms: expected a positive int, got {n}")
    set_gemm_sms(n)
    _num_sms = n


def get_num_sms():
    """The value ``set_num_sms`` stored; before any call, the current CUDA device's SM count (None without
    CUDA)."""
    if _num_sms is not None:
        return _num_sms
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return None


def _comm_sms() -> int:
    budget = get_num_sms()
    return DEFAULT_NUM_SMS if budget is None else min(DEFAULT_NUM_SMS, budget)


# ---------------------------------------------------------------- the buffer


def _check_mma_type(mma_type) -> None:
    if mma_type != BF16_MMA_TYPE:
        raise NotImplementedError(
            f"mma_type: {mma_type!r} is not supported by primemoe's DeepGEMM compatibility layer (FP8 mma types "
            f"are not wired yet); only {BF16_MMA_TYPE!r}")


def _check_activation(activation) -> None:
    if activation not in _ACTIVATIONS:
        raise NotImplementedError(
            f"activation: {activation!r} is not supported by primemoe's DeepGEMM compatibility layer; only 'swiglu'")


def _check_clamp(activation_clamp) -> None:
    """None (or +inf, the same: no clamp) only."""
    if activation_clamp is None or (isinstance(activation_clamp, (int, float)) and activation_clamp == math.inf):
        return
    raise NotImplementedError(
        f"activation_clamp: {activation_clamp!r}: the clamped SwiGLU (gate <= clamp, up in [-clamp, clamp]) is not "
        "implemented in primemoe's kernels yet; pass None (plain SwiGLU)")


def _new_buffer(group, **sizes):
    """The primemoe.Buffer behind a SymmBuffer (the CPU tests put a model of it here)."""
    return Buffer(group, **sizes)


class SymmBuffer:
    """What ``get_symm_buffer_for_mega_moe`` returns: the caller's input rows ``x`` ([M, hidden] bf16),
    ``topk_idx`` ([M, num_topk] int64), ``topk_weights`` ([M, num_topk] fp32), ``x_sf`` (None: bf16 rows carry
    no scales), with M = ``num_max_tokens_per_rank``; ``buffer``: the ``primemoe.Buffer`` over ``group`` that
    moves the rows. The inputs are plain tensors on the buffer's device, not symmetric memory: the dispatch
    reads them and sends what each rank's experts need. ``destroy()`` closes the Buffer: collective, as
    ``Buffer.close()`` is (every rank calls it); idempotent.

    Constructed like DeepGEMM's ``SymmBuffer`` (its first seven arguments, ``mma_type`` and ``activation``);
    ``num_shared_experts`` other than 0 raises NotImplementedError."""

    def __init__(self, group, num_experts: int, num_max_tokens_per_rank: int, num_topk: int, hidden: int,
                 intermediate_hidden: int, num_shared_experts: int = 0, mma_type: str = BF16_MMA_TYPE,
                 activation: str = "swiglu"):
        _check_mma_type(mma_type)
        _check_activation(activation)
        if num_shared_experts != 0:
            raise NotImplementedError(
                f"num_shared_experts: {num_shared_experts}: shared experts are not fused by primemoe; run them "
                "outside the MoE call (num_shared_experts=0)")
        self.group = group
        self.num_experts = num_experts
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_topk = num_topk
        self.hidden = hidden
        self.intermediate_hidden = intermediate_hidden
        self.num_shared_experts = 0
        self.mma_type = mma_type
        self.activation = activation
        self.buffer = _new_buffer(group, max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden,
                                  intermediate=intermediate_hidden, num_experts=num_experts, top_k=num_topk,
                                  num_sms=_comm_sms())
        device = self.buffer.device
        M, K = num_max_tokens_per_rank, num_topk
        self.x = torch.zeros(M, hidden, dtype=torch.bfloat16, device=device)
        self.x_sf = None
        self.topk_idx = torch.full((M, K), -1, dtype=torch.int64, device=device)
        self.topk_weights = torch.zeros(M, K, dtype=torch.float32, device=device)

    @property
    def destroyed(self) -> bool:
        return self.buffer is None

    def destroy(self) -> None:
        if self.buffer is None:
            return
        buffer, self.buffer = self.buffer, None
        self.x = self.x_sf = self.topk_idx = self.topk_weights = None
        buffer.close()

    def __repr__(self) -> str:
        state = "destroyed" if self.destroyed else repr(self.buffer)
        return (f"prime_mega_moe.SymmBuffer(num_experts={self.num_experts}, "
                f"num_max_tokens_per_rank={self.num_max_tokens_per_rank}, num_topk={self.num_topk}, "
                f"hidden={self.hidden}, intermediate_hidden={self.intermediate_hidden}, mma_type={self.mma_type!r}; "
                f"{state})")

    def _inputs(self, tokens: int, name: str):
        """``(x, topk_idx, topk_weights)`` of the first ``tokens`` rows; ``name``: the output T comes from."""
        if self.buffer is None:
            raise RuntimeError("sym_buffer: this SymmBuffer was destroyed")
        if tokens > self.num_max_tokens_per_rank:
            raise ValueError(f"{name}: {tokens} tokens (its first dim) exceed the buffer's "
                             f"num_max_tokens_per_rank={self.num_max_tokens_per_rank}")
        return self.x[:tokens], self.topk_idx[:tokens], self.topk_weights[:tokens]


def get_symm_buffer_for_mega_moe(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                                 use_fp8_dispatch=None, mma_type="bf16xbf16", activation="swiglu"):
    """A ``SymmBuffer`` over ``group`` (collective: every rank calls it with the same sizes) for this
    rank's at most ``num_max_tokens_per_rank`` tokens, ``num_topk`` slots each, ``num_experts`` experts over
    the group (``num_experts // world`` per rank), ``hidden`` H and ``intermediate_hidden`` I.
    ``use_fp8_dispatch``: None or False (True: NotImplementedError, as FP8 mma types)."""
    _check_mma_type(mma_type)
    if use_fp8_dispatch:
        raise NotImplementedError("use_fp8_dispatch: FP8 dispatch is not supported by primemoe's DeepGEMM "
                                  "compatibility layer yet; pass None or False (bf16 rows)")
    _check_activation(activation)
    return SymmBuffer(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                      mma_type=mma_type, activation=activation)


# ---------------------------------------------------------------- forward and backward


def _check_sym_buffer(sym_buffer) -> None:
    if not isinstance(sym_buffer, SymmBuffer):
        raise TypeError(f"sym_buffer: expected what get_symm_buffer_for_mega_moe returns, "
                        f"got {type(sym_buffer).__name__}")
    _check_mma_type(sym_buffer.mma_type)


def _check_output(name, t, shape, dtypes, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on the buffer's device {device}, got {t.device}")


def _check_problem(sym_buffer, x, topk_idx, topk_weights, l1, l2) -> None:
    """l1 / l2 against the buffer's problem (errors name them w1 / w2, as primemoe.moe does)."""
    buffer = sym_buffer.buffer
    shape = check_moe_inputs(x, topk_idx, topk_weights, l1, l2, num_ranks=buffer.world,
                             max_tokens=buffer.max_tokens_per_rank)
    check_buffer_problem(shape, x.device, "bf16", buffer)


def _first_dim(name, t) -> int:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor [T, hidden] (T: this call's tokens), got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    return t.shape[0]


class _ReplayTransport(BufferTransport):
    """The Buffer transport whose backward dispatches the forward's ``x`` again (nothing was kept from the
    forward): its rows are copied out of the receive region before ``dy``'s dispatch reuses it."""

    def __init__(self, buffer, topk_idx, topk_weights):
        super().__init__(buffer, topk_idx)
        self._topk_weights = topk_weights

    def backward_rows(self, x):
        rows, _, _ = self.dispatch(x, self._topk_weights)
        return torch.ops.primemoe.copy_routed_rows(rows, self.offsets)


def bf16_mega_moe(y, l1, l2, sym_buffer, cumulative_local_expert_recv_stats=None, activation="swiglu",
                  activation_clamp=None, fast_math=True):
    """``y[:] = moe(x[:T], topk_idx[:T], topk_weights[:T], l1, l2)`` over the buffer's group, with T =
    ``y.shape[0]`` and the inputs the caller copied into ``sym_buffer``. ``cumulative_local_expert_recv_stats``
    (int32/int64 [E_local] on the buffer's device, optional) += the rows this rank's experts received (routed
    rows, no padding), on the device: no host sync. ``fast_math`` is ignored."""
    _check_sym_buffer(sym_buffer)
    _check_activation(activation)
    _check_clamp(activation_clamp)
    T = _first_dim("y", y)
    x, topk_idx, topk_weights = sym_buffer._inputs(T, "y")
    buffer = sym_buffer.buffer
    _check_problem(sym_buffer, x, topk_idx, topk_weights, l1, l2)
    _check_output("y", y, (T, sym_buffer.hidden), (torch.bfloat16,), x.device)
    stats = cumulative_local_expert_recv_stats
    if stats is not None:
        _check_output("cumulative_local_expert_recv_stats", stats, (buffer.local_experts,),
                      (torch.int32, torch.int64), x.device)
    with torch.no_grad():
        transport = _ReplayTransport(buffer, topk_idx, topk_weights)
        out, _, _ = layer.forward(transport, x, topk_weights, l1, l2, keep_fc1=False)
        y.copy_(out)
        if stats is not None:
            stats.add_(transport.counts)


def bf16_mega_moe_backward(dx, dw1, dw2, dtopk_weights, dy, l1, l2, sym_buffer, activation_clamp=None):
    """Gradients of ``bf16_mega_moe`` for ``dy`` [T, hidden] bf16, written into the caller's ``dx`` [T, hidden]
    bf16, ``dw1`` / ``dw2`` (shaped like ``l1`` / ``l2``; bf16 or fp32; overwritten, not accumulated) and
    ``dtopk_weights`` [T, num_topk] (fp32 or bf16). The forward's tokens and routing are read back from
    ``sym_buffer`` (rows ``[:T]``); FC1 is recomputed."""
    _check_sym_buffer(sym_buffer)
    _check_clamp(activation_clamp)
    T = _first_dim("dy", dy)
    x, topk_idx, topk_weights = sym_buffer._inputs(T, "dy")
    buffer = sym_buffer.buffer
    _check_problem(sym_buffer, x, topk_idx, topk_weights, l1, l2)
    device = x.device
    _check_output("dy", dy, (T, sym_buffer.hidden), (torch.bfloat16,), device)
    _check_output("dx", dx, (T, sym_buffer.hidden), (torch.bfloat16,), device)
    _check_output("dtopk_weights", dtopk_weights, (T, sym_buffer.num_topk), (torch.float32, torch.bfloat16), device)
    _check_output("dw1", dw1, tuple(l1.shape), _DW_DTYPES, device)
    _check_output("dw2", dw2, tuple(l2.shape), _DW_DTYPES, device)
    with torch.no_grad():
        transport = _ReplayTransport(buffer, topk_idx, topk_weights)
        grads = layer.backward(transport, dy, x, topk_weights, l1, l2, None)
        for out, grad in zip((dx, dtopk_weights, dw1, dw2), grads):
            out.copy_(grad)
