"""Scaling model of the expert-parallel layer: per-GPU time of one layer's forward and backward at EP = W from
measured rates (the single-GPU layer's TFLOP/s, the NVSHMEM dispatch/combine's NVLink GB/s) and a published
InfiniBand rate, sequential (dispatch, GEMMs, combine one after another) against overlapped (communication hidden
behind the GEMMs in per-expert chunks), bf16 against FP8 dispatch, and which resource binds.

    python scripts/scaling_model.py [--tokens 16384] [--markdown]

The model (uniform routing, every rank T tokens, K slots each, E experts over W ranks, 8 GPUs per node):
- Compute: forward 6 T K H I and backward 12 T K H I FLOPs per GPU at the single-GPU layer's measured user-path
  rate (EP = 1 includes the row kernels the EP path replaces with dispatch/combine: close enough at this level).
- Traffic per GPU and direction: forward dispatch T K rows of x (bf16: 2H bytes; FP8: H + 4 H / 128 with the
  scales) and combine T K result rows (bf16); backward dispatch of dy (FP8 in "fp8") and combine of dx (bf16).
  A slot's row stays local with probability 1 / W, goes over NVLink to one of the node's other GPUs with
  (min(W, 8) - 1) / W, over InfiniBand with (W - min(W, 8)) / W; NVLink and InfiniBand run at once, so a phase
  takes the longer of the two. "dedup" sends a token's row once per remote node that holds any of its experts
  (node-level deduplication, then forwarded over NVLink inside the node): (N - 1) (1 - (1 - 1/N)^K) rows per
  token over InfiniBand for N nodes, instead of K (N - 1) / N.
- Sequential: compute + dispatch + combine. Overlapped: a pipeline of E / W expert chunks, max(compute, comm) +
  min(compute, comm) / chunks (the first chunk's rows before FC1 can start, the last chunk's results after FC2).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

GPUS_PER_NODE = 8

# Measured on one H200 (benchmarks/RESULTS.md): the layer's user path, T = 16384, forward / backward TFLOP/s.
MEASURED_TFLOPS = {
    ("qwen3-235b-a22b", "bf16"): (622.4, 594.2),
    ("qwen3-235b-a22b", "fp8"): (733.2, 593.2),
    ("qwen3-30b-a3b", "bf16"): (573.3, 568.6),
    ("qwen3-30b-a3b", "fp8"): (585.2, 512.1),
}
# The NVSHMEM dispatch / combine between two H200s over NVLink (RESULTS.md, `--comm`, 16 SMs): GB/s per direction.
NVLINK_GBPS = 320.0
# InfiniBand NDR 400 Gb/s per GPU = 50 GB/s per direction; ~45 GB/s is what RDMA all-to-all kernels report reaching.
IB_GBPS = 45.0

SHAPES = {  # H, I, E, K (python/primemoe/shapes.py)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
}


@dataclass(frozen=True)
class Point:
    shape: str
    world: int
    precision: str  # the GEMMs' and the dispatch's: "bf16" or "fp8"
    dedup: bool
    compute_ms: tuple[float, float]
    comm_ms: tuple[float, float]
    sequential_ms: tuple[float, float]
    overlapped_ms: tuple[float, float]
    tflops: tuple[float, float]  # per GPU, overlapped
    binds: tuple[str, str]


def row_bytes(hidden: int, fp8: bool) -> float:
    return hidden + 4 * hidden / 128 if fp8 else 2 * hidden


def remote_rows_per_token(world: int, top_k: int, dedup: bool) -> tuple[float, float]:
    """(rows over NVLink, rows over InfiniBand) a token sends, on average."""
    node = min(world, GPUS_PER_NODE)
    nvlink = top_k * (node - 1) / world
    nodes = math.ceil(world / GPUS_PER_NODE)
    if nodes == 1:
        return nvlink, 0.0
    if dedup:
        ib = (nodes - 1) * (1 - (1 - 1 / nodes) ** top_k)
        # Each deduplicated row is forwarded inside its node to the experts' GPUs there: extra NVLink rows.
        nvlink += top_k * (world - node) / world
    else:
        ib = top_k * (world - node) / world
    return nvlink, ib


def phase_ms(tokens: int, hidden: int, top_k: int, world: int, fp8: bool, dedup: bool) -> tuple[float, str]:
    """One dispatch or combine phase: (ms, the link that binds)."""
    nvlink_rows, ib_rows = remote_rows_per_token(world, top_k, dedup)
    nbytes = tokens * row_bytes(hidden, fp8)
    t_nvl = nbytes * nvlink_rows / (NVLINK_GBPS * 1e6)
    t_ib = nbytes * ib_rows / (IB_GBPS * 1e6)
    return (t_ib, "InfiniBand") if t_ib > t_nvl else (t_nvl, "NVLink")


def model(shape: str, tokens: int, world: int, precision: str, dedup: bool = False) -> Point:
    H, I, E, K = SHAPES[shape]
    if E % world:
        raise ValueError(f"{shape}: E = {E} experts do not divide over {world} ranks")
    fwd_rate, bwd_rate = MEASURED_TFLOPS[(shape, precision)]
    flops = (6 * tokens * K * H * I, 12 * tokens * K * H * I)
    compute = (flops[0] / (fwd_rate * 1e9), flops[1] / (bwd_rate * 1e9))
    fp8 = precision == "fp8"
    if world == 1:
        comm, links = (0.0, 0.0), ("-", "-")
    else:
        d_f, link_f = phase_ms(tokens, H, K, world, fp8, dedup)        # x dispatched
        c_f, _ = phase_ms(tokens, H, K, world, False, dedup)           # results combined in bf16
        d_b, link_b = phase_ms(tokens, H, K, world, fp8, dedup)        # dy dispatched
        c_b, _ = phase_ms(tokens, H, K, world, False, dedup)           # dx combined in bf16
        comm, links = (d_f + c_f, d_b + c_b), (link_f, link_b)
    chunks = E // world
    sequential = tuple(c + m for c, m in zip(compute, comm))
    overlapped = tuple(max(c, m) + min(c, m) / chunks for c, m in zip(compute, comm))
    binds = tuple("compute" if c >= m else link for c, m, link in zip(compute, comm, links))
    tflops = tuple(f / (t * 1e9) for f, t in zip(flops, overlapped))
    return Point(shape, world, precision, dedup, compute, comm, sequential, overlapped, tflops, binds)


def table(tokens: int, worlds=(1, 2, 8, 16, 32, 64)) -> str:
    lines = [
        f"T = {tokens} tokens per GPU; ms per layer, forward / backward; NVLink {NVLINK_GBPS:.0f} GB/s, "
        f"InfiniBand {IB_GBPS:.0f} GB/s per GPU and direction.",
        "",
        "| shape | EP | dispatch | compute | communication | sequential | overlapped | TFLOP/s (overlapped) | binds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda pair, digits=2: f"{pair[0]:.{digits}f} / {pair[1]:.{digits}f}"  # noqa: E731
    for shape in SHAPES:
        for world in worlds:
            variants = [("bf16", False), ("fp8", False)] + ([("fp8", True)] if world > GPUS_PER_NODE else [])
            for precision, dedup in variants:
                p = model(shape, tokens, world, precision, dedup)
                label = precision + (" + node dedup" if dedup else "")
                lines.append(f"| {shape} | {world} | {label} | {fmt(p.compute_ms)} | {fmt(p.comm_ms)} | "
                             f"{fmt(p.sequential_ms)} | {fmt(p.overlapped_ms)} | {fmt(p.tflops, 0)} | "
                             f"{p.binds[0]} / {p.binds[1]} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args(argv)
    print(table(args.tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
