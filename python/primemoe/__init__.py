"""primemoe: a fused, overlapped Mixture-of-Experts layer for training.

    y = primemoe.moe(x, topk_idx, topk_weights, w1, w2)            # differentiable
    topk_idx, topk_weights = primemoe.route(logits, top_k)

See DESIGN.md section 1 for the exact computation and README.md for usage.
"""

from __future__ import annotations

from importlib import metadata as _metadata

import torch

from . import ops  # noqa: F401  (registers the torch.ops.primemoe kernels)
from . import baseline, ep, reference
from ._validate import check_moe_inputs
from .buffer import Buffer
from .routing import route

try:
    __version__ = _metadata.version("primemoe")
except _metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0.1.0+source"

__all__ = ["moe", "route", "Buffer", "check_errors", "DeviceError", "reference", "baseline", "nn"]


class DeviceError(RuntimeError):
    """An error a primemoe kernel recorded on the GPU (e.g. an out-of-range expert id)."""


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
        return ep.moe(x, topk_idx, topk_weights, w1, w2, buffer=buffer, precision=precision, keep_fc1=keep_fc1)
    check_moe_inputs(x, topk_idx, topk_weights, w1, w2, precision=precision)
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weights, w1, w2))
    y, _ = torch.ops.primemoe.moe_forward(x, topk_idx, topk_weights, w1, w2, precision, keep_fc1 and wants_grad)
    return y


def check_errors(device=None) -> None:
    """Raise (and clear) the first error the kernels recorded on ``device`` since
    the last check. Synchronises that device so every launched kernel is counted."""
    if not torch.cuda.is_available():
        return
    index = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    torch.cuda.synchronize(index)
    record = torch.ops.primemoe._take_error(index.index if index.index is not None else torch.cuda.current_device())
    if record:
        raise DeviceError(torch.ops.primemoe._describe_error(record))


from . import nn  # noqa: E402,F401  (nn.MoE calls moe)
