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
    assert by_label["qwen3-30b-a3b T=4096 EP=2 bf16 primemoe"].endswith("run")  # through primemoe.Buffer
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
    assert _run_bench("--dry-run", "--settle", "-1").returncode == 2
    assert _run_bench("--dry-run", "--settle", "nan").returncode == 2


def test_settle_is_in_the_timing_note():
    """Every timed case idles first (the communication cases go through the same timing loop)."""
    assert "2 s idle before each case" in bench._timing_note(bench.parse_args([]))
    assert "5 s idle before each case" in bench._timing_note(bench.parse_args(["--comm", "--settle", "5"]))
    assert "0.5 s idle" in bench._timing_note(bench.parse_args(["--settle", "0.5"]))


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
    na = bench._result(cases[5], "n/a", cases[5].skip)
    assert cases[5].impl == "reference" and cases[5].ep == 2
    text = bench.format_table([ok, na])
    assert "1.000" in text and "n/a: single GPU only" in text
    md = bench.format_table([ok, na], markdown=True)
    assert md.count("\n") == 3 and md.startswith("| shape |")


def test_dry_run_lists_comm_cases_with_sm_counts():
    out = _run_bench("--dry-run", "--comm", "--shapes", "qwen3-30b-a3b", "--tokens", "4096", "8192", "--ep", "1", "2")
    assert out.returncode == 0, out.stderr
    lines = [line.strip() for line in out.stdout.splitlines()]
    assert lines[0].startswith("skip EP=1:") and "EP > 1" in lines[0]
    assert lines[1] == "10 communication cases (routed bytes per rank and direction):"
    labels = [" ".join(c.split("  ")[0].split()) for c in lines[2:]]
    impls = ("primemoe 8 SMs", "primemoe 16 SMs", "primemoe 24 SMs", "nccl", "symm_mem")
    assert labels == [f"qwen3-30b-a3b T={t} EP=2 {impl}" for impl in impls for t in (4096, 8192)]
    assert all(c.endswith("run") for c in lines[2:])
    assert "268.4 MB" in lines[3]  # 8192 tokens x 8 slots x 2048 x 2 bytes


def test_dry_run_comm_options():
    out = _run_bench("--dry-run", "--comm", "--shapes", "qwen3-30b-a3b", "deepseek-v3", "--tokens", "16",
                     "--ep", "2", "3", "--num-sms", "12")
    assert out.returncode == 0, out.stderr
    cases = [line.strip() for line in out.stdout.splitlines()[1:]]
    assert len(cases) == 12 and not any("skip EP=1" in line for line in out.stdout.splitlines())
    assert sum("primemoe 12 SMs" in c for c in cases) == 4 and not any("24 SMs" in c for c in cases)
    assert all("do not split over EP=3" in c for c in cases if "EP=3" in c)
    # symm_mem runs in processes of its own: its cases come after the others of the same EP size.
    ep2 = [c for c in cases if "EP=2" in c]
    assert [("symm_mem" in c) for c in ep2] == [False] * 4 + [True] * 2


def test_comm_bytes():
    topk_idx = torch.tensor([[0, 3], [2, -1], [1, 2], [-1, 1]])  # 2 experts per rank
    remote = bench.remote_rows(topk_idx, experts_per_rank=2, rank=0)
    assert bench.direction_bytes(remote, hidden=8) == 3 * 8 * 2
    assert bench.direction_bytes(int((topk_idx >= 0).sum()), hidden=8) == 6 * 8 * 2  # incl. the local copy
    assert bench.nvlink_bytes(remote, hidden=8) == 2 * bench.direction_bytes(remote, hidden=8)


def _comm_cases(*argv):
    return bench.build_comm_cases(bench.parse_args(["--comm", "--shapes", "qwen3-30b-a3b", *argv]))


def test_comm_summary_is_slowest_rank_then_median():
    case = next(c for c in _comm_cases("--tokens", "8192", "--ep", "2") if c.num_sms == 8)
    H = bench.SHAPES["qwen3-30b-a3b"][0]
    outcomes = [dict(fwd=[1.0, 0.5, 0.5], bwd=[2.0, 2.0, 1.0], routed_rows=100, remote_rows=40),
                dict(fwd=[0.2, 1.0, 0.5], bwd=[1.0, 3.0, 4.0], routed_rows=100, remote_rows=60)]
    r = bench._summarize(case, outcomes)
    assert r["status"] == "ok" and r["num_sms"] == 8 and r["impl"] == "primemoe"
    assert r["dispatch_ms"] == 1.0 and r["combine_ms"] == 3.0  # per-iteration max: [1, 1, .5], [2, 3, 4]
    assert r["remote_mb"] == 50 * H * 2 / 1e6 and r["total_mb"] == 100 * H * 2 / 1e6
    assert r["dispatch_gbps"] == pytest.approx(50 * H * 2 / 1.0 / 1e6)
    assert r["combine_gbps"] == pytest.approx(50 * H * 2 / 3.0 / 1e6)
    assert r["target"] == ">= 300: missed"
    line = case.summary(r)
    assert "dispatch 1.000 ms" in line and "target >= 300: missed" in line


def test_comm_targets():
    cases = {(c.impl, c.num_sms, c.tokens): c for c in _comm_cases("--tokens", "4096", "8192", "--ep", "2",
                                                                   "--num-sms", "24", "32")}
    assert bench.comm_target(cases["primemoe", 24, 8192], 310.0) == ">= 300: met"
    assert bench.comm_target(cases["primemoe", 24, 4096], 310.0) is None  # below 8192 tokens
    assert bench.comm_target(cases["primemoe", 32, 8192], 310.0) is None  # more than 24 SMs
    assert "255" in bench.comm_target(cases["nccl", None, 8192], 200.0)
    assert bench.comm_target(cases["symm_mem", None, 8192], 200.0) is None


def test_symm_mem_failure_is_na_and_comm_table():
    cases = _comm_cases("--tokens", "16", "--ep", "2")
    symm = next(c for c in cases if c.impl == "symm_mem")
    na = bench._summarize(symm, [{"error": "RuntimeError: no NVSHMEM", "status": symm.spec().failure},
                                 {"error": "RuntimeError: no NVSHMEM", "status": "n/a"}])
    assert na["status"] == "n/a" and na["note"] == "rank 0: RuntimeError: no NVSHMEM"
    nccl = next(c for c in cases if c.impl == "nccl")
    failed = bench._summarize(nccl, [{"fwd": [1.0], "bwd": [1.0], "routed_rows": 1, "remote_rows": 1},
                                     {"error": "RuntimeError: boom", "status": nccl.spec().failure}])
    assert failed["status"] == "error" and failed["note"] == "rank 1: RuntimeError: boom"
    ok = bench._result(cases[0], "ok", dispatch_ms=0.5, dispatch_gbps=310.0, combine_ms=0.6, combine_gbps=290.0,
                       remote_mb=150.0, total_mb=300.0, target=">= 300: missed")
    text = bench.format_table([ok, na, failed], columns=bench.COMM_COLUMNS)
    lines = text.splitlines()
    assert "dispatch GB/s" in lines[0] and "310.0" in lines[2] and ">= 300: missed" in lines[2]
    assert lines[3].count("n/a") >= 7 and lines[3].endswith("n/a: rank 0: RuntimeError: no NVSHMEM")
    md = bench.format_table([ok, na], markdown=True, columns=bench.COMM_COLUMNS)
    assert md.count("\n") == 3 and md.startswith("| shape |")


def test_git_commit_falls_back_to_the_environment_without_a_checkout(monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(bench.subprocess, "run", no_git)
    monkeypatch.setenv("PRIMEMOE_GIT_COMMIT", "abc1234")
    assert bench._git_commit() == "abc1234"
    monkeypatch.delenv("PRIMEMOE_GIT_COMMIT")
    assert bench._git_commit() is None


def test_boards_record_power_limit_and_clock_by_uuid(monkeypatch):
    """Visible GPUs in torch's order, matched to nvidia-smi's rows by UUID (its order is physical)."""
    class Props:
        def __init__(self, uuid):
            self.uuid = uuid

    visible = ["bb9114cd-27cc-92a9-e3bc-10e3091ac543", "GPU-e660027b-6ea3-d845-a8ed-5da0a8404e81"]
    monkeypatch.setattr(bench.torch.cuda, "device_count", lambda: len(visible))
    monkeypatch.setattr(bench.torch.cuda, "get_device_properties", lambda i: Props(visible[i]))
    smi = ("GPU-e660027b-6ea3-d845-a8ed-5da0a8404e81, 700.00, 1980\n"
           "GPU-bb9114cd-27cc-92a9-e3bc-10e3091ac543, [N/A], 1980\n")
    monkeypatch.setattr(bench.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=smi, stderr=""))
    found = bench.boards()
    assert found == [
        {"uuid": "GPU-bb9114cd-27cc-92a9-e3bc-10e3091ac543", "power_limit_w": None, "max_sm_clock_mhz": 1980.0},
        {"uuid": "GPU-e660027b-6ea3-d845-a8ed-5da0a8404e81", "power_limit_w": 700.0, "max_sm_clock_mhz": 1980.0}]
    assert bench._board_note(found) == ("GPU-bb9114cd-27cc-92a9-e3bc-10e3091ac543 (1980 MHz); "
                                        "GPU-e660027b-6ea3-d845-a8ed-5da0a8404e81 (700 W, 1980 MHz)")

    def no_smi(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(bench.subprocess, "run", no_smi)
    assert bench.boards() == [{"uuid": "GPU-bb9114cd-27cc-92a9-e3bc-10e3091ac543"},
                              {"uuid": "GPU-e660027b-6ea3-d845-a8ed-5da0a8404e81"}]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_rendezvous_is_a_file_store_removed_afterwards():
    """EP ranks meet over a file store in a fresh directory (no TCP port to lose to another process)."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    with bench.rendezvous() as init_method:
        assert init_method.startswith("file://")
        directory = os.path.dirname(init_method[len("file://"):])
        dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=1)
        try:
            value = torch.ones(1)
            dist.all_reduce(value)
            assert value.item() == 1.0
        finally:
            dist.destroy_process_group()
    assert not os.path.exists(directory)


def _put_rank(rank, results):
    results.put((rank, 10 * rank))


def _rank_1_fails(rank, results):
    if rank == 1:
        raise RuntimeError("rank 1 fails")
    results.put((rank, "ok"))


def test_join_ranks_collects_every_result_and_ends_on_a_failing_rank():
    """The EP benchmark's and comm_profile's join: every rank's result, and a rank that raises ends the join
    with its error instead of leaving the parent waiting for its result."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    items, failure = bench.join_ranks(mp.start_processes(_put_rank, args=(results,), nprocs=2, join=False,
                                                         start_method="spawn"), results)
    assert sorted(items) == [(0, 0), (1, 10)] and failure is None
    results = ctx.Queue()
    items, failure = bench.join_ranks(mp.start_processes(_rank_1_fails, args=(results,), nprocs=2, join=False,
                                                         start_method="spawn"), results)
    assert failure is not None and "rank 1 fails" in failure and (1, "ok") not in items
