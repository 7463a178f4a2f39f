"""The model shapes the benchmark, the main job and the tests use (DESIGN.md section 1): the one place they are
written down."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MoEShape", "MODEL_SHAPES", "TARGET_SHAPES"]


@dataclass(frozen=True)
class MoEShape:
    """An MoE layer's sizes: hidden H, expert intermediate I, experts E (over all ranks), experts per token K."""

    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int

    @property
    def dims(self) -> tuple:
        """``(H, I, E, K)``."""
        return self.hidden, self.intermediate, self.experts, self.top_k


MODEL_SHAPES = {s.name: s for s in (
    MoEShape("qwen3-30b-a3b", hidden=2048, intermediate=768, experts=128, top_k=8),
    MoEShape("qwen3-235b-a22b", hidden=4096, intermediate=1536, experts=128, top_k=8),
    MoEShape("deepseek-v3", hidden=7168, intermediate=2048, experts=256, top_k=8),
)}

# The shapes the performance targets are set at (the benchmark's default).
TARGET_SHAPES = ("qwen3-30b-a3b", "qwen3-235b-a22b")
