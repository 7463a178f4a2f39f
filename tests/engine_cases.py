"""Operands of the expert GEMM engine's ops (fc1_swiglu, expert_gemm, fc2_dgrad_swiglu,
expert_wgrad) in the routing layout they run on: each expert's rows padded with zero
rows to a multiple of ROW_ALIGN, weight 0 on padding rows, a few unused rows at the end."""

from dataclasses import dataclass

import torch

from primemoe.ops import ROW_ALIGN


@dataclass
class EngineOperands:
    offsets: torch.Tensor  # int32 [E + 1]
    counts: torch.Tensor  # int32 [E]: routed rows per expert (the layout's expert_counts)
    xs: torch.Tensor  # [R, H]
    h: torch.Tensor  # [R, 2I]
    a: torch.Tensor  # [R, I]
    dy_rows: torch.Tensor  # [R, H]
    row_weight: torch.Tensor  # fp32 [R]
    w1: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]

    @property
    def routed_rows(self) -> int:
        return int(self.offsets[-1])


def engine_operands(counts, hidden, inter, *, seed=0, device="cpu", spare_rows=37) -> EngineOperands:
    gen = torch.Generator("cpu").manual_seed(seed)
    padded = [(c + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN for c in counts]
    offsets = torch.tensor([0] + padded, dtype=torch.int64).cumsum(0).to(torch.int32)
    total = int(offsets[-1]) + spare_rows
    routed = torch.zeros(total, dtype=torch.bool)
    for e, c in enumerate(counts):
        routed[int(offsets[e]):int(offsets[e]) + c] = True

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    def rows(width, scale=1.0):
        return (randn(total, width, scale=scale) * routed.unsqueeze(1)).bfloat16().to(device)

    E = len(counts)
    return EngineOperands(
        offsets=offsets.to(device),
        counts=torch.tensor(counts, dtype=torch.int32).to(device),
        xs=rows(hidden),
        h=rows(2 * inter, scale=2.0),
        a=rows(inter),
        dy_rows=rows(hidden),
        row_weight=(torch.rand(total, generator=gen) * routed).to(device),
        w1=randn(E, 2 * inter, hidden, scale=hidden ** -0.5).bfloat16().to(device),
        w2=randn(E, hidden, inter, scale=inter ** -0.5).bfloat16().to(device),
    )
