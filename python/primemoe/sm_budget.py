"""The SM budget of primemoe's expert GEMMs (DeepGEMM's ``set_num_sms`` / ``get_num_sms``).

The GEMMs are persistent kernels, one CTA per SM: by default their grid spans every SM of the device.
``set_num_sms(n)`` caps it at ``n`` SMs, process-wide, leaving the rest to work that runs beside them (another
stream's communication, e.g. prime-rl's reserved SMs). The expert-parallel path splits the budget itself: a GEMM
that runs alongside a Buffer's dispatch takes the budget less the Buffer's ``num_sms`` (static tile order) or
claims its tiles over the whole budget. The budget changes no result: every tile is computed the same way
whichever CTA takes it.
"""

from __future__ import annotations

import torch

from . import _C  # noqa: F401  (loads the library that defines the schemas)

__all__ = ["set_num_sms", "get_num_sms"]


def set_num_sms(n: int) -> None:
    """Cap the expert GEMMs' grid at ``n`` SMs (a positive int; ``None`` restores every SM)."""
    if n is None:
        torch.ops.primemoe._set_num_sms(0)
        return
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"set_num_sms: expected an int or None, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"set_num_sms: expected a positive int, got {n}")
    torch.ops.primemoe._set_num_sms(n)


def get_num_sms(device=None):
    """The SMs the expert GEMMs take on ``device`` (default: the current CUDA device): the budget, or the device's
    SM count where that is fewer or no budget is set. Without CUDA: the budget, or None when none is set."""
    budget = torch.ops.primemoe._num_sms_budget()
    if not torch.cuda.is_available():
        return budget or None
    index = None if device is None else torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    return min(budget, sms) if budget else sms
