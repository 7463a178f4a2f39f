"""The expert GEMM engine's CUDA kernels (csrc/gemm) against their CPU kernels, op by op, on
the reference shapes' sizes and on awkward expert row counts (empty experts, single rows,
exact tile multiples, one expert with most rows), with poisoned output memory."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from engine_cases import engine_operands, gather_operands
from helpers import REFERENCE_SHAPES, poison_caching_allocator

import primemoe
from primemoe import ops as shim

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


def assert_same_bits_under_env(monkeypatch, variable, reference, other, ops_under_test, what):
    """Each op run with `variable` set to `reference`, then to `other` (poisoned outputs each time): bitwise equal,
    and the reference run wrote every output element."""
    for name, run in ops_under_test.items():
        results = {}
        for value in (reference, other):
            monkeypatch.setenv(variable, value)
            poison_caching_allocator()
            results[value] = run()
            torch.cuda.synchronize()
        for got, want in zip(results[other], results[reference]):
            assert not want.isnan().any(), f"{name}: NaN (unwritten output)"
            assert torch.equal(got, want), f"{name}: {what} changed the result"


def fc1_ops(gpu):
    """FC1 with h kept and not: what the comparisons of FC1's activation paths run."""
    return {
        "fc1": lambda: ops.fc1_swiglu(gpu.xs, gpu.w1, gpu.offsets, True),
        "fc1, h not kept": lambda: ops.fc1_swiglu(gpu.xs, gpu.w1, gpu.offsets, False)[:1],
    }


def test_claimed_tile_order_gives_the_static_bits(monkeypatch):
    """The claimed tile order (the producer claims tiles from a counter and hands each index to the
    consumers) against every grid-th tile, forced both ways by PRIMEMOE_GEMM_TILE_ORDER: bitwise equal on
    each variant built with the claim (FC1, FC2 and FC1 dgrad), with 2-4 tiles per CTA and half tiles."""
    gpu = engine_operands([300, 0, 1, 700, 129, 64, 1000, 63] * 2, 2048, 1536, seed=12, device="cuda")
    ops_under_test = {
        "fc1": lambda: ops.fc1_swiglu(gpu.xs, gpu.w1, gpu.offsets, True),
        "fc2": lambda: (ops.expert_gemm(gpu.a, gpu.w2, gpu.offsets, False, gpu.row_weight),),
        "fc1 dgrad": lambda: (ops.expert_gemm(gpu.h, gpu.w1, gpu.offsets, True),),
    }
    assert_same_bits_under_env(monkeypatch, "PRIMEMOE_GEMM_TILE_ORDER", "static", "claimed", ops_under_test,
                               "the claimed tile order")


@pytest.mark.parametrize("pairs", ["0", "1"])
@pytest.mark.parametrize("order", ["static", "claimed"])
@pytest.mark.parametrize("counts, hidden", [([300, 0, 1, 700, 129, 64, 1000, 63] * 2, 2304), ([1, 129, 300] * 60, 64),
                                            ([1, 129, 300] * 60, 192), ([0, 0, 5000, 0], 2048)])
def test_activation_warps_give_the_consumers_bits(monkeypatch, counts, hidden, order, pairs):
    """FC1's activation by the producer's warps (the default) against the consumer warpgroups computing it
    (PRIMEMOE_FC1_ACTIVATION=consumers), with h kept and not: bitwise equal, every element written. Split half
    tiles with one and three k-slices (k = 64, 192: the second warpgroup has none / one, so its held job goes
    after the mainloop), 36 k-slices (2304), rows past the routed ones, both tile orders, paired and not."""
    gpu = engine_operands(counts, hidden, 1408, seed=17, device="cuda")
    monkeypatch.setenv("PRIMEMOE_GEMM_TILE_ORDER", order)
    monkeypatch.setenv("PRIMEMOE_GEMM_PAIRS", pairs)
    monkeypatch.setenv("PRIMEMOE_GEMM_MERGE_TAILS", "0")  # merged tails need the warps: their sums differ
    assert_same_bits_under_env(monkeypatch, "PRIMEMOE_FC1_ACTIVATION", "consumers", "warps", fc1_ops(gpu),
                               "the activation warps")


@pytest.mark.parametrize("merge", ["0", "1"])
@pytest.mark.parametrize("order", ["static", "claimed"])
@pytest.mark.parametrize("counts, hidden, spare", [([300, 0, 1, 700, 129, 64, 1000, 63] * 2, 2304, 37),
                                                   ([300, 0, 1, 700, 129, 64, 1000, 63] * 2, 2304, 300),
                                                   ([1, 129, 300] * 60, 64, 37), ([1, 129, 300] * 60, 192, 37),
                                                   ([0, 0, 5000, 0], 2048, 37), ([129], 256, 37)])
def test_activation_helper_gives_the_two_warps_bits(monkeypatch, counts, hidden, spare, order, merge):
    """The producer warpgroup's fourth warp taking the last rows of every activation job (the default) against the two
    activation warps alone (PRIMEMOE_FC1_ACTIVATION=two_warps), h kept and not: bitwise equal, every element
    written. With and without 192-row tiles (whose tail jobs hold gate and up from both warpgroups), split half
    tiles with one and three k-slices (the helper serves warpgroup 0 alone there), rows past the routed ones (jobs
    back to back), both tile orders."""
    gpu = engine_operands(counts, hidden, 1408, seed=29, device="cuda", spare_rows=spare)
    monkeypatch.setenv("PRIMEMOE_GEMM_TILE_ORDER", order)
    monkeypatch.setenv("PRIMEMOE_GEMM_MERGE_TAILS", merge)
    assert_same_bits_under_env(monkeypatch, "PRIMEMOE_FC1_ACTIVATION", "two_warps", "warps", fc1_ops(gpu),
                               "the helper warp")


@pytest.mark.parametrize("order", ["static", "claimed"])
@pytest.mark.parametrize("counts, hidden, spare", [([300, 0, 1, 700, 129, 64, 1000, 63] * 2, 2304, 300),
                                                   ([1, 129, 300] * 60, 64, 37), ([1, 129, 300] * 60, 192, 37),
                                                   ([129], 256, 37)])
def test_merged_activation_by_consumers_gives_the_warps_bits(monkeypatch, counts, hidden, spare, order):
    """FC1's activation around a 192-row tile computed by the consumers, for its tail (`tail`) and also for the tile
    before it (`consumers`, the default), against the activation warps' jobs (`warps`; PRIMEMOE_FC1_MERGED_ACTIVATION
    selects), h kept and not, merged tails forced: bitwise equal, every element written."""
    gpu = engine_operands(counts, hidden, 1408, seed=31, device="cuda", spare_rows=spare)
    monkeypatch.setenv("PRIMEMOE_GEMM_TILE_ORDER", order)
    monkeypatch.setenv("PRIMEMOE_GEMM_MERGE_TAILS", "1")
    for other in ("tail", "consumers"):
        assert_same_bits_under_env(monkeypatch, "PRIMEMOE_FC1_MERGED_ACTIVATION", "warps", other, fc1_ops(gpu),
                                   f"the consumers' activation ({other})")


@pytest.mark.parametrize("order", ["static", "claimed"])
@pytest.mark.parametrize("counts", [[300, 0, 1, 700, 129, 64, 1000, 63] * 2, [64, 64, 64], [1], [0, 0, 5000, 0]])
@pytest.mark.parametrize("hidden, inter", [(2048, 1536), (2304, 1408)])
def test_paired_row_blocks_give_the_unpaired_bits(monkeypatch, counts, hidden, inter, order):
    """2-CTA clusters over pairs of row blocks that share the weight tile by multicast where both blocks are one
    expert's (PRIMEMOE_GEMM_PAIRS=1), placed statically or claimed (rank 0 claims, passes the pair to rank 1),
    against unpaired tiles: bitwise equal on the variants built with pairs (FC1, FC2), with pairs inside and
    across experts, odd numbers of row blocks and rows past the routed ones. 2304 x 1408 gives 36 and 22
    k-slices per tile, so the ring's stage and phase differ from tile to tile (with 2048 x 1536 every tile
    starts at stage 0, phase 0), which a drift between the two CTAs' rings would break."""
    gpu = engine_operands(counts, hidden, inter, seed=13, device="cuda")
    ops_under_test = {
        "fc1": lambda: ops.fc1_swiglu(gpu.xs, gpu.w1, gpu.offsets, True),
        "fc2": lambda: (ops.expert_gemm(gpu.a, gpu.w2, gpu.offsets, False, gpu.row_weight),),
    }
    monkeypatch.setenv("PRIMEMOE_GEMM_TILE_ORDER", order)
    monkeypatch.setenv("PRIMEMOE_GEMM_MERGE_TAILS", "0")  # not with pairs: the unpaired run must not merge
    before = ops.paired_gemm_launches(torch.cuda.current_device())
    assert_same_bits_under_env(monkeypatch, "PRIMEMOE_GEMM_PAIRS", "0", "1", ops_under_test, "paired row blocks")
    assert ops.paired_gemm_launches(torch.cuda.current_device()) == before + len(ops_under_test), \
        "a launch asked to pair ran unpaired (no cluster launch)"


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


@pytest.mark.parametrize("order", ["static", "claimed"])
@pytest.mark.parametrize("counts, hidden, inter, spare", [([300, 0, 1, 700, 129, 64, 1000, 63] * 2, 2304, 1408, 37),
                                                          ([300, 0, 1, 700, 129, 64, 1000, 63] * 2, 2304, 1408, 300),
                                                          ([1, 129, 300] * 60, 64, 256, 37),
                                                          ([1, 129, 300] * 60, 192, 256, 37),
                                                          ([0, 0, 5000, 0], 2048, 1536, 37), ([129], 256, 256, 37)])
def test_merged_tail_tiles_match_cpu(monkeypatch, counts, hidden, inter, spare, order):
    """An expert's first 192 rows as one tile where its rows are an odd multiple of 64 (PRIMEMOE_GEMM_MERGE_TAILS=1):
    FC1 (h kept and not) and the plain-store GEMM (FC2's variant, here over rows x w1 so that K = hidden; weighted
    and not) against the CPU kernels on poisoned outputs; outside the tails bitwise those of unmerged tiles (the same
    wgmma sequence), and no launch pairs. One and three k-slices per tile (hidden 64, 192: a merged tile's loop runs
    once), 36 (2304: ring positions differ from tile to tile), several merged tiles per CTA, experts of 64 rows
    beside them (half tiles), a lone merged tile, both tile orders; 37 rows past the routed ones (part of a tile with
    no k-slice) and 300 (several such tiles, after the merged ones)."""
    monkeypatch.setenv("PRIMEMOE_GEMM_TILE_ORDER", order)
    gpu = engine_operands(counts, hidden, inter, seed=23, device="cuda", spare_rows=spare)
    cpu = engine_operands(counts, hidden, inter, seed=23, spare_rows=spare)
    tails = merged_tail_rows(cpu.offsets)
    assert tails.any()
    runs = {}
    for merge in ("0", "1"):
        monkeypatch.setenv("PRIMEMOE_GEMM_MERGE_TAILS", merge)
        before = ops.paired_gemm_launches(torch.cuda.current_device())
        a, h = fc1_matches_cpu(gpu, cpu)
        a_only = ops.fc1_swiglu(gpu.xs, gpu.w1, gpu.offsets, False)[0]
        assert torch.equal(a_only, a)
        poison_caching_allocator()
        o = ops.expert_gemm(gpu.xs, gpu.w1, gpu.offsets, False)
        assert_rows_close("store", o, ops.expert_gemm(cpu.xs, cpu.w1, cpu.offsets, False))
        poison_caching_allocator()
        ow = ops.expert_gemm(gpu.xs, gpu.w1, gpu.offsets, False, gpu.row_weight)
        assert_rows_close("store weighted", ow, ops.expert_gemm(cpu.xs, cpu.w1, cpu.offsets, False, cpu.row_weight))
        if merge == "1":
            assert ops.paired_gemm_launches(torch.cuda.current_device()) == before, "a merging launch paired"
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
    gpu = engine_operands([300, 0, 700, 129, 1000, 64, 500, 2], 2048, 1536, seed=5, device="cuda")
    device = torch.cuda.current_device()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a, h = ops.fc1_swiglu(gpu.xs, gpu.w1, gpu.offsets, True)
    assert ops.paired_gemm_launches(device) == 1, "the captured launch ran unpaired"
    a.fill_(float("nan"))
    h.fill_(float("nan"))
    graph.replay()
    a_eager, h_eager = ops.fc1_swiglu(gpu.xs, gpu.w1, gpu.offsets, True)
    torch.cuda.synchronize()
    assert ops.paired_gemm_launches(device) == 2, "the eager launch after the capture ran unpaired"
    assert not a_eager.isnan().any() and not h_eager.isnan().any(), "NaN (unwritten output)"
    assert torch.equal(a, a_eager) and torch.equal(h, h_eager), "the graph's replay differs from the eager launch"
    print("ok")
""")


def test_first_paired_launch_inside_graph_capture():
    """A process whose first FC1 launch (paired by default: 26 row blocks x 12 column tiles) is captured into a
    CUDA graph, with every first-launch step of the host (kernel attributes, tensor maps, the cluster occupancy
    query): the capture must not break, the captured launch and the eager one after it run paired, with the same
    bits. In a fresh process, as those steps run once per process."""
    env = {k: v for k, v in os.environ.items() if k not in ("PRIMEMOE_GEMM_PAIRS", "PRIMEMOE_GEMM_TILE_ORDER")}
    env["PRIMEMOE_GEMM_MERGE_TAILS"] = "0"  # merged tails take the place of pairs
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", FIRST_LAUNCH_IN_CAPTURE, tests_dir], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr


def test_gemm_overrides_are_checked(monkeypatch):
    gpu = engine_operands([64], 256, 256, device="cuda")
    monkeypatch.setenv("PRIMEMOE_GEMM_TILE_ORDER", "dynamic")
    with pytest.raises(RuntimeError, match="PRIMEMOE_GEMM_TILE_ORDER: expected static or claimed"):
        ops.fc1_swiglu(gpu.xs, gpu.w1, gpu.offsets, True)
    monkeypatch.delenv("PRIMEMOE_GEMM_TILE_ORDER")
    monkeypatch.setenv("PRIMEMOE_GEMM_PAIRS", "yes")
    with pytest.raises(RuntimeError, match="PRIMEMOE_GEMM_PAIRS: expected 0 or 1"):
        ops.fc1_swiglu(gpu.xs, gpu.w1, gpu.offsets, True)
    monkeypatch.delenv("PRIMEMOE_GEMM_PAIRS")
    monkeypatch.setenv("PRIMEMOE_GEMM_MERGE_TAILS", "on")
    with pytest.raises(RuntimeError, match="PRIMEMOE_GEMM_MERGE_TAILS: expected 0 or 1"):
        ops.fc1_swiglu(gpu.xs, gpu.w1, gpu.offsets, True)
    monkeypatch.delenv("PRIMEMOE_GEMM_MERGE_TAILS")
    monkeypatch.setenv("PRIMEMOE_FC1_ACTIVATION", "fast")
    with pytest.raises(RuntimeError, match="PRIMEMOE_FC1_ACTIVATION: expected warps, two_warps or consumers"):
        ops.fc1_swiglu(gpu.xs, gpu.w1, gpu.offsets, True)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("routing", ["uniform", "skewed", "masked"])
@pytest.mark.parametrize("tokens", [1, 17, 4095])
def test_fc1_gather_equals_fc1_of_gathered_rows(monkeypatch, tokens, routing, shape):
    """The gather fused into FC1's loads (cp.async by the producer's first warp) gives the same bits
    as FC1 over rows gathered beforehand, and matches the CPU kernel; padding rows are zeros."""
    monkeypatch.setenv("PRIMEMOE_GEMM_MERGE_TAILS", "0")  # FC1's 192-row tiles sum their tails in another order
    hidden, inter = SHAPES[shape]
    g = gather_operands(tokens, 8, 16, hidden, inter, routing, seed=tokens, device="cuda")
    poison_caching_allocator()
    a, h = ops.fc1_swiglu_gather(g.x, g.row_to_slot, g.top_k, g.w1, g.offsets, True)
    xs = ops.gather_rows(g.x, g.row_to_slot, g.top_k, None)
    a_ref, h_ref = ops.fc1_swiglu(xs, g.w1, g.offsets, True)
    assert torch.equal(h, h_ref) and torch.equal(a, a_ref)
    cpu = ops.fc1_swiglu_gather(g.x.cpu(), g.row_to_slot.cpu(), g.top_k, g.w1.cpu(), g.offsets.cpu(), True)
    assert_rows_close("fc1 gathered h", h, cpu[1])
    assert not h[g.row_to_slot < 0].any(), "padding rows must be zeros"


@pytest.mark.parametrize("activation", ["warps", "two_warps", "consumers"])
@pytest.mark.parametrize("pairs", ["0", "1"])
@pytest.mark.parametrize("order", ["static", "claimed"])
def test_fc1_gather_schedules_give_the_bits_of_fc1(monkeypatch, order, pairs, activation):
    """The gathered FC1 in every schedule its variant has (tile order, paired row blocks sharing the weight tile,
    the activation by the producer's warps or by the consumers): the bits of FC1 over rows gathered beforehand, on
    poisoned outputs, padding rows zeros; ~1,000 rows per expert (pairs of one expert's blocks), 32 k-slices,
    half tiles, ~12 tiles per CTA."""
    monkeypatch.setenv("PRIMEMOE_GEMM_TILE_ORDER", order)
    monkeypatch.setenv("PRIMEMOE_GEMM_PAIRS", pairs)
    monkeypatch.setenv("PRIMEMOE_FC1_ACTIVATION", activation)
    monkeypatch.setenv("PRIMEMOE_GEMM_MERGE_TAILS", "0")  # the gathered FC1 has no 192-row tiles
    g = gather_operands(3000, 8, 16, 2048, 1536, "masked", seed=24, device="cuda")
    xs = ops.gather_rows(g.x, g.row_to_slot, g.top_k, None)
    a_ref, h_ref = ops.fc1_swiglu(xs, g.w1, g.offsets, True)
    before = ops.paired_gemm_launches(torch.cuda.current_device())
    poison_caching_allocator()
    a, h = ops.fc1_swiglu_gather(g.x, g.row_to_slot, g.top_k, g.w1, g.offsets, True)
    torch.cuda.synchronize()
    assert ops.paired_gemm_launches(torch.cuda.current_device()) == before + int(pairs), "pairs not as asked"
    assert not h_ref.isnan().any()
    assert torch.equal(h, h_ref) and torch.equal(a, a_ref)
    assert not h[g.row_to_slot < 0].any(), "padding rows must be zeros"


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


@pytest.mark.parametrize("schedule", [{"PRIMEMOE_GEMM_PAIRS": "0"}, {"PRIMEMOE_GEMM_PAIRS": "1"},
                                      {"PRIMEMOE_GEMM_PAIRS": "0", "PRIMEMOE_GEMM_MERGE_TAILS": "1"}],
                         ids=["unpaired", "paired", "merged_tails"])
@pytest.mark.parametrize("counts", ["mixed", "all_empty"])
def test_zero_unrouted_false_keeps_the_routed_rows(monkeypatch, counts, schedule):
    """zero_unrouted=False skips the tiles past the routed rows (300 spare rows: two whole tiles and part
    of a third) and nothing else: the routed rows are bitwise those of the zeroing run, the rest keep
    the allocator's poison. Paired row blocks forced on and off (PRIMEMOE_GEMM_PAIRS): a pair whose second
    block is past the routed rows, or absent, must not share with it. 192-row tiles forced on for FC1 and FC2 (both
    merge them where the weights are large, the EP path's FC2 too): the last expert's among them."""
    for name, value in schedule.items():
        monkeypatch.setenv(name, value)
    hidden, inter = SHAPES["small"]
    g = engine_operands(COUNTS[counts], hidden, inter, seed=5, device="cuda", spare_rows=300)
    routed = int(g.offsets[-1])
    calls = {
        "fc1_swiglu": lambda **kw: ops.fc1_swiglu(g.xs, g.w1, g.offsets, True, **kw),
        "fc2 weighted": lambda **kw: ops.expert_gemm(g.a, g.w2, g.offsets, False, g.row_weight, **kw),
        "fc1 dgrad": lambda **kw: ops.expert_gemm(g.h, g.w1, g.offsets, True, **kw),
        "fc2_dgrad_swiglu": lambda **kw: ops.fc2_dgrad_swiglu(g.dy_rows, g.w2, g.h, g.row_weight, g.offsets, **kw),
    }
    for name, call in calls.items():
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
    g = gather_operands(40, 4, 3, 256, 256, "masked", seed=4, device="cuda")
    torch.library.opcheck(ops.fc1_swiglu_gather, (g.x, g.row_to_slot, g.top_k, g.w1, g.offsets, True))
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
        assert shim.use_engine(x, w1), name
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


@pytest.mark.parametrize("pairs", ["0", "1"])
def test_fc1_producer_waits_for_rows_ready(monkeypatch, pairs):
    """The wait hook the expert-parallel path drives: satisfied counters change nothing, also with paired row
    blocks forced on (PRIMEMOE_GEMM_PAIRS=1; the heuristics pair nothing under the hook)."""
    monkeypatch.setenv("PRIMEMOE_GEMM_PAIRS", pairs)
    e = engine_operands([3, 0, 130], hidden=256, inter=256, seed=6, device="cuda")
    plain = ops.fc1_swiglu(e.xs, e.w1, e.offsets, True)
    ready = torch.full((3,), 4, dtype=torch.int64, device="cuda")
    epoch = torch.full((1,), 2, dtype=torch.int64, device="cuda")
    hooked = ops.fc1_swiglu(e.xs, e.w1, e.offsets, True, ready, epoch, 2, 0)
    assert torch.equal(hooked[0], plain[0]) and torch.equal(hooked[1], plain[1])
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


@pytest.mark.parametrize("order", ["static", "claimed"])
@pytest.mark.parametrize("experts", [256, 300])
def test_forward_ops_with_hundreds_of_experts(monkeypatch, experts, order):
    """FC1 and FC2 against the CPU kernels over hundreds of experts (empty ones, half tiles, several tiles each), so
    that the producer's walk and its handoff of decoded tiles to the consumers cross many expert boundaries."""
    monkeypatch.setenv("PRIMEMOE_GEMM_TILE_ORDER", order)
    counts = [0 if e % 5 == 0 else (37 * e) % 200 for e in range(experts)]
    gpu = engine_operands(counts, 256, 256, seed=31, device="cuda")
    cpu = engine_operands(counts, 256, 256, seed=31)
    fc1_matches_cpu(gpu, cpu)
    o = ops.expert_gemm(gpu.a, gpu.w2, gpu.offsets, False, gpu.row_weight)
    assert_rows_close("fc2 weighted", o, ops.expert_gemm(cpu.a, cpu.w2, cpu.offsets, False, cpu.row_weight))
