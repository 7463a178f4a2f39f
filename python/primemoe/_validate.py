"""Input checks that run before any kernel: each names the argument and what was expected."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

PRECISIONS = ("bf16", "fp8", "fp8_bwd", "mxfp8")
# Precisions this build has kernels for. The others are part of the contract and raise NotImplementedError.
BUILT_PRECISIONS = ("bf16", "fp8", "fp8_bwd")
# The blockwise FP8 modes (DESIGN.md section 2): sm_90 only, H and I multiples of 128.
FP8_PRECISIONS = ("fp8", "fp8_bwd")

_INDEX_DTYPES = (torch.int64, torch.int32)
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class MoeShape:
    tokens: int
    hidden: int
    intermediate: int
    top_k: int
    local_experts: int
    num_experts: int


def _tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def _rank(name: str, t: torch.Tensor, dims: int, layout: str) -> None:
    if t.dim() != dims:
        raise ValueError(f"{name}: expected a {dims}-D tensor {layout}, got shape {tuple(t.shape)}")


def _contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (call .contiguous()), got strides {t.stride()}")


def check_precision(precision) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    if precision == "mxfp8":
        raise NotImplementedError(
            "precision: 'mxfp8' (e4m3 with 1x32 UE8M0 scales) needs a Blackwell (sm_100) GPU and is not built in "
            f"this build of primemoe; available: {BUILT_PRECISIONS}")
    if precision not in BUILT_PRECISIONS:
        raise NotImplementedError(
            f"precision: {precision!r} has no kernels in this build of primemoe; available: {BUILT_PRECISIONS}")
    return precision


def check_moe_inputs(x, topk_idx, topk_weights, w1, w2, *, precision="bf16", num_ranks=1, max_tokens=None) -> MoeShape:
    """Validate the arguments of ``primemoe.moe`` and return the problem's sizes."""
    x = _tensor("x", x)
    topk_idx = _tensor("topk_idx", topk_idx)
    topk_weights = _tensor("topk_weights", topk_weights)
    w1 = _tensor("w1", w1)
    w2 = _tensor("w2", w2)
    check_precision(precision)

    _rank("x", x, 2, "[T, H]")
    _rank("topk_idx", topk_idx, 2, "[T, K]")
    _rank("topk_weights", topk_weights, 2, "[T, K]")
    _rank("w1", w1, 3, "[E_local, 2I, H]")
    _rank("w2", w2, 3, "[E_local, H, I]")

    T, H = x.shape
    local_experts, two_i, w1_h = w1.shape
    if topk_idx.shape[0] != T:
        raise ValueError(f"topk_idx: expected {T} rows (one per token of x), got shape {tuple(topk_idx.shape)}")
    K = topk_idx.shape[1]
    if K < 1:
        raise ValueError(f"topk_idx: expected at least one slot per token, got shape {tuple(topk_idx.shape)}")
    if tuple(topk_weights.shape) != (T, K):
        raise ValueError(f"topk_weights: expected shape {(T, K)} like topk_idx, got {tuple(topk_weights.shape)}")
    if local_experts < 1:
        raise ValueError(f"w1: expected at least one local expert, got shape {tuple(w1.shape)}")
    if w1_h != H:
        raise ValueError(f"w1: expected shape [E_local, 2I, {H}] (H from x), got {tuple(w1.shape)}")
    if two_i < 2 or two_i % 2:
        raise ValueError(f"w1: expected an even, non-zero second dim 2I (gate rows then up rows), got {two_i}")
    inter = two_i // 2
    if tuple(w2.shape) != (local_experts, H, inter):
        raise ValueError(f"w2: expected shape {(local_experts, H, inter)} = [E_local, H, I] from w1, "
                         f"got {tuple(w2.shape)}")

    if topk_idx.dtype not in _INDEX_DTYPES:
        raise TypeError(f"topk_idx: expected dtype int64 or int32, got {topk_idx.dtype}")
    if topk_weights.dtype not in _WEIGHT_DTYPES:
        raise TypeError(f"topk_weights: expected dtype float32 or bfloat16, got {topk_weights.dtype}")
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16:
            raise TypeError(f"x: expected dtype bfloat16 on CUDA, got {x.dtype}")
    elif not x.is_floating_point():
        raise TypeError(f"x: expected a floating dtype (bfloat16 on CUDA), got {x.dtype}")
    for name, t in (("w1", w1), ("w2", w2)):
        if t.dtype != x.dtype:
            raise TypeError(f"{name}: expected dtype {x.dtype} (the dtype of x), got {t.dtype}")

    for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights), ("w1", w1), ("w2", w2)):
        if t.device != x.device:
            raise ValueError(f"{name}: expected device {x.device} (the device of x), got {t.device}")
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights), ("w1", w1), ("w2", w2)):
        _contiguous(name, t)

    if precision in FP8_PRECISIONS:
        check_fp8_problem(H, inter)

    if x.device.type == "cuda":
        # 16-byte row alignment for TMA and the grouped GEMMs.
        if H % 8:
            raise ValueError(f"x: hidden size H={H} is not supported on CUDA: expected a multiple of 8")
        if inter % 8:
            raise ValueError(f"w1: intermediate size I={inter} is not supported on CUDA: expected a multiple of 8")
        # Traced tensors have no data (the ops check again when they run).
        for name, t in () if torch.compiler.is_compiling() else (("x", x), ("w1", w1), ("w2", w2)):
            if t.data_ptr() % 16:
                raise ValueError(f"{name}: expected 16-byte aligned data on CUDA (the kernels load rows in 16-byte "
                                 f"vectors), got a view {t.data_ptr() % 16} bytes past a boundary: pass a copy")
        major, _ = torch.cuda.get_device_capability(x.device)
        if major < 9:
            raise NotImplementedError("x: primemoe needs an sm_90 (Hopper) or newer GPU, "
                                      f"got sm_{major}x on {x.device}")
        if precision in FP8_PRECISIONS:
            check_fp8_device(x.device)

    if max_tokens is not None and T > max_tokens:
        raise ValueError(f"x: {T} tokens exceed the buffer's capacity max_tokens_per_rank={max_tokens}")

    shape = MoeShape(T, H, inter, K, local_experts, local_experts * num_ranks)
    if debug_enabled():
        check_expert_ids(topk_idx, shape.num_experts)
    return shape


def debug_enabled() -> bool:
    return os.environ.get("PRIMEMOE_DEBUG", "0") not in ("", "0")


def check_expert_ids(topk_idx: torch.Tensor, num_experts: int) -> None:
    """Eager, host-synchronising id check used with PRIMEMOE_DEBUG=1."""
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    if bool(bad.any()):
        pos = bad.nonzero()[0]
        t, k = int(pos[0]), int(pos[1])
        raise ValueError(
            f"topk_idx[{t}, {k}] = {int(topk_idx[t, k])} is not an expert id: expected -1 or a value in "
            f"[0, {num_experts})"
        )


def check_fp8_device(device: torch.device) -> None:
    """The blockwise FP8 kernels are sm_90 (Hopper wgmma) kernels: NotImplementedError naming ``x`` elsewhere."""
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        raise NotImplementedError(f"x: blockwise FP8 needs an sm_90 (Hopper) GPU, got sm_{major}{minor} on {device} "
                                  "(precision 'bf16' runs here)")


def check_fp8_buffer(hidden: int, intermediate: int, row_align: int) -> None:
    """A Buffer made for an FP8 precision: H and I multiples of 128 and a receive layout whose experts start at
    multiples of 128 rows (the 128x1 weight-gradient tiles start at each expert's first row)."""
    block = 128
    for name, value in (("hidden", hidden), ("intermediate", intermediate), ("row_align", row_align)):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0 and value % block:
            raise ValueError(f"{name}: expected a multiple of {block} with an FP8 precision (the recipe's 128-wide "
                             f"tiles), got {value}")


def check_fp8_problem(hidden: int, intermediate: int) -> None:
    """The blockwise FP8 recipe's sizes (DESIGN.md section 2): 1x128 tiles of x / dy along H and of the
    SwiGLU output along I, 128x128 blocks of w1 [2I, H] and w2 [H, I], so H and I must be multiples of 128.
    Raises ValueError naming the argument the size comes from (x for H, w1 for I)."""
    block = 128
    if hidden % block:
        raise ValueError(f"x: hidden size H={hidden} is not supported with FP8: expected a multiple of {block} "
                         f"(the recipe's 1x128 tiles and 128x128 weight blocks)")
    if intermediate % block:
        raise ValueError(f"w1: intermediate size I={intermediate} is not supported with FP8: expected a multiple "
                         f"of {block} (the recipe's 1x128 tiles and 128x128 weight blocks)")
