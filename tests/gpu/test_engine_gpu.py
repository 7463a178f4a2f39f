"""The expert GEMM engine's CUDA kernels (csrc/gemm) against their CPU kernels, op by op, on
the reference shapes' sizes and on awkward expert row counts (empty experts, single rows,
exact tile multiples, one expert with most rows), with poisoned output memory."""

import contextlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from engine_cases import engine_operands
from helpers import REFERENCE_SHAPES, poison_caching_allocator

import primemoe
from primemoe import layer

pytestmark = pytest.mark.gpu
ops = torch.ops.primemoe

COUNTS = {
    "mixed": [0, 1, 127, 128, 129, 700, 0, 300],
    "one_heavy": [5, 0, 2000, 0, 0, 3, 0, 0],
    "all_empty": [0, 0, 0, 0],
    # Experts ending just before, at and after 64-row k-slice boundaries (the weight gradients skip the
    # k-slices of padding, given the counts).
    "slice_edges": [63, 64, 65, 191, 192, 193, 0, 1, 256, 300],
}
SHAPES = {name: REFERENCE_SHAPES[name][:2] for name in ("qwen3-30b-a3b", "qwen3-235b-a22b")} | {"small": (256, 256)}


def assert_rows_close(name, got, want, tol=4e-3):
    """Every row, the unused ones past the last expert (zeros) included."""
    # To the host first: a device temporary, once freed, would give later outputs unpoisoned memory.
    got, want = got.cpu().double(), want.cpu().double()
    assert not got.isnan().any(), f"{name}: NaN (unwritten output)"
    err = (got - want).norm().item()
    scale = want.norm().item()
    assert err <= tol * max(scale, 1e-30), f"{name}: relative error {err / max(scale, 1e-30):.2e} > {tol}"


def both(counts, shape, seed):
    hidden, inter = SHAPES[shape]
    gpu = engine_operands(COUNTS[counts], hidden, inter, seed=seed, device="cuda")
    cpu = engine_operands(COUNTS[counts], hidden, inter, seed=seed)
    return gpu, cpu


def fc1_matches_cpu(gpu, cpu):
    """FC1 on poisoned outputs against the CPU kernel; returns the GPU's (a, h)."""
    poison_caching_allocator()
    a, h = ops.fc1_swiglu(gpu.xs, gpu.w1, gpu.offsets, True)
    a_ref, h_ref = ops.fc1_swiglu(cpu.xs, cpu.w1, cpu.offsets, True)
    assert_rows_close("fc1 h", h, h_ref)
    assert_rows_close("fc1 a", a, a_ref)
    return a, h


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("counts", COUNTS)
def test_forward_ops_match_cpu(counts, shape):
    gpu, cpu = both(counts, shape, seed=1)
    a, h = fc1_matches_cpu(gpu, cpu)
    a_only, h_none = ops.fc1_swiglu(gpu.xs, gpu.w1, gpu.offsets, False)
    assert h_none.shape[0] == 0 and torch.equal(a_only, a)
    o = ops.expert_gemm(gpu.a, gpu.w2, gpu.offsets, False)
    assert_rows_close("fc2", o, ops.expert_gemm(cpu.a, cpu.w2, cpu.offsets, False))
    o = ops.expert_gemm(gpu.a, gpu.w2, gpu.offsets, False, gpu.row_weight)
    assert_rows_close("fc2 weighted", o, ops.expert_gemm(cpu.a, cpu.w2, cpu.offsets, False, cpu.row_weight))


@pytest.mark.parametrize("k", [64, 192])
def test_half_tiles_with_odd_k_slices(k):
    """An expert's last 64 rows (a half tile) split their k-slices between the two consumer warpgroups:
    with one k-slice the second gets none, with three it gets one (the layer's sizes give even counts).
    360 row blocks: each CTA runs several tiles, so the ring positions after odd counts are used again."""
    counts = [1, 129, 300] * 60
    gpu = engine_operands(counts, k, 128, seed=7, device="cuda")
    cpu = engine_operands(counts, k, 128, seed=7)
    fc1_matches_cpu(gpu, cpu)
    o = ops.expert_gemm(gpu.xs, gpu.w1, gpu.offsets, False, gpu.row_weight)
    assert_rows_close("weighted", o, ops.expert_gemm(cpu.xs, cpu.w1, cpu.offsets, False, cpu.row_weight))


# GemmConfig (claim_tiles, merge_tails) as the tests force it; the heuristics' choice otherwise.
STATIC, CLAIMED, MERGED = (0, 0), (1, 0), (1, 1)
CONFIGS = {"static": STATIC, "claimed": CLAIMED, "merged": MERGED}


@contextlib.contextmanager
def forced_config(config):
    """The next GEMM launches of this thread run `config` (the test-only op); the heuristics decide again after."""
    ops._gemm_force_config(*config)
    try:
        yield
    finally:
        ops._gemm_force_config(-1, -1)


def assert_same_bits(configs, ops_under_test, what):
    """Each op run under each config (poisoned outputs each time): bitwise equal to the first config's, which wrote
    every output element."""
    for name, run in ops_under_test.items():
        results = []
        for config in configs:
            with forced_config(config):
                poison_caching_allocator()
                results.append(run())
                torch.cuda.synchronize()
        for other in results[1:]:
            for got, want in zip(other, results[0]):
                assert not want.isnan().any(), f"{name}: NaN (unwritten output)"
                assert torch.equal(got, want), f"{name}: {what} changed the result"


def fc1_ops(gpu):
    """FC1 with h kept and not."""
    return {
        "fc1": lambda: ops.fc1_swiglu(gpu.xs, gpu.w1, gpu.offsets, True),
        "fc1, h not kept": lambda: ops.fc1_swiglu(gpu.xs, gpu.w1, gpu.offsets, False)[:1],
    }


def test_claimed_tile_order_gives_the_static_bits():
    """The claimed tile order (the producer claims tiles from a counter and hands each index to the consumers)
    against every grid-th tile: bitwise equal on each variant built with the claim (FC1, FC2 and FC1 dgrad), with
    2-4 tiles per CTA and half tiles."""
    gpu = engine_operands([300, 0, 1, 700, 129, 64, 1000, 63] * 2, 2048, 1536, seed=12, device="cuda")
    ops_under_test = {
        **fc1_ops(gpu),
        "fc2": lambda: (ops.expert_gemm(gpu.a, gpu.w2, gpu.offsets, False, gpu.row_weight),),
        "fc1 dgrad": lambda: (ops.expert_gemm(gpu.h, gpu.w1, gpu.offsets, True),),
    }
    assert_same_bits([STATIC, CLAIMED], ops_under_test, "the claimed tile order")


@pytest.mark.parametrize("config", ["static", "claimed", "merged"])
@pytest.mark.parametrize("counts, hidden, spare", [([300, 0, 1, 700, 129, 64, 1000, 63] * 2, 2304, 37),
                                                   ([300, 0, 1, 700, 129, 64, 1000, 63] * 2, 2304, 300),
                                                   ([1, 129, 300] * 60, 64, 37), ([1, 129, 300] * 60, 192, 37),
                                                   ([0, 0, 5000, 0], 2048, 37), ([129], 256, 37)])
def test_fc1_activation_warps_match_cpu(counts, hidden, spare, config):
    """FC1's activation by the producer's warps (the owner and the helper warp per job; around a 192-row tile the
    consumers) against the CPU kernel, h kept and not, on poisoned outputs: split half tiles with one and three
    k-slices (k = 64, 192: the second warpgroup has none / one, so its held job goes after the mainloop), 36 k-slices
    (2304: ring positions differ from tile to tile), rows past the routed ones (jobs back to back), in every config."""
    gpu = engine_operands(counts, hidden, 1408, seed=29, device="cuda", spare_rows=spare)
    cpu = engine_operands(counts, hidden, 1408, seed=29, spare_rows=spare)
    with forced_config(CONFIGS[config]):
        a, _ = fc1_matches_cpu(gpu, cpu)
        assert torch.equal(ops.fc1_swiglu(gpu.xs, gpu.w1, gpu.offsets, False)[0], a)


def merged_tail_rows(offsets):
    """The rows whose sums run in another order merged than unmerged, in each expert whose padded count is above 128
    and an odd multiple of 64: merged, its first tile has 192 rows, rows 128 to 191 its tail; unmerged, its last 64
    rows are a half tile, split along K."""
    mask = torch.zeros(int(offsets[-1]), dtype=torch.bool)
    bounds = offsets.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end - start > 128 and (end - start) % 128 == 64:
            mask[start + 128:start + 192] = True
            mask[end - 64:end] = True
    return mask


@pytest.mark.parametrize("counts, hidden, inter, spare", [([300, 0, 1, 700, 129, 64, 1000, 63] * 2, 2304, 1408, 37),
                                                          ([300, 0, 1, 700, 129, 64, 1000, 63] * 2, 2304, 1408, 300),
                                                          ([1, 129, 300] * 60, 64, 256, 37),
                                                          ([1, 129, 300] * 60, 192, 256, 37),
                                                          ([0, 0, 5000, 0], 2048, 1536, 37), ([129], 256, 256, 37)])
def test_merged_tail_tiles_match_cpu(counts, hidden, inter, spare):
    """An expert's first 192 rows as one tile where its rows are an odd multiple of 64 (merge_tails, built with the
    claimed order): FC1 (h kept and not) and the plain-store GEMM (FC2's variant, here over rows x w1 so that
    K = hidden; weighted and not) against the CPU kernels on poisoned outputs; outside the tails bitwise those of
    unmerged tiles (the same wgmma sequence; the tails sum in another order). One and three k-slices per tile
    (hidden 64, 192: a merged tile's loop runs once), 36 (2304: ring positions differ from tile to tile), several
    merged tiles per CTA, experts of 64 rows beside them (half tiles), a lone merged tile; 37 rows past the routed
    ones (part of a tile with no k-slice) and 300 (several such tiles, after the merged ones)."""
    gpu = engine_operands(counts, hidden, inter, seed=23, device="cuda", spare_rows=spare)
    cpu = engine_operands(counts, hidden, inter, seed=23, spare_rows=spare)
    tails = merged_tail_rows(cpu.offsets)
    assert tails.any()
    runs = {}
    for merge, config in (("0", CLAIMED), ("1", MERGED)):
        with forced_config(config):
            a, h = fc1_matches_cpu(gpu, cpu)
            a_only = ops.fc1_swiglu(gpu.xs, gpu.w1, gpu.offsets, False)[0]
            assert torch.equal(a_only, a)
            poison_caching_allocator()
            o = ops.expert_gemm(gpu.xs, gpu.w1, gpu.offsets, False)
            assert_rows_close("store", o, ops.expert_gemm(cpu.xs, cpu.w1, cpu.offsets, False))
            poison_caching_allocator()
            ow = ops.expert_gemm(gpu.xs, gpu.w1, gpu.offsets, False, gpu.row_weight)
            assert_rows_close("store weighted", ow, ops.expert_gemm(cpu.xs, cpu.w1, cpu.offsets, False, cpu.row_weight))
            runs[merge] = [t.cpu() for t in (a, h, o, ow)]
    for name, merged, unmerged in zip(("fc1 a", "fc1 h", "store", "store weighted"), runs["1"], runs["0"]):
        rows = min(len(tails), merged.shape[0])
        keep = torch.ones(merged.shape[0], dtype=torch.bool)
        keep[:rows] = ~tails[:rows]
        assert torch.equal(merged[keep], unmerged[keep]), f"{name}: merging changed rows outside the tails"


FIRST_LAUNCH_IN_CAPTURE = textwrap.dedent("""
    import sys
    import torch
    sys.path.insert(0, sys.argv[1])
    from engine_cases import engine_operands
    import primemoe  # noqa: F401 (the ops)
    ops = torch.ops.primemoe
    # 2048 x 1536: 12.6 MB of weights per expert, so the heuristics claim tiles (a counter zeroed on the stream)
    # and merge tails.
    gpu = engine_operands([300, 0, 700, 129, 1000, 64, 500, 2] * 3, 2048, 1536, seed=5, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a, h = ops.fc1_swiglu(gpu.xs, gpu.w1, gpu.offsets, True)
        o = ops.expert_gemm(a, gpu.w2, gpu.offsets, False, gpu.row_weight)
    for t in (a, h, o):
        t.fill_(float("nan"))
    graph.replay()
    a_eager, h_eager = ops.fc1_swiglu(gpu.xs, gpu.w1, gpu.offsets, True)
    o_eager = ops.expert_gemm(a_eager, gpu.w2, gpu.offsets, False, gpu.row_weight)
    torch.cuda.synchronize()
    for got, want in ((a, a_eager), (h, h_eager), (o, o_eager)):
        assert not want.isnan().any(), "NaN (unwritten output)"
        assert torch.equal(got, want), "the graph's replay differs from the eager launch"
    print("ok")
""")


def test_first_launch_inside_graph_capture():
    """A process whose first FC1 and FC2 launches (claimed order, 192-row tiles) are captured into a CUDA graph, with
    every first-launch step of the host (kernel attributes, tensor maps, the zeroed tile counter): the capture must
    not break, and its replay gives the eager launches' bits. In a fresh process, as those steps run once per
    process."""
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", FIRST_LAUNCH_IN_CAPTURE, tests_dir], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr


def test_forced_configs_are_checked():
    """The test-only op takes 0 / 1 for each field (-1 / -1: the heuristics again) and refuses a config that has no
    kernel for the GEMM at hand, by name."""
    gpu = engine_operands([64], 256, 256, device="cuda")
    with pytest.raises(RuntimeError, match="claim_tiles"):
        ops._gemm_force_config(2, 0)
    with pytest.raises(RuntimeError, match="merge_tails"):
        ops._gemm_force_config(0, -1)
    with forced_config((0, 1)):  # 192-row tiles come only with the claimed order
        with pytest.raises(RuntimeError, match="merge_tails"):
            ops.fc1_swiglu(gpu.xs, gpu.w1, gpu.offsets, True)
    with forced_config(CLAIMED):  # FC2 dgrad has no claimed order
        with pytest.raises(RuntimeError, match="claim_tiles"):
            ops.fc2_dgrad_swiglu(gpu.dy_rows, gpu.w2, gpu.h, gpu.row_weight, gpu.offsets)
    a, h = ops.fc1_swiglu(gpu.xs, gpu.w1, gpu.offsets, True)  # cleared: the heuristics again
    assert a.isfinite().all() and h.isfinite().all()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("counts", COUNTS)
def test_backward_ops_match_cpu(counts, shape):
    gpu, cpu = both(counts, shape, seed=2)
    # Rows past the last expert are not part of the layout: whatever they hold must not leak.
    routed = cpu.routed_rows
    h_dirty, w_dirty = gpu.h.clone(), gpu.row_weight.clone()
    h_dirty[routed:] = float("nan")
    w_dirty[routed:] = float("nan")
    poison_caching_allocator()
    dh, aw, dot = ops.fc2_dgrad_swiglu(gpu.dy_rows, gpu.w2, h_dirty, w_dirty, gpu.offsets)
    dh_ref, aw_ref, dot_ref = ops.fc2_dgrad_swiglu(cpu.dy_rows, cpu.w2, cpu.h, cpu.row_weight, cpu.offsets)
    assert_rows_close("dh", dh, dh_ref)
    assert_rows_close("aw", aw, aw_ref)
    assert_rows_close("dot", dot, dot_ref, tol=1e-4)  # fp32 partial sums
    dxs = ops.expert_gemm(gpu.h, gpu.w1, gpu.offsets, True)
    assert_rows_close("fc1 dgrad", dxs, ops.expert_gemm(cpu.h, cpu.w1, cpu.offsets, True))
    for name, (lhs, rhs) in {"dw2": ("dy_rows", "a"), "dw1": ("h", "xs")}.items():
        got = ops.expert_wgrad(getattr(gpu, lhs), getattr(gpu, rhs), gpu.offsets)
        want = ops.expert_wgrad(getattr(cpu, lhs), getattr(cpu, rhs), cpu.offsets)
        assert_rows_close(name, got, want)
        empty = torch.tensor(COUNTS[counts]) == 0
        assert not got[empty.cuda()].any(), f"{name}: an expert without rows must get a zero gradient"
        # With the layout's counts the k-slices of padding are skipped: the same bits, in poisoned memory,
        # even with NaN in those k-slices (proof that they are not read; the routed ones all are).
        a_nan = skipped_slices_nan(getattr(gpu, lhs), cpu.offsets, COUNTS[counts])
        b_nan = skipped_slices_nan(getattr(gpu, rhs), cpu.offsets, COUNTS[counts])
        poison_caching_allocator()
        skipping = ops.expert_wgrad(a_nan, b_nan, gpu.offsets, gpu.counts)
        assert torch.equal(skipping, got), f"{name}: differs with expert_rows"


def skipped_slices_nan(rows, offsets, counts):
    """``rows`` with NaN in each expert's padding rows past its last 64-row slice holding a routed row."""
    rows = rows.clone()
    for begin, end, c in zip(offsets[:-1].tolist(), offsets[1:].tolist(), counts):
        rows[begin + (c + 63) // 64 * 64:end] = float("nan")
    return rows


def test_engine_ops_are_bitwise_repeatable():
    gpu, _ = both("mixed", "qwen3-30b-a3b", seed=3)
    first = ops.fc2_dgrad_swiglu(gpu.dy_rows, gpu.w2, gpu.h, gpu.row_weight, gpu.offsets)
    again = ops.fc2_dgrad_swiglu(gpu.dy_rows, gpu.w2, gpu.h, gpu.row_weight, gpu.offsets)
    for x, y in zip(first, again):
        assert torch.equal(x, y)
    w = ops.expert_wgrad(gpu.h, gpu.xs, gpu.offsets)
    assert torch.equal(w, ops.expert_wgrad(gpu.h, gpu.xs, gpu.offsets))


@pytest.mark.parametrize("config", [None, CLAIMED, MERGED], ids=["heuristics", "claimed", "merged"])
@pytest.mark.parametrize("counts", ["mixed", "all_empty"])
def test_zero_unrouted_false_keeps_the_routed_rows(counts, config):
    """zero_unrouted=False skips the tiles past the routed rows (300 spare rows: two whole tiles and part
    of a third) and nothing else: the routed rows are bitwise those of the zeroing run, the rest keep
    the allocator's poison. Also claimed, and with 192-row tiles for FC1 and FC2 (the last expert's among them)."""
    hidden, inter = SHAPES["small"]
    g = engine_operands(COUNTS[counts], hidden, inter, seed=5, device="cuda", spare_rows=300)
    routed = int(g.offsets[-1])
    calls = {
        "fc1_swiglu": lambda **kw: ops.fc1_swiglu(g.xs, g.w1, g.offsets, True, **kw),
        "fc2 weighted": lambda **kw: ops.expert_gemm(g.a, g.w2, g.offsets, False, g.row_weight, **kw),
        "fc1 dgrad": lambda **kw: ops.expert_gemm(g.h, g.w1, g.offsets, True, **kw),
        "fc2_dgrad_swiglu": lambda **kw: ops.fc2_dgrad_swiglu(g.dy_rows, g.w2, g.h, g.row_weight, g.offsets, **kw),
    }
    # FC2 dgrad has neither the claimed order nor 192-row tiles, FC1 dgrad no 192-row tiles.
    skip = {CLAIMED: {"fc2_dgrad_swiglu"}, MERGED: {"fc2_dgrad_swiglu", "fc1 dgrad"}}.get(config, set())
    for name, call in calls.items():
        if name in skip:
            continue
        with forced_config(config) if config is not None else contextlib.nullcontext():
            full = call()
            poison_caching_allocator()
            skipped = call(zero_unrouted=False)
        for want, got in zip(full if isinstance(full, tuple) else (full,),
                             skipped if isinstance(skipped, tuple) else (skipped,)):
            assert got.shape == want.shape, name
            assert torch.equal(got[:routed], want[:routed]), f"{name}: routed rows differ"
            assert not want[routed:].any(), f"{name}: the default must zero the rows past the routed ones"
            assert got[routed:].isnan().all(), f"{name}: a row past the routed ones was written"


def test_opcheck_engine_ops_on_cuda():
    e = engine_operands([3, 0, 130], hidden=256, inter=256, seed=4, device="cuda")
    torch.library.opcheck(ops.fc1_swiglu, (e.xs, e.w1, e.offsets, True))
    torch.library.opcheck(ops.expert_gemm, (e.a, e.w2, e.offsets, False, e.row_weight))
    torch.library.opcheck(ops.expert_gemm, (e.a, e.w2, e.offsets, False))
    torch.library.opcheck(ops.expert_gemm, (e.h, e.w1, e.offsets, True))
    torch.library.opcheck(ops.fc2_dgrad_swiglu, (e.dy_rows, e.w2, e.h, e.row_weight, e.offsets))
    torch.library.opcheck(ops.expert_wgrad, (e.dy_rows, e.a, e.offsets))
    torch.library.opcheck(ops.expert_wgrad, (e.dy_rows, e.a, e.offsets, e.counts))


def test_engine_covers_the_reference_shapes_on_this_gpu():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the engine's kernels are sm_90a")
    for name, (hidden, inter, experts, _) in REFERENCE_SHAPES.items():
        assert ops.expert_gemm_unsupported(0, hidden, inter) == "", name
        x = torch.empty(1, hidden, dtype=torch.bfloat16, device="cuda")
        w1 = torch.empty(1, 2 * inter, 1, dtype=torch.bfloat16, device="cuda")
        assert layer.engine_supports(x, w1), name
    assert "multiple" in ops.expert_gemm_unsupported(0, 256, 128)


def test_unsupported_size_raises_a_clear_error():
    e = engine_operands([3, 5], hidden=256, inter=128, seed=5, device="cuda")
    with pytest.raises(RuntimeError, match="fc2_dgrad_swiglu|multiple of 256"):
        ops.fc2_dgrad_swiglu(e.dy_rows, e.w2, e.h, e.row_weight, e.offsets)
    # primemoe.moe itself falls back to torch._grouped_mm for such sizes.
    x = torch.randn(8, 256, device="cuda").bfloat16()
    idx = torch.randint(0, 2, (8, 2), device="cuda")
    y = primemoe.moe(x, idx, torch.rand(8, 2, device="cuda"), e.w1, e.w2)
    assert y.isfinite().all()


@pytest.mark.parametrize("config", ["static", "claimed"])
def test_fc1_producer_waits_for_rows_ready(config):
    """The wait hook the expert-parallel path drives: satisfied counters change nothing, in both tile orders (the
    heuristics claim under the hook where the weights are large, and never merge there)."""
    e = engine_operands([3, 0, 130], hidden=256, inter=256, seed=6, device="cuda")
    ready = torch.full((3,), 4, dtype=torch.int64, device="cuda")
    epoch = torch.full((1,), 2, dtype=torch.int64, device="cuda")
    with forced_config(CONFIGS[config]):
        plain = ops.fc1_swiglu(e.xs, e.w1, e.offsets, True)
        hooked = ops.fc1_swiglu(e.xs, e.w1, e.offsets, True, ready, epoch, 2, 0)
    assert torch.equal(hooked[0], plain[0]) and torch.equal(hooked[1], plain[1])
    primemoe.check_errors()


def test_gemms_launched_beside_a_dispatch_give_the_plain_bits():
    """The overlapped path's launches (programmatically dependent, FC1 claiming from a given counter, FC2 dgrad on
    the SMs a dispatch leaves) with satisfied counters: the same bits as the plain launches."""
    e = engine_operands([300, 0, 1, 700, 129, 64], hidden=256, inter=256, seed=9, device="cuda")
    ready = torch.full((6,), 6, dtype=torch.int64, device="cuda")
    epoch = torch.full((1,), 2, dtype=torch.int64, device="cuda")
    plain_fc1 = ops.fc1_swiglu(e.xs, e.w1, e.offsets, True)
    plain_dgrad = ops.fc2_dgrad_swiglu(e.dy_rows, e.w2, e.h, e.row_weight, e.offsets)
    torch.cuda.synchronize()  # nothing left running for the programmatic launches to overlap
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")  # as the dispatch leaves it
    torch.cuda.synchronize()
    fc1 = ops.fc1_swiglu(e.xs, e.w1, e.offsets, True, ready, epoch, 3, 0, tile_counter=counter, overlap_sms=16)
    torch.cuda.synchronize()
    dgrad = ops.fc2_dgrad_swiglu(e.dy_rows, e.w2, e.h, e.row_weight, e.offsets, True, ready, epoch, 3, 0,
                                 overlap_sms=16)
    for got, want in zip((*fc1, *dgrad), (*plain_fc1, *plain_dgrad)):
        assert torch.equal(got, want)
    assert int(counter) > 0  # FC1 claimed its tiles from the given counter
    primemoe.check_errors()


@pytest.mark.parametrize("w_kn", [False, True], ids=["fc2", "fc1_dgrad"])
def test_row_gemms_publishing_their_rows(w_kn):
    """FC2 and FC1's dgrad with done_*: the same bits as without, on the SMs left after done_sms; every 64-row block
    of the routed rows published once per column tile (flag = the epoch, count back to 0); blocks past them
    untouched."""
    e = engine_operands([300, 0, 1, 700, 129, 64], hidden=512, inter=256, seed=13, device="cuda")
    rows, w = (e.h, e.w1) if w_kn else (e.a, e.w2)
    plain = ops.expert_gemm(rows, w, e.offsets, w_kn, zero_unrouted=False)
    blocks = rows.shape[0] // 64 + 1
    flags = torch.full((blocks,), 3, dtype=torch.int64, device="cuda")  # an older epoch's
    counts = torch.zeros(blocks, dtype=torch.int32, device="cuda")
    epoch = torch.full((1,), 4, dtype=torch.int64, device="cuda")
    published = ops.expert_gemm(rows, w, e.offsets, w_kn, zero_unrouted=False, done_flags=flags, done_counts=counts,
                                done_epoch=epoch, done_sms=16)
    torch.cuda.synchronize()
    routed_blocks = e.routed_rows // 64
    assert torch.equal(published[:e.routed_rows], plain[:e.routed_rows])
    assert (flags[:routed_blocks] == 4).all() and (flags[routed_blocks:] == 3).all()
    assert not counts.any()
    primemoe.check_errors()


@pytest.mark.parametrize("counts", ["mixed", "slice_edges"])
def test_wgrad_accumulating_into_main_grads(counts):
    """expert_wgrad_accumulate: into zeros, exactly the fp32 sums that expert_wgrad rounds to bf16 (the same
    accumulator); repeated, the same bits; into a random start, start + the fp64 product within fp32 rounding, and
    the experts without rows keep their start bit for bit."""
    e = engine_operands(COUNTS[counts], hidden=512, inter=256, seed=15, device="cuda")
    offsets = e.offsets.tolist()
    for a_rows, b_rows in ((e.dy_rows, e.a), (e.h, e.xs)):  # dw2 [E, H, I], dw1 [E, 2I, H]
        shape = (len(offsets) - 1, a_rows.shape[1], b_rows.shape[1])
        plain = ops.expert_wgrad(a_rows, b_rows, e.offsets, e.counts)
        into_zeros = [torch.zeros(shape, device="cuda") for _ in range(2)]
        for main_grad in into_zeros:
            ops.expert_wgrad_accumulate(a_rows, b_rows, e.offsets, e.counts, main_grad)
        assert torch.equal(into_zeros[0], into_zeros[1])
        assert torch.equal(into_zeros[0].bfloat16(), plain)
        start = torch.randn(shape, device="cuda")
        main_grad = start.clone()
        ops.expert_wgrad_accumulate(a_rows, b_rows, e.offsets, e.counts, main_grad)
        for x, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
            if hi == lo:
                assert torch.equal(main_grad[x], start[x])
                continue
            want = start[x].double() + a_rows[lo:hi].double().t() @ b_rows[lo:hi].double()
            err = (main_grad[x].double() - want).norm() / want.norm()
            assert err < 1e-5, f"expert {x}: relative error {err:.2e}"
    primemoe.check_errors()


def test_sm_budget_gives_the_same_bits():
    """primemoe.set_num_sms caps the GEMMs' persistent grids; every tile is computed the same whichever CTA takes
    it, so the results are bitwise those of the full grid."""
    e = engine_operands([300, 0, 1, 700, 129, 64, 1000, 63], hidden=512, inter=512, seed=10, device="cuda")
    run = {
        "fc1": lambda: ops.fc1_swiglu(e.xs, e.w1, e.offsets, True),
        "fc2": lambda: (ops.expert_gemm(e.a, e.w2, e.offsets, False, e.row_weight),),
        "fc2 dgrad": lambda: ops.fc2_dgrad_swiglu(e.dy_rows, e.w2, e.h, e.row_weight, e.offsets),
        "wgrad": lambda: (ops.expert_wgrad(e.dy_rows, e.a, e.offsets),),
    }
    full = {name: fn() for name, fn in run.items()}
    try:
        primemoe.set_num_sms(37)
        assert primemoe.get_num_sms() == 37
        capped = {name: fn() for name, fn in run.items()}
    finally:
        primemoe.set_num_sms(None)
    for name in run:
        for got, want in zip(capped[name], full[name]):
            assert torch.equal(got, want), f"{name}: the SM budget changed the result"


def _side_stream_beside(ready):
    """A stream for the release, made to wait for the work queued so far (before the GEMM's launch, so that the
    release runs beside it). Its kernels are loaded here first: CUDA loads a kernel at its first launch, and
    that load waits for the kernels running then, the spinning GEMM too (a deadlock until the timeout)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(1)
        ready.fill_(0)
    side.synchronize()
    return side


def _release_late(copies, ready, value, cycles, side=None):
    """On a side stream: a device spin of `cycles`, then each ``(dst, src)`` of ``copies`` written, then the counters
    released. Without ``side``, a new stream that waits for everything queued so far (the GEMM just launched too); a
    stream that was made to wait before the GEMM's launch runs beside it."""
    if side is None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles)
        for dst, src in copies:
            dst.copy_(src)
        ready.fill_(value)
    return side


def _hooked_beside_a_late_release(launch, copies):
    """``launch(ready, epoch)`` (a hooked GEMM waiting for 2 per expert) with its operands and counters released
    ~20 ms later beside it, SMs left free for that: ``(result, ms the GEMM took)``."""
    ready = torch.zeros(32, dtype=torch.int64, device="cuda")
    epoch = torch.ones(1, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    try:
        primemoe.set_num_sms(primemoe.get_num_sms() - 4)  # room for the releasing kernels
        side = _side_stream_beside(ready)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = launch(ready, epoch)
        end.record()
        _release_late(copies, ready, 2, 40_000_000, side)
        torch.cuda.synchronize()
    finally:
        primemoe.set_num_sms(None)
    return result, start.elapsed_time(end)


def test_fc1_producer_really_waits_for_a_late_counter():
    """The rows and their counters are released late on another stream (after a ~20 ms device spin), with SMs
    left free for it: FC1 launched before them must wait, and its result is that of the released rows."""
    e = engine_operands([300, 0, 1, 129] * 8, hidden=256, inter=256, seed=11, device="cuda")
    plain = ops.fc1_swiglu(e.xs, e.w1, e.offsets, True)
    rows = torch.full_like(e.xs, float("nan"))  # what FC1 would read without waiting
    hooked, ms = _hooked_beside_a_late_release(
        lambda ready, epoch: ops.fc1_swiglu(rows, e.w1, e.offsets, True, ready, epoch, 2, 0), [(rows, e.xs)])
    assert ms > 5.0, "FC1 ended before the rows were released: it did not wait"
    assert torch.equal(hooked[0], plain[0]) and torch.equal(hooked[1], plain[1])
    primemoe.check_errors()


def test_fc2_dgrad_really_waits_for_late_rows_and_weights():
    """FC2's dgrad under the hook: dy's rows and their routing weights (both written by the dispatch) are released
    late on another stream; the weights must be read after the wait too, not ahead of the mainloop."""
    e = engine_operands([300, 0, 1, 129] * 8, hidden=256, inter=256, seed=14, device="cuda")
    plain = ops.fc2_dgrad_swiglu(e.dy_rows, e.w2, e.h, e.row_weight, e.offsets)
    rows = torch.full_like(e.dy_rows, float("nan"))
    weights = torch.full_like(e.row_weight, float("nan"))  # stale weights: NaN in every output they reach
    hooked, ms = _hooked_beside_a_late_release(
        lambda ready, epoch: ops.fc2_dgrad_swiglu(rows, e.w2, e.h, weights, e.offsets, True, ready, epoch, 2, 0),
        [(rows, e.dy_rows), (weights, e.row_weight)])
    assert ms > 5.0, "FC2's dgrad ended before the rows were released: it did not wait"
    routed = e.routed_rows
    for got, want in zip(hooked, plain):
        assert torch.equal(got[:routed], want[:routed])
    primemoe.check_errors()


def test_a_grid_on_every_sm_ends_in_the_timeout_not_a_hang(monkeypatch):
    """FC1 on every SM, each CTA waiting for rows that only a kernel queued behind it would release: nothing can
    run, so the wait times out and names the expert and the phase; then the queued kernel runs."""
    monkeypatch.setenv("PRIMEMOE_WAIT_TIMEOUT_S", "0.5")
    e = engine_operands([128 * 80], hidden=256, inter=256, seed=12, device="cuda")  # 160 tiles: a CTA on every SM
    ready = torch.zeros(1, dtype=torch.int64, device="cuda")
    epoch = torch.ones(1, dtype=torch.int64, device="cuda")
    rows = e.xs.clone()
    torch.cuda.synchronize()
    ops.fc1_swiglu(rows, e.w1, e.offsets, True, ready, epoch, 2, 3)
    side = _release_late([(rows, e.xs)], ready, 2, 1000)
    with pytest.raises(primemoe.DeviceError, match=r"rank 3 timed out .*rows of local expert 0, before its expert GEMM"):
        primemoe.check_errors()
    side.synchronize()
    assert int(ready[0]) == 2  # the queued kernel ran after the timeout
    primemoe.check_errors()


def test_fc1_rows_ready_timeout_names_rank_and_expert(monkeypatch):
    monkeypatch.setenv("PRIMEMOE_WAIT_TIMEOUT_S", "0.2")
    e = engine_operands([3, 0, 130], hidden=256, inter=256, seed=7, device="cuda")
    # Expert 1 has no rows (nothing to wait for); expert 2's counter never reaches epoch * per_epoch = 2.
    ready = torch.tensor([2, 0, 1], dtype=torch.int64, device="cuda")
    epoch = torch.ones(1, dtype=torch.int64, device="cuda")
    ops.fc1_swiglu(e.xs, e.w1, e.offsets, True, ready, epoch, 2, 5)
    with pytest.raises(primemoe.DeviceError,
                       match=r"rank 5 timed out .*rows of local expert 2, before its expert GEMM"):
        primemoe.check_errors()
    primemoe.check_errors()  # reported once, then cleared


def test_rows_ready_arguments_are_checked():
    e = engine_operands([3, 5], hidden=256, inter=256, seed=8, device="cuda")
    epoch = torch.ones(1, dtype=torch.int64, device="cuda")
    with pytest.raises(RuntimeError, match="rows_ready: expected one counter per expert"):
        ops.fc1_swiglu(e.xs, e.w1, e.offsets, True, torch.zeros(3, dtype=torch.int64, device="cuda"), epoch, 1, 0)
    with pytest.raises(RuntimeError, match="epoch: required with rows_ready"):
        ops.fc1_swiglu(e.xs, e.w1, e.offsets, True, torch.zeros(2, dtype=torch.int64, device="cuda"), None, 1, 0)


@pytest.mark.parametrize("config", ["static", "claimed", "merged"])
@pytest.mark.parametrize("experts", [256, 300])
def test_forward_ops_with_hundreds_of_experts(experts, config):
    """FC1 and FC2 against the CPU kernels over hundreds of experts (empty ones, half tiles, several tiles each), so
    that the producer's walk and its handoff of decoded tiles to the consumers cross many expert boundaries."""
    counts = [0 if e % 5 == 0 else (37 * e) % 200 for e in range(experts)]
    gpu = engine_operands(counts, 256, 256, seed=31, device="cuda")
    cpu = engine_operands(counts, 256, 256, seed=31)
    with forced_config(CONFIGS[config]):
        fc1_matches_cpu(gpu, cpu)
        o = ops.expert_gemm(gpu.a, gpu.w2, gpu.offsets, False, gpu.row_weight)
    assert_rows_close("fc2 weighted", o, ops.expert_gemm(cpu.a, cpu.w2, cpu.offsets, False, cpu.row_weight))
