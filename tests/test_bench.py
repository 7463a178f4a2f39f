"""CPU checks of the benchmark harness: the case list (--dry-run), its metrics, the timing loop and the outputs
(CUDA events and memory statistics faked)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import PRIMEMOE_ROOT

from primemoe import bench
from primemoe.shapes import MODEL_SHAPES, TARGET_SHAPES, MoEShape

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
    cases, columns = lines[1:-1], lines[-1]
    assert len(cases) == 12
    assert cases[0].startswith("qwen3-30b-a3b T=4096 EP=1 bf16 baseline")
    assert "fwd     309.2 GFLOP" in cases[0] and "bwd     618.5 GFLOP" in cases[0] and cases[0].endswith("run")
    by_label = {" ".join(c.split()[:5]): c for c in cases}
    assert by_label["qwen3-30b-a3b T=4096 EP=1 bf16 reference"].endswith("run")
    # What is timed: the user path and the raw ops; the reference has no user path.
    assert all(" user+raw " in c for c in cases if " reference " not in c)
    assert all(" raw " in c and "user" not in c for c in cases if " reference " in c)
    # The user path's columns first (the headline), then memory, then the raw ops'.
    heads = columns.removeprefix("columns: ").split(", ")
    assert heads[5:16] == ["fwd ms", "bwd ms", "fwd TFLOP/s", "bwd TFLOP/s", "peak MiB", "peak/baseline", "saved MiB",
                           "raw fwd ms", "raw bwd ms", "raw fwd TFLOP/s", "raw bwd TFLOP/s"]
    assert "n/a" in by_label["qwen3-30b-a3b T=8192 EP=1 bf16 reference"]  # above the smallest token count
    assert by_label["qwen3-30b-a3b T=4096 EP=2 bf16 primemoe"].endswith("run")  # through primemoe.Buffer
    assert "n/a" in by_label["qwen3-30b-a3b T=4096 EP=2 bf16 reference"]
    assert by_label["qwen3-30b-a3b T=8192 EP=2 bf16 baseline"].endswith("run")


def test_dry_run_buffer_impls_run_at_ep1():
    out = _run_bench("--dry-run", "--shapes", "qwen3-30b-a3b", "--tokens", "4096", "--ep", "1", "2",
                     "--impl", "primemoe", "buffer", "buffer-seq")
    assert out.returncode == 0, out.stderr
    cases = [line.strip() for line in out.stdout.splitlines()[1:-1]]
    assert len(cases) == 6 and all(c.endswith("run") for c in cases)


def test_dry_run_options():
    out = _run_bench("--dry-run", "--shapes", "deepseek-v3", "--tokens", "16", "32", "--ep", "1",
                     "--impl", "reference", "baseline", "--precision", "bf16", "fp8", "--skip-reference-above", "32")
    assert out.returncode == 0, out.stderr
    cases = [line.strip() for line in out.stdout.splitlines()[1:-1]]
    assert len(cases) == 8
    assert all(c.endswith("run") for c in cases if " bf16 " in c)
    assert all("fp8 not supported" in c for c in cases if " fp8 " in c)


def test_dry_run_precision_cells():
    """Each precision a cell of its own: primemoe runs bf16, fp8 and fp8_bwd; the baseline bf16 only; mxfp8 is
    not built."""
    out = _run_bench("--dry-run", "--shapes", "qwen3-30b-a3b", "--tokens", "16", "--ep", "1", "--impl", "baseline",
                     "primemoe", "--precision", "bf16", "fp8", "fp8_bwd", "mxfp8")
    assert out.returncode == 0, out.stderr
    lines = [line.strip() for line in out.stdout.splitlines()]
    by_label = {" ".join(c.split()[3:5]): c for c in lines[1:-1]}
    assert len(by_label) == 8
    for precision in ("bf16", "fp8", "fp8_bwd"):
        assert by_label[f"{precision} primemoe"].endswith("run")
    assert by_label["bf16 baseline"].endswith("run")
    assert "n/a: fp8 not supported (only bf16)" in by_label["fp8 baseline"]
    assert "n/a: mxfp8 not supported (only bf16, fp8, fp8_bwd)" in by_label["mxfp8 primemoe"]
    assert "fwd x bf16" in lines[-1] and "bwd x bf16" in lines[-1]


def test_precision_ratios_are_to_the_same_impls_bf16():
    def result(impl, precision, fwd, bwd, tokens=16):
        return dict(shape="s", tokens=tokens, ep=1, impl=impl, precision=precision, user_fwd_ms=fwd, user_bwd_ms=bwd,
                    user_fwd_vs_bf16=None, user_bwd_vs_bf16=None)
    results = [result("baseline", "bf16", 4.0, 8.0), result("primemoe", "bf16", 2.0, 4.0),
               result("primemoe", "fp8", 1.0, 2.5), result("primemoe", "fp8_bwd", 2.0, None),
               result("primemoe", "fp8", 1.0, 1.0, tokens=32)]
    bench.add_precision_ratios(results)
    assert [(r["user_fwd_vs_bf16"], r["user_bwd_vs_bf16"]) for r in results] == [
        (None, None), (None, None), (2.0, 1.6), (1.0, None), (None, None)]


def test_dry_run_without_raw_ops():
    out = _run_bench("--dry-run", "--shapes", "qwen3-30b-a3b", "--tokens", "16", "--ep", "1", "--no-raw")
    assert out.returncode == 0, out.stderr
    lines = [line.strip() for line in out.stdout.splitlines()]
    cases, columns = lines[1:-1], lines[-1]
    assert len(cases) == 3
    by_impl = {c.split()[4]: c for c in cases}
    assert " user " in by_impl["baseline"] and by_impl["baseline"].endswith("run")
    assert " user " in by_impl["primemoe"] and by_impl["primemoe"].endswith("run")
    assert by_impl["reference"].endswith("n/a: raw ops only (--no-raw)")
    assert "fwd ms" in columns and "peak MiB" in columns and "raw" not in columns


def test_bad_arguments_rejected():
    assert _run_bench("--dry-run", "--shapes", "no-such-model").returncode == 2
    assert _run_bench("--dry-run", "--tokens", "0").returncode == 2
    assert _run_bench("--dry-run", "--settle", "-1").returncode == 2
    assert _run_bench("--dry-run", "--settle", "nan").returncode == 2


def test_settle_is_in_the_timing_note():
    """The raw ops idle before each implementation, the user path once per case (the communication cases go through
    the raw timing)."""
    note = bench._timing_note(bench.parse_args([]))
    assert "raw ops: each implementation alone, 2 s idle before each case and implementation" in note
    assert "torch.autograd.grad(y, [x, topk_weights, w1, w2], dy)" in note
    assert "each its iterations back to back" in note and "after 2 s idle and none between them" in note
    assert "5 s idle before each case" in bench._timing_note(bench.parse_args(["--comm", "--settle", "5"]))
    assert "0.5 s idle" in bench._timing_note(bench.parse_args(["--settle", "0.5"]))
    assert "raw ops: not timed (--no-raw)" in bench._timing_note(bench.parse_args(["--no-raw"]))


def test_shapes_have_one_source():
    """bench.SHAPES (what the scripts read), the tests' REFERENCE_SHAPES and the main job's choices come from
    primemoe.shapes, the table of DESIGN.md section 1."""
    from helpers import REFERENCE_SHAPES

    assert MODEL_SHAPES["qwen3-30b-a3b"] == MoEShape("qwen3-30b-a3b", 2048, 768, 128, 8)
    assert MODEL_SHAPES["qwen3-235b-a22b"].dims == (4096, 1536, 128, 8)
    assert MODEL_SHAPES["deepseek-v3"].dims == (7168, 2048, 256, 8)
    assert all(name == shape.name for name, shape in MODEL_SHAPES.items())
    assert bench.SHAPES == REFERENCE_SHAPES == {name: shape.dims for name, shape in MODEL_SHAPES.items()}
    assert TARGET_SHAPES == ("qwen3-30b-a3b", "qwen3-235b-a22b")
    assert bench.parse_args([]).shapes == bench.TARGET_SHAPES == TARGET_SHAPES
    with pytest.raises(AttributeError):
        MODEL_SHAPES["qwen3-30b-a3b"].hidden = 1  # frozen


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_without_gpu_exits_2():
    out = _run_bench("--tokens", "16")
    assert out.returncode == 2
    assert "no CUDA GPU" in out.stderr


def test_flop_formulas():
    T, K, H, I = 4096, 8, 2048, 768
    assert bench.fwd_flops(T, K, H, I) == 6 * T * K * H * I == 309_237_645_312
    assert bench.bwd_flops(T, K, H, I) == 2 * bench.fwd_flops(T, K, H, I)
    # DESIGN.md section 6: 6*T*K*H*I forward and 12*T*K*H*I backward per rank, for every shape.
    for shape in MODEL_SHAPES.values():
        assert bench.fwd_flops(16384, shape.top_k, shape.hidden, shape.intermediate) == \
            6 * 16384 * shape.top_k * shape.hidden * shape.intermediate
        assert bench.bwd_flops(16384, shape.top_k, shape.hidden, shape.intermediate) == \
            12 * 16384 * shape.top_k * shape.hidden * shape.intermediate


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
    ok = bench._result(cases[0], "ok", user_fwd_ms=1.0, user_bwd_ms=2.0, user_fwd_tflops=10.0, user_bwd_tflops=20.0,
                       peak_mib=1500.0, saved_mib=300.0, peak_vs_baseline=1.0, raw_fwd_ms=0.75, raw_bwd_ms=1.5,
                       raw_fwd_tflops=13.0, raw_bwd_tflops=26.0, routed_rows=128, remote_rows=0)
    na = bench._result(cases[5], "n/a", cases[5].skip)
    assert cases[5].impl == "reference" and cases[5].ep == 2
    text = bench.format_table([ok, na])
    heads, row = text.splitlines()[0], text.splitlines()[2].split()
    assert heads.index("fwd ms") < heads.index("peak MiB") < heads.index("raw fwd ms")
    assert row[5:16] == ["1.000", "2.000", "10.0", "20.0", "1500", "1.00", "300", "0.750", "1.500", "13.0", "26.0"]
    assert "n/a: single GPU only" in text
    md = bench.format_table([ok, na], markdown=True)
    assert md.count("\n") == 3 and md.startswith("| shape |")
    assert "raw fwd ms" not in bench.format_table([ok], columns=bench.layer_columns(bench.parse_args(["--no-raw"])))


def test_dry_run_lists_comm_cases_with_sm_counts():
    out = _run_bench("--dry-run", "--comm", "--shapes", "qwen3-30b-a3b", "--tokens", "4096", "8192", "--ep", "1", "2")
    assert out.returncode == 0, out.stderr
    lines = [line.strip() for line in out.stdout.splitlines()]
    assert lines[0].startswith("skip EP=1:") and "EP > 1" in lines[0]
    assert lines[1] == "10 communication cases (routed bytes per rank and direction):"
    assert lines[-1].startswith("columns: shape, T/rank, EP, impl, SMs, dispatch ms")
    labels = [" ".join(c.split("  ")[0].split()) for c in lines[2:-1]]
    impls = ("primemoe 8 SMs", "primemoe 16 SMs", "primemoe 24 SMs", "nccl", "symm_mem")
    assert labels == [f"qwen3-30b-a3b T={t} EP=2 {impl}" for impl in impls for t in (4096, 8192)]
    assert all(c.endswith("run") for c in lines[2:-1])
    assert "268.4 MB" in lines[3]  # 8192 tokens x 8 slots x 2048 x 2 bytes


def test_dry_run_comm_options():
    out = _run_bench("--dry-run", "--comm", "--shapes", "qwen3-30b-a3b", "deepseek-v3", "--tokens", "16",
                     "--ep", "2", "3", "--num-sms", "12")
    assert out.returncode == 0, out.stderr
    cases = [line.strip() for line in out.stdout.splitlines()[1:-1]]
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
    outcomes = [dict(raw=dict(fwd=[1.0, 0.5, 0.5], bwd=[2.0, 2.0, 1.0]), routed_rows=100, remote_rows=40),
                dict(raw=dict(fwd=[0.2, 1.0, 0.5], bwd=[1.0, 3.0, 4.0]), routed_rows=100, remote_rows=60)]
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
    failed = bench._summarize(nccl, [{"raw": {"fwd": [1.0], "bwd": [1.0]}, "routed_rows": 1, "remote_rows": 1},
                                     {"raw": {"error": "RuntimeError: boom"}, "routed_rows": 1, "remote_rows": 1}])
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


# ---------------------------------------------------------------- the layer's two paths, with CUDA faked

class _FakeEvent:
    """A CUDA event on the CPU: record() takes the next tick, elapsed_time is the ticks between two records."""

    ticks = 0

    def __init__(self, enable_timing=False):
        self.tick = None

    def record(self):
        _FakeEvent.ticks += 1
        self.tick = _FakeEvent.ticks

    def elapsed_time(self, end):
        return float(end.tick - self.tick)


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA events and synchronisation that work on a CPU; the allocator statistics read from the lists this returns
    (memory_allocated: before and after each forward; max_memory_allocated: one per forward+backward)."""
    stats = {"allocated": [], "peak": []}
    monkeypatch.setattr(bench.torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(bench.torch.cuda, "reset_peak_memory_stats", lambda *a, **k: None)
    monkeypatch.setattr(bench.torch.cuda, "memory_allocated", lambda *a, **k: stats["allocated"].pop(0))
    monkeypatch.setattr(bench.torch.cuda, "max_memory_allocated", lambda *a, **k: stats["peak"].pop(0))
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    return stats


class _Recorder:
    """A runner that logs its calls; its forward raises on call ``fail_at``."""

    def __init__(self, name, log, fail_at=None):
        self.name, self.log, self.fail_at, self.calls = name, log, fail_at, 0

    def forward(self):
        self.calls += 1
        self.log.append(f"{self.name}.fwd")
        if self.calls == self.fail_at:
            raise RuntimeError(f"{self.name} fails")
        return self.name

    def backward(self, state, dy):
        assert state == self.name
        self.log.append(f"{self.name}.bwd")


def test_implementations_take_turns_and_a_failing_one_drops_out(fake_cuda):
    """Each runner does its iterations (forward then backward) back to back, one runner after the other; the warm-up
    is dropped; a runner that raises is recorded and the others go on."""
    args = bench.parse_args(["--warmup", "1", "--iters", "3"])
    flush, dy = torch.empty(8, dtype=torch.int8), torch.zeros(1)
    log = []
    runs = bench._time_turns({"a": _Recorder("a", log), "b": _Recorder("b", log)}, dy, args, None, flush)
    turn = {"a": ["a.fwd", "a.bwd"], "b": ["b.fwd", "b.bwd"]}
    assert log == turn["a"] * 4 + turn["b"] * 4
    assert runs == {"a": {"fwd": [1.0] * 3, "bwd": [1.0] * 3}, "b": {"fwd": [1.0] * 3, "bwd": [1.0] * 3}}

    log = []
    runs = bench._time_turns({"a": _Recorder("a", log), "b": _Recorder("b", log, fail_at=2)}, dy, args, None, flush)
    assert runs["b"] == {"error": "RuntimeError: b fails"} and runs["a"]["fwd"] == [1.0] * 3
    assert log.count("b.fwd") == 2 and log.count("b.bwd") == 1 and log.count("a.bwd") == 4
    assert log[-1] == "b.fwd", "a runner stops at its first error"
    assert bench._time(_Recorder("c", []), bench.Inputs(*[dy] * 6), args, None, flush) == ([1.0] * 3, [1.0] * 3)


def test_layer_summary_is_slowest_rank_then_median_for_each_path():
    case = next(c for c in bench.build_cases(bench.parse_args(["--shapes", "qwen3-30b-a3b", "--tokens", "8192",
                                                               "--ep", "2"])) if c.impl == "primemoe")
    H, I, _, K = MODEL_SHAPES["qwen3-30b-a3b"].dims
    mib = bench.MIB
    outcomes = [dict(user=dict(fwd=[2.0, 1.0, 1.0], bwd=[4.0, 4.0, 2.0], peak_bytes=3 * mib, saved_bytes=mib),
                     raw=dict(fwd=[1.0, 0.5, 0.5], bwd=[2.0, 2.0, 1.0]), routed_rows=100, remote_rows=40),
                dict(user=dict(fwd=[1.0, 2.0, 1.0], bwd=[2.0, 2.0, 6.0], peak_bytes=5 * mib, saved_bytes=mib // 2),
                     raw=dict(fwd=[0.2, 1.0, 0.5], bwd=[1.0, 3.0, 4.0]), routed_rows=100, remote_rows=60)]
    r = bench._summarize(case, outcomes)
    assert r["status"] == "ok" and set(case.METRICS) <= set(r)
    assert (r["user_fwd_ms"], r["user_bwd_ms"], r["raw_fwd_ms"], r["raw_bwd_ms"]) == (2.0, 4.0, 1.0, 3.0)
    assert r["user_fwd_tflops"] == pytest.approx(6 * 8192 * K * H * I / 2.0 / 1e9)
    assert r["user_bwd_tflops"] == pytest.approx(12 * 8192 * K * H * I / 4.0 / 1e9)
    assert r["raw_fwd_tflops"] == pytest.approx(6 * 8192 * K * H * I / 1.0 / 1e9)
    assert r["raw_bwd_tflops"] == pytest.approx(12 * 8192 * K * H * I / 3.0 / 1e9)
    assert (r["peak_mib"], r["saved_mib"]) == (5.0, 1.0)  # the rank that needs the most
    assert r["peak_vs_baseline"] is None  # set once the baseline's result is known (add_memory_ratios)
    assert r["nvlink_gbps"] == pytest.approx(bench.nvlink_bytes(50, H) / 2.0 / 1e6)  # the user path's forward
    assert (r["routed_rows"], r["remote_rows"]) == (100, 50)
    line = case.summary(r)
    assert line.startswith("fwd 2.000 ms (") and "peak 5 MiB" in line and "raw fwd 1.000 ms, bwd 3.000 ms" in line

    # One rank's raw ops fail: the case fails, the user path's numbers stay.
    outcomes[1]["raw"] = {"error": "OutOfMemoryError: CUDA out of memory"}
    failed = bench._summarize(case, outcomes)
    assert failed["status"] == "error" and failed["note"] == "rank 1: raw ops: OutOfMemoryError: CUDA out of memory"
    assert failed["user_fwd_ms"] == 2.0 and failed["raw_fwd_ms"] is None and failed["peak_mib"] == 5.0


def test_progress_line_shows_what_was_measured_and_the_failure(capsys):
    case = bench.build_cases(bench.parse_args(["--shapes", "qwen3-30b-a3b", "--tokens", "16", "--ep", "1"]))[1]
    ok = bench._result(case, "ok", user_fwd_ms=1.0, user_bwd_ms=2.0, user_fwd_tflops=3.0, user_bwd_tflops=4.0,
                       peak_mib=10.0, raw_fwd_ms=0.5, raw_bwd_ms=1.5)
    bench._progress(case, ok, 3)
    bench._progress(case, dict(ok, status="error", note="raw ops: RuntimeError: boom", raw_fwd_ms=None), 3)
    bench._progress(case, bench._result(case, "skipped", "needs 2 GPUs"), 3)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("[2/3] qwen3-30b-a3b T=16 EP=1 bf16 primemoe: fwd 1.000 ms (3.0 TFLOP/s), bwd 2.000 ms "
                        "(4.0 TFLOP/s), peak 10 MiB; raw fwd 0.500 ms, bwd 1.500 ms")
    assert lines[1].endswith("peak 10 MiB; error: raw ops: RuntimeError: boom")
    assert lines[2] == "[2/3] qwen3-30b-a3b T=16 EP=1 bf16 primemoe: skipped: needs 2 GPUs"


def test_memory_ratio_is_to_the_baseline_of_the_same_shape_tokens_and_ep():
    def result(impl, precision="bf16", tokens=16, peak=None):
        return dict(shape="s", tokens=tokens, ep=1, impl=impl, precision=precision, peak_mib=peak,
                    peak_vs_baseline=None)
    results = [result("baseline", peak=200.0), result("primemoe", peak=300.0), result("reference"),
               result("primemoe", "fp8", peak=250.0), result("primemoe", tokens=32, peak=600.0)]
    bench.add_memory_ratios(results)
    assert [r["peak_vs_baseline"] for r in results] == [1.0, 1.5, None, 1.25, None]


def test_both_paths_run_on_cpu_and_reach_the_outputs(monkeypatch, fake_cuda, tmp_path, capsys):
    """One (shape, tokens) block through the real implementations on the CPU (tiny shape, faked events and
    allocator statistics), then the JSON, markdown and stdout tables."""
    monkeypatch.setitem(MODEL_SHAPES, "tiny", MoEShape("tiny", hidden=64, intermediate=32, experts=8, top_k=2))
    args = bench.parse_args(["--shapes", "tiny", "--tokens", "16", "--ep", "1", "--warmup", "1", "--iters", "2",
                             "--settle", "0", "--out", str(tmp_path)])
    cases = bench.build_cases(args)
    assert [c.impl for c in cases] == ["baseline", "primemoe", "reference"] and all(c.skip is None for c in cases)
    mib = bench.MIB
    # memory_allocated before/after the forward, then the peak: the baseline's user path first, then primemoe's.
    fake_cuda["allocated"] += [100 * mib, 150 * mib, 100 * mib, 120 * mib]
    fake_cuda["peak"] += [400 * mib, 300 * mib]
    outcomes = bench._run_block(cases, args, None, torch.empty(64, dtype=torch.int8),
                                bench._ShapeContext(args, None, "tiny", 16))
    assert not fake_cuda["allocated"] and not fake_cuda["peak"]
    baseline, primemoe, reference = (outcomes[c.index] for c in cases)
    for outcome in (baseline, primemoe):
        assert set(outcome) == {"user", "raw", "routed_rows", "remote_rows"}
        assert len(outcome["user"]["fwd"]) == len(outcome["user"]["bwd"]) == 2 and len(outcome["raw"]["fwd"]) == 2
    assert set(reference) == {"raw", "routed_rows", "remote_rows"} and "error" not in reference["raw"]
    assert (baseline["user"]["peak_bytes"], baseline["user"]["saved_bytes"]) == (300 * mib, 50 * mib)
    assert (primemoe["user"]["peak_bytes"], primemoe["user"]["saved_bytes"]) == (200 * mib, 20 * mib)
    assert baseline["routed_rows"] == 16 * 2 and baseline["remote_rows"] == 0

    results = [bench._summarize(c, [outcomes[c.index]]) for c in cases]
    bench.add_memory_ratios(results)
    assert [r["status"] for r in results] == ["ok"] * 3
    assert [r["peak_vs_baseline"] for r in results] == [1.0, pytest.approx(2 / 3), None]
    assert results[1]["user_fwd_ms"] == 1.0 and results[1]["raw_bwd_ms"] == 1.0  # one tick per region
    assert results[2]["user_fwd_ms"] is None and results[2]["raw_fwd_ms"] == 1.0

    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(bench.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(bench, "boards", lambda: [{"uuid": "GPU-fake"}])
    bench.write_outputs(results, args)
    data = json.loads((tmp_path / "results.json").read_text())
    assert set(data["metadata"]) >= {"timing", "fields", "flops", "memory", "nvlink", "implementations", "args"}
    assert "max_memory_allocated" in data["metadata"]["memory"] and data["metadata"]["args"]["no_raw"] is False
    for r in data["results"]:
        assert set(r) >= {*bench.Case.METRICS, "shape", "tokens", "ep", "precision", "impl", "status", "note"}
    assert data["results"][1]["peak_mib"] == 200.0 and data["results"][1]["saved_mib"] == 20.0
    md = (tmp_path / "results.md").read_text()
    assert "| fwd ms | bwd ms |" in md and "| peak MiB | peak/baseline | saved MiB | raw fwd ms |" in md
    assert "| 200 | 0.67 | 20 |" in md and "- memory: one user-path forward+backward" in md
    out = capsys.readouterr().out
    assert "raw fwd TFLOP/s" in out and "user path (the headline)" in out


def test_main_grad_paths_accumulate_on_the_cpu():
    """The benchmark's main-grad implementations on the CPU: the fused one adds into w1 / w2's main_grad and
    returns dx, dtw; the separate one adds the plain gradients afterwards; both sums agree."""
    from types import SimpleNamespace

    from helpers import make_problem

    import primemoe
    from primemoe import bench

    p = make_problem(21, 64, 32, 8, 2, seed=2)
    inp = SimpleNamespace(x=p.x, topk_idx=p.topk_idx, topk_weights=p.topk_weights, w1=p.w1, w2=p.w2)
    fused, separate = bench._MainGradPath(primemoe.moe, inp), bench._SeparateMainGradPath(primemoe.moe, inp)
    for path in (fused, separate):
        grads = path.backward(path.forward(), p.dy)
        assert len(grads) == 2
    for got, want in zip((w.main_grad for w in fused.leaves[2:]), separate.main_grads):
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7 * float(want.abs().max()))
