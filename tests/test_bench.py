"""CPU checks of the benchmark harness: the case list (--dry-run) and its metrics."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import PRIMEMOE_ROOT

from primemoe import bench

REPO = Path(__file__).resolve().parents[1]


def _run_bench(*args):
    # The subprocess must import the same primemoe as this one (installed or source tree).
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PRIMEMOE_ROOT, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "primemoe.bench", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_dry_run_lists_cases():
    out = _run_bench("--dry-run", "--shapes", "qwen3-30b-a3b", "--tokens", "4096", "8192", "--ep", "1", "2")
    assert out.returncode == 0, out.stderr
    lines = [line.strip() for line in out.stdout.splitlines()]
    assert lines[0] == "12 cases (FLOPs per rank):"
    cases = lines[1:]
    assert len(cases) == 12
    assert cases[0].startswith("qwen3-30b-a3b T=4096 EP=1 bf16 baseline")
    assert "fwd     309.2 GFLOP" in cases[0] and "bwd     618.5 GFLOP" in cases[0] and cases[0].endswith("run")
    by_label = {" ".join(c.split()[:5]): c for c in cases}
    assert by_label["qwen3-30b-a3b T=4096 EP=1 bf16 reference"].endswith("run")
    assert "n/a" in by_label["qwen3-30b-a3b T=8192 EP=1 bf16 reference"]  # above the smallest token count
    assert "n/a" in by_label["qwen3-30b-a3b T=4096 EP=2 bf16 primemoe"]
    assert "n/a" in by_label["qwen3-30b-a3b T=4096 EP=2 bf16 reference"]
    assert by_label["qwen3-30b-a3b T=8192 EP=2 bf16 baseline"].endswith("run")


def test_dry_run_options():
    out = _run_bench("--dry-run", "--shapes", "deepseek-v3", "--tokens", "16", "32", "--ep", "1",
                     "--impl", "reference", "baseline", "--precision", "bf16", "fp8", "--skip-reference-above", "32")
    assert out.returncode == 0, out.stderr
    cases = [line.strip() for line in out.stdout.splitlines()[1:]]
    assert len(cases) == 8
    assert all(c.endswith("run") for c in cases if " bf16 " in c)
    assert all("fp8 not supported" in c for c in cases if " fp8 " in c)


def test_bad_arguments_rejected():
    assert _run_bench("--dry-run", "--shapes", "no-such-model").returncode == 2
    assert _run_bench("--dry-run", "--tokens", "0").returncode == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_without_gpu_exits_2():
    out = _run_bench("--tokens", "16")
    assert out.returncode == 2
    assert "no CUDA GPU" in out.stderr


def test_flop_formulas():
    T, K, H, I = 4096, 8, 2048, 768
    assert bench.fwd_flops(T, K, H, I) == 6 * T * K * H * I == 309_237_645_312
    assert bench.bwd_flops(T, K, H, I) == 2 * bench.fwd_flops(T, K, H, I)


def test_remote_rows_and_nvlink_bytes():
    # 2 experts per rank: rank 0 owns experts 0-1, rank 1 owns 2-3; -1 slots are skipped.
    topk_idx = torch.tensor([[0, 3], [2, -1], [1, 2], [-1, 1]])
    assert bench.remote_rows(topk_idx, experts_per_rank=2, rank=0) == 3
    assert bench.remote_rows(topk_idx, experts_per_rank=2, rank=1) == 3
    assert bench.remote_rows(topk_idx, experts_per_rank=4, rank=0) == 0
    assert bench.nvlink_bytes(3, hidden=8) == 3 * 8 * 2 * 2  # bf16, dispatch + combine


def test_table_formats_results():
    args = bench.parse_args(["--shapes", "qwen3-30b-a3b", "--tokens", "16", "--ep", "1", "2"])
    cases = bench.build_cases(args)
    ok = bench._result(cases[0], "ok", fwd_ms=1.0, bwd_ms=2.0, fwd_tflops=10.0, bwd_tflops=20.0,
                       routed_rows=128, remote_rows=0)
    na = bench._result(cases[4], "n/a", cases[4].skip)
    assert cases[4].impl == "primemoe" and cases[4].ep == 2
    text = bench.format_table([ok, na])
    assert "1.000" in text and "n/a: EP>1 needs primemoe.Buffer" in text
    md = bench.format_table([ok, na], markdown=True)
    assert md.count("\n") == 3 and md.startswith("| shape |")
