"""scripts/scaling_model.py (docs/architecture.md's scaling model): the arithmetic it rests on."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "scaling_model", Path(__file__).resolve().parent.parent / "scripts" / "scaling_model.py")
sm = importlib.util.module_from_spec(_spec)
sys.modules["scaling_model"] = sm  # dataclasses look their module up
_spec.loader.exec_module(sm)


@pytest.mark.parametrize("shape", sorted(sm.SHAPES))
def test_one_rank_is_the_measured_layer(shape):
    for precision in ("bf16", "fp8"):
        p = sm.model(shape, 16384, 1, precision)
        assert p.comm_ms == (0.0, 0.0)
        assert p.sequential_ms == p.overlapped_ms == p.compute_ms
        assert p.tflops == pytest.approx(sm.MEASURED_TFLOPS[(shape, precision)])


def test_remote_rows_add_up():
    # Without dedup every slot that leaves the GPU goes over exactly one link.
    for world in (2, 8, 16, 64):
        nvl, ib = sm.remote_rows_per_token(world, 8, dedup=False)
        assert nvl + ib == pytest.approx(8 * (world - 1) / world)
    # Two nodes, K = 8: dedup sends a token's row to the other node iff any expert is there.
    _, ib = sm.remote_rows_per_token(16, 8, dedup=True)
    assert ib == pytest.approx(1 - 0.5 ** 8)
    assert sm.remote_rows_per_token(8, 8, dedup=True) == sm.remote_rows_per_token(8, 8, dedup=False)


def test_fp8_rows_are_about_half():
    assert sm.row_bytes(4096, True) / sm.row_bytes(4096, False) == pytest.approx((4096 + 128) / 8192)


@pytest.mark.parametrize("shape", sorted(sm.SHAPES))
def test_overlap_never_loses_and_is_bounded(shape):
    for world in (2, 8, 16, 32, 64):
        for precision, dedup in (("bf16", False), ("fp8", False), ("fp8", True)):
            p = sm.model(shape, 16384, world, precision, dedup)
            for c, m, s, o in zip(p.compute_ms, p.comm_ms, p.sequential_ms, p.overlapped_ms):
                assert s == pytest.approx(c + m)
                assert max(c, m) <= o <= s
            if dedup:
                plain = sm.model(shape, 16384, world, precision, False)
                assert all(a <= b + 1e-12 for a, b in zip(p.comm_ms, plain.comm_ms)) or world <= 8


def test_table_renders_every_row():
    text = sm.table(16384)
    rows = [line for line in text.splitlines() if line.startswith("| qwen3")]
    per_shape = 2 * 6 + 3  # bf16 and fp8 at six EP sizes, + node dedup at the three multi-node ones
    assert len(rows) == per_shape * len(sm.SHAPES)
    assert all(not math.isnan(float(cell.split(" / ")[0])) for row in rows for cell in row.split("|")[4:5])
