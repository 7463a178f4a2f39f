"""Sizes the C++ layer defines, read once from the extension instead of restated here.

- ``ROW_ALIGN``: ``kGemmRowAlign`` (csrc/gemm/grouped_gemm.cuh), the expert row alignment the GEMM
  engine takes (its half-tile height): dispatch_layout's ``row_align`` for the engine's row space.
- ``TILE_N``: ``kGemmTileN``, output columns of a GEMM tile (``fc2_dgrad_swiglu``'s ``dot`` has
  ``I / TILE_N`` columns).
- ``SWIGLU_TILE_N``: ``gemm_tile_n(kSwiGLU)``, FC1's activation columns per tile.
- ``MAX_LOCAL_EXPERTS``: ``kLayoutMaxLocalExperts`` (csrc/kernels/dispatch_layout.cuh), the most experts
  one layout spans (an expert-parallel group's send layout spans all of its experts).
- ``layout_max_rows(num_slots, local_experts, row_align)``: rows of dispatch_layout's ``row_to_slot``.

And one of the Python layer's own: ``FP8_ROW_ALIGN``.
"""

from __future__ import annotations

import torch

from . import _C  # noqa: F401  (loads the library that defines the ops)

_lib = torch.ops.primemoe

ROW_ALIGN: int = _lib._constant("gemm_row_align")
TILE_N: int = _lib._constant("gemm_tile_n")
SWIGLU_TILE_N: int = _lib._constant("gemm_swiglu_tile_n")
MAX_LOCAL_EXPERTS: int = _lib._constant("layout_max_local_experts")

# The row alignment of the FP8 layout (precision "fp8", and the backward of "fp8_bwd"): each expert's rows padded
# with zero rows to a multiple of 128, so that the 128x1 tiles of the weight-gradient operands (quantize_fp8_128x1,
# fp8_expert_wgrad) start at each expert's first row and never straddle two experts (reference._FP8_SPEC, step 12:
# an expert's rows padded to 128 * ceil(n / 128)); a multiple of ROW_ALIGN, so the bf16 engine runs on it too.
# The FP8 recipe's tile size (fp8.BLOCK), not a size of the C++ layer.
FP8_ROW_ALIGN: int = 128


def layout_max_rows(num_slots, local_experts, row_align):
    """Every slot routed here plus a partial tile per expert (``layout_max_rows`` of dispatch_layout.cuh).
    Symbolic sizes (torch.compile's fake kernels) get the same bound as an expression (tests/test_packaging.py
    compares the two)."""
    if all(type(v) is int for v in (num_slots, local_experts, row_align)):
        return _lib._layout_max_rows(num_slots, local_experts, row_align)
    return num_slots + local_experts * (row_align - 1)
