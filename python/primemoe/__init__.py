"""primemoe: a fused, overlapped Mixture-of-Experts layer for training.

    y = primemoe.moe(x, topk_idx, topk_weights, w1, w2)            # differentiable
    topk_idx, topk_weights = primemoe.route(logits, top_k)

See DESIGN.md section 1 for the exact computation and README.md for usage.
"""

from __future__ import annotations

import torch

from . import _runtime

_runtime.check()  # before the extension loads: a CUDA-major or NVSHMEM mismatch is a clear ImportError

from . import ops  # noqa: E402, F401  (registers the torch.ops.primemoe kernels)
from . import baseline, ep, layer, nn, reference  # noqa: E402
from .buffer import Buffer
from .layer import moe
from .routing import route
from .sm_budget import get_num_sms, set_num_sms

__version__ = _runtime.version()

__all__ = ["moe", "route", "Buffer", "check_errors", "DeviceError", "reference", "baseline", "nn", "set_num_sms",
           "get_num_sms"]


class DeviceError(RuntimeError):
    """An error a primemoe kernel recorded on the GPU (e.g. an out-of-range expert id)."""


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
