"""CUDA primitives against their CPU implementations, and the device-side error record."""

import pytest
import torch

from helpers import HOT_EXPERTS, OUTPUT_NAMES, make_problem, poison_caching_allocator, reference64, run_moe

import primemoe

pytestmark = pytest.mark.gpu
ops = torch.ops.primemoe


def layout_ids(tokens, top_k, num_experts, kind, seed, dtype=torch.int64):
    """Expert ids on the CPU: "random" (any id in [-1, E), duplicates included), "skewed"
    (90% of the slots on HOT_EXPERTS experts, the rest random), "one_expert" or "all_skipped"."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, num_experts, (tokens, top_k), generator=gen)
    if kind == "skewed":
        hot = torch.randint(0, HOT_EXPERTS, ids.shape, generator=gen)
        ids = torch.where(torch.rand(ids.shape, generator=gen) < 0.9, hot, ids)
    elif kind == "one_expert":
        ids = torch.full_like(ids, num_experts // 2)
    elif kind == "all_skipped":
        ids = torch.full_like(ids, -1)
    elif kind != "random":
        raise ValueError(kind)
    return ids.to(dtype)


LAYOUT_NAMES = ("expert_counts", "expert_offsets", "slot_to_row", "row_to_slot")
# Blocks of dispatch_layout.cuh: 1024 slots, more when blocks * num_local would pass 16384;
# warps take runs of 32-slot groups, 4 groups per batch of loads.
LAYOUT_CASES = {
    # name: (tokens, top_k, num_experts, expert_begin, num_local, kind)
    "no_tokens": (0, 8, 128, 0, 128, "random"),
    "no_tokens_max_local": (0, 8, 1024, 0, 1024, "random"),  # only -1 rows
    "one_slot": (1, 1, 8, 0, 8, "random"),
    "15_slots": (3, 5, 4, 0, 4, "random"),  # one partial group
    "one_block_exactly": (128, 8, 128, 0, 128, "random"),
    "4_blocks": (512, 8, 128, 0, 128, "random"),
    "49_blocks_last_partial": (6250, 8, 128, 0, 128, "random"),
    "49_blocks_skewed": (6250, 8, 128, 0, 128, "skewed"),
    "49_blocks_one_expert": (6250, 8, 128, 0, 128, "one_expert"),
    "49_blocks_all_skipped": (6250, 8, 128, 0, 128, "all_skipped"),
    "second_half_local": (6001, 8, 256, 128, 128, "random"),
    "middle_subset_skewed": (3000, 4, 64, 3, 17, "skewed"),
    "100_of_200_local": (7000, 8, 200, 50, 100, "random"),  # two threads sum each expert's counts
    "one_local_expert": (5000, 8, 8, 0, 1, "random"),
    "300_local": (20000, 3, 300, 0, 300, "random"),  # more experts than threads; 1280-slot blocks
    "max_local_experts": (1500, 8, 1024, 0, 1024, "random"),
    "max_local_16_blocks": (20000, 8, 1024, 0, 1024, "skewed"),  # 10240 slots per block
    "max_local_one_expert": (20000, 8, 1024, 0, 1024, "one_expert"),
    "qwen3_30b_16k_tokens": (16384, 8, 128, 0, 128, "skewed"),  # 128 blocks: the count-matrix bound
    "qwen3_30b_64k_tokens": (65536, 8, 128, 0, 128, "random"),  # 4096 slots per block
    "256_experts_half_local": (16384, 8, 256, 128, 128, "skewed"),
}


@pytest.mark.parametrize("row_align", [1, 7, 128])
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("case", LAYOUT_CASES)
def test_dispatch_layout_cuda_equals_cpu(case, idx_dtype, row_align):
    tokens, top_k, num_experts, begin, num_local, kind = LAYOUT_CASES[case]
    ids = layout_ids(tokens, top_k, num_experts, kind, seed=tokens, dtype=idx_dtype)
    want = ops.dispatch_layout(ids, num_experts, begin, num_local, row_align)
    got = ops.dispatch_layout(ids.cuda(), num_experts, begin, num_local, row_align)
    for name, g, w in zip(LAYOUT_NAMES, got, want):
        assert g.is_cuda and g.dtype == torch.int32, name
        assert torch.equal(g.cpu(), w), f"{name}: CUDA != CPU"


@pytest.mark.parametrize("case", ["no_tokens_max_local", "49_blocks_skewed", "max_local_16_blocks"])
def test_dispatch_layout_overwrites_poisoned_memory(case):
    """No memset: every output element, -1 rows included, is written by the kernels."""
    tokens, top_k, num_experts, begin, num_local, kind = LAYOUT_CASES[case]
    ids = layout_ids(tokens, top_k, num_experts, kind, seed=tokens + 1)
    want = ops.dispatch_layout(ids, num_experts, begin, num_local, 128)
    ids = ids.cuda()
    poison_caching_allocator()
    got = ops.dispatch_layout(ids, num_experts, begin, num_local, 128)
    for name, g, w in zip(LAYOUT_NAMES, got, want):
        assert torch.equal(g.cpu(), w), f"{name}: CUDA != CPU on poisoned memory"


def test_dispatch_layout_graph_replay_equals_cpu():
    tokens, top_k, num_experts = 6250, 8, 128
    static_ids = layout_ids(tokens, top_k, num_experts, "random", seed=1).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.dispatch_layout(static_ids, num_experts, 0, num_experts, 128)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = ops.dispatch_layout(static_ids, num_experts, 0, num_experts, 128)
    for seed, kind in enumerate(["skewed", "one_expert", "all_skipped", "random"]):
        ids = layout_ids(tokens, top_k, num_experts, kind, seed=seed + 2)
        static_ids.copy_(ids)
        graph.replay()
        for name, g, w in zip(LAYOUT_NAMES, static_out, ops.dispatch_layout(ids, num_experts, 0, num_experts, 128)):
            assert torch.equal(g.cpu(), w), f"{name} after replaying with {kind} routing"


def rows_problem(tokens, top_k, hidden, seed):
    """Token rows, routing weights and the CPU layout (row_align 128: padding rows included)."""
    gen = torch.Generator().manual_seed(seed)
    ids = layout_ids(tokens, top_k, 16, "random", seed)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    weights = torch.rand(tokens, top_k, generator=gen)
    _, _, slot_to_row, row_to_slot = ops.dispatch_layout(ids, 16, 0, 16, 128)
    return x, weights, slot_to_row, row_to_slot


ROW_SHAPES = [(1, 1, 8), (300, 8, 256), (2000, 2, 7168)]  # tokens, top_k, hidden


@pytest.mark.parametrize("with_slot_to_row", [False, True], ids=["inverted_on_device", "layout_slot_to_row"])
@pytest.mark.parametrize("scale_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ROW_SHAPES)
def test_gather_rows_cuda_equals_cpu(shape, scale_dtype, with_slot_to_row):
    x, weights, slot_to_row, row_to_slot = rows_problem(*shape, seed=1)
    scale = None if scale_dtype is None else weights.to(scale_dtype)
    want = ops.gather_rows(x, row_to_slot, shape[1], scale)
    given = (slot_to_row.cuda(),) if with_slot_to_row else ()
    got = ops.gather_rows(x.cuda(), row_to_slot.cuda(), shape[1], None if scale is None else scale.cuda(), *given)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("scale_dtype", [None, torch.float32])
def test_gather_rows_any_row_to_slot(scale_dtype):
    """Not only dispatch_layout's maps: rows that name the same slot each get its row (the CUDA
    gather walks tokens, and only one row per slot is the token's), and a slot past T * K counts
    as -1 (zeros)."""
    tokens, top_k, hidden = 40, 2, 264  # 33 16-byte vectors per row: not a multiple of the warp
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    scale = None if scale_dtype is None else torch.rand(tokens * top_k, generator=gen).to(scale_dtype)
    row_to_slot = torch.randint(-1, tokens * top_k, (300,), generator=gen, dtype=torch.int32)
    row_to_slot[:3] = 5
    row_to_slot[3], row_to_slot[4] = tokens * top_k, 2 ** 31 - 1
    want = ops.gather_rows(x, row_to_slot, top_k, scale)
    got = ops.gather_rows(x.cuda(), row_to_slot.cuda(), top_k, None if scale is None else scale.cuda())
    assert torch.equal(got.cpu(), want)
    assert torch.equal(got[0], got[2]) and not got[3].any() and not got[4].any()


# tokens, top_k, hidden: more than 32 slots per token (the warp takes them 32 at a time), rows of 6401 vectors,
# Qwen3-235B-A22B's rows at T = 8192.
GATHER_EDGES = {"top_k_33": (300, 33, 256), "long_rows": (40, 4, 51208), "many_tokens": (8192, 8, 4096)}


@pytest.mark.parametrize("case", GATHER_EDGES)
def test_gather_rows_edges_on_poisoned_memory(case):
    tokens, top_k, hidden = GATHER_EDGES[case]
    x, _, slot_to_row, row_to_slot = rows_problem(tokens, top_k, hidden, seed=6)
    want = ops.gather_rows(x, row_to_slot, top_k, None)
    x, row_to_slot, slot_to_row = x.cuda(), row_to_slot.cuda(), slot_to_row.cuda()
    poison_caching_allocator()
    assert torch.equal(ops.gather_rows(x, row_to_slot, top_k, None, slot_to_row).cpu(), want)


@pytest.mark.parametrize("scale_dtype", [None, torch.float32])
@pytest.mark.parametrize("case", GATHER_EDGES)
def test_gather_rows_with_expert_offsets_writes_the_routed_rows_alone(case, scale_dtype):
    """The rows below expert_offsets[-1] (padding rows inside the experts included) as without the offsets; the
    rows past it (the layout's worst-case allocation) are left as the poisoned memory held them."""
    tokens, top_k, hidden = GATHER_EDGES[case]
    x, weights, slot_to_row, row_to_slot = rows_problem(tokens, top_k, hidden, seed=7)
    scale = None if scale_dtype is None else weights.to(scale_dtype).cuda()
    offsets = ops.dispatch_layout(layout_ids(tokens, top_k, 16, "random", 7), 16, 0, 16, 128)[1].cuda()
    x, row_to_slot, slot_to_row = x.cuda(), row_to_slot.cuda(), slot_to_row.cuda()
    want = ops.gather_rows(x, row_to_slot, top_k, scale, slot_to_row)
    routed = int(offsets[-1])
    assert 0 < routed < row_to_slot.numel()
    poison_caching_allocator()
    got = ops.gather_rows(x, row_to_slot, top_k, scale, slot_to_row, offsets)
    assert torch.equal(got[:routed], want[:routed])
    assert got[routed:].isnan().all(), "a row past the routed ones was written"


def test_misaligned_rows_are_refused():
    """A contiguous view at an element offset that is not a multiple of 8 would fault in the 16-byte row copies
    and TMA loads: the ops and the layer refuse it by name."""
    p = make_problem(64, 256, 128, 8, 2, seed=8, device="cuda")
    storage = torch.empty(p.x.numel() + 1, dtype=p.x.dtype, device="cuda")
    shifted = storage[1:].view(p.x.shape)
    shifted.copy_(p.x)
    _, _, slot_to_row, row_to_slot = ops.dispatch_layout(p.topk_idx, 8, 0, 8, 128)
    with pytest.raises(RuntimeError, match="src: expected 16-byte aligned data"):
        ops.gather_rows(shifted, row_to_slot, 2, None, slot_to_row)
    with pytest.raises(ValueError, match="x: expected 16-byte aligned data"):
        primemoe.moe(shifted, p.topk_idx, p.topk_weights, p.w1, p.w2)
    assert torch.equal(ops.gather_rows(shifted.clone(), row_to_slot, 2, None, slot_to_row),
                       ops.gather_rows(p.x, row_to_slot, 2, None, slot_to_row))


@pytest.mark.parametrize("weight_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ROW_SHAPES)
def test_combine_reduce_cuda_matches_cpu(shape, weight_dtype):
    tokens, top_k, hidden = shape
    _, weights, slot_to_row, row_to_slot = rows_problem(*shape, seed=2)
    rows = torch.randn(row_to_slot.numel(), hidden).bfloat16()
    weights = None if weight_dtype is None else weights.to(weight_dtype)
    want = ops.combine_reduce(rows, slot_to_row, weights)
    got = ops.combine_reduce(rows.cuda(), slot_to_row.cuda(), None if weights is None else weights.cuda())
    # Both accumulate in fp32 in k order; fma vs multiply-add may move the final bf16 rounding by an ulp.
    torch.testing.assert_close(got.cpu(), want)


@pytest.mark.parametrize("shape", ROW_SHAPES)
def test_combine_reduce_with_local_rows_cuda_matches_cpu(shape):
    """Every other routed slot's row taken from local_rows (slot map -2 - r), as the expert-parallel combine does
    for a rank's own slots."""
    tokens, top_k, hidden = shape
    _, weights, slot_to_row, row_to_slot = rows_problem(*shape, seed=3)
    rows = torch.randn(row_to_slot.numel(), hidden).bfloat16()
    local = torch.randn(row_to_slot.numel(), hidden).bfloat16()
    flip = (torch.arange(slot_to_row.numel()).view(slot_to_row.shape) % 2 == 0) & (slot_to_row >= 0)
    mixed = torch.where(flip, -2 - slot_to_row, slot_to_row)
    want = ops.combine_reduce(rows, mixed, weights, local)
    got = ops.combine_reduce(rows.cuda(), mixed.cuda(), weights.cuda(), local.cuda())
    torch.testing.assert_close(got.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ROW_SHAPES)
def test_gather_scalars_cuda_equals_cpu(shape, dtype):
    """The routing weight of every expert-major row (padding rows included: 0) and each slot's value of its row,
    on poisoned memory: the same bits as the CPU op."""
    _, weights, slot_to_row, row_to_slot = rows_problem(*shape, seed=4)
    values = torch.randn(row_to_slot.numel()).to(dtype)
    for index, vals in ((row_to_slot, weights.reshape(-1).to(dtype)), (slot_to_row, values)):
        poison_caching_allocator()
        got = ops.gather_scalars(vals.cuda(), index.cuda())
        want = ops.gather_scalars(vals, index)
        assert torch.equal(got.cpu(), want)
        assert torch.all(want[index < 0] == 0) and not want[index >= 0].eq(0).all()


@pytest.mark.parametrize("shape", ROW_SHAPES)
def test_slot_dot_cuda_matches_cpu(shape):
    tokens, top_k, hidden = shape
    _, _, slot_to_row, row_to_slot = rows_problem(*shape, seed=3)
    a, b = torch.randn(2, row_to_slot.numel(), hidden).bfloat16()
    want = ops.slot_dot(a, b, slot_to_row)
    got = ops.slot_dot(a.cuda(), b.cuda(), slot_to_row.cuda())
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-3)
    assert torch.all(got.cpu()[slot_to_row < 0] == 0)


# ---------------------------------------------------------------- copy_routed_rows


def routed_offsets(num_experts, routed, seed):
    """int32 [E + 1] expert offsets on the CPU: random expert sizes (empty ones included) adding up to ``routed``."""
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randint(0, routed + 1, (num_experts - 1,), generator=gen).sort().values
    return torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([routed])]).int()


def random_rows(num_rows, width, dtype, seed):
    """Random bit patterns (NaNs included: the copy is compared bitwise)."""
    gen = torch.Generator().manual_seed(seed)
    row_bytes = width * torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (num_rows, row_bytes), generator=gen, dtype=torch.uint8).view(dtype).cuda()


UNROUTED_BYTE = 0xA5  # every byte of the source rows past the bound: such a row in the copy was copied
COPY_CASES = {
    # name: (rows, width, dtype, experts, routed rows)
    "nothing_routed": (5000, 2048, torch.bfloat16, 128, 0),  # T = 0: offsets all zero
    "half_routed_30b_rows": (40000, 2048, torch.bfloat16, 128, 19937),
    "all_routed": (4097, 2048, torch.bfloat16, 8, 4097),
    "one_row": (1, 8, torch.bfloat16, 1, 1),
    "one_row_of_many": (3000, 7168, torch.bfloat16, 16, 1),
    "16_byte_rows": (70001, 8, torch.bfloat16, 32, 33333),  # more vectors than one pass of the grid
    "fp32_rows": (3000, 12, torch.float32, 4, 1234),
    "byte_rows": (999, 48, torch.uint8, 3, 998),
    "bound_past_the_rows": (600, 64, torch.bfloat16, 2, 700),  # clamped: every row, nothing beyond
}


@pytest.mark.parametrize("case", COPY_CASES)
def test_copy_routed_rows_copies_exactly_the_routed_rows(case):
    num_rows, width, dtype, experts, routed = COPY_CASES[case]
    rows = random_rows(num_rows, width, dtype, seed=num_rows)
    bound = min(routed, num_rows)
    rows.view(torch.uint8)[bound:] = UNROUTED_BYTE
    offsets = routed_offsets(experts, routed, seed=width).cuda()
    poison_caching_allocator()
    got = ops.copy_routed_rows(rows, offsets)
    assert got.shape == rows.shape and got.dtype == rows.dtype
    got_bytes = got.view(torch.uint8)
    assert torch.equal(got_bytes[:bound], rows.view(torch.uint8)[:bound])
    assert not (got_bytes[bound:] == UNROUTED_BYTE).all(dim=1).any(), "a row past the bound was copied"


@pytest.mark.parametrize("case", COPY_CASES)
def test_zero_unrouted_rows_zeroes_exactly_the_rows_past_the_bound(case):
    num_rows, width, dtype, experts, routed = COPY_CASES[case]
    rows = random_rows(num_rows, width, dtype, seed=num_rows + 1)
    rows.view(torch.uint8)[:, 0] |= 1  # no row starts as zeros
    before = rows.clone()
    bound = min(routed, num_rows)
    ops.zero_unrouted_rows(rows, routed_offsets(experts, routed, seed=width).cuda())
    got = rows.view(torch.uint8)
    assert torch.equal(got[:bound], before.view(torch.uint8)[:bound])
    assert not got[bound:].any()


def test_zero_unrouted_rows_graph_replay_follows_the_offsets():
    num_rows, width, experts = 9000, 2048, 128
    rows = random_rows(num_rows, width, torch.bfloat16, seed=5)
    offsets = routed_offsets(experts, 4000, seed=5).cuda()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.zero_unrouted_rows(rows, offsets)
    for seed, routed in enumerate([0, 8999, 9000, 17, 4000]):
        source = random_rows(num_rows, width, torch.bfloat16, seed=seed + 6)
        source.view(torch.uint8)[:, 0] |= 1
        rows.copy_(source)
        offsets.copy_(routed_offsets(experts, routed, seed=seed + 6))
        graph.replay()
        assert torch.equal(rows[:routed].view(torch.int16), source[:routed].view(torch.int16)), routed
        assert not rows[routed:].view(torch.int16).any(), routed


def test_copy_routed_rows_graph_replay_equals_eager():
    num_rows, width, experts = 9000, 2048, 128
    rows = random_rows(num_rows, width, torch.bfloat16, seed=1)
    offsets = routed_offsets(experts, 4000, seed=1).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.copy_routed_rows(rows, offsets)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = ops.copy_routed_rows(rows, offsets)
    for seed, routed in enumerate([0, 8999, 9000, 17, 4000]):
        rows.copy_(random_rows(num_rows, width, torch.bfloat16, seed=seed + 2))
        offsets.copy_(routed_offsets(experts, routed, seed=seed + 2))
        graph.replay()
        eager = ops.copy_routed_rows(rows, offsets)
        assert torch.equal(static_out[:routed].view(torch.int16), eager[:routed].view(torch.int16)), routed
        assert torch.equal(eager[:routed].view(torch.int16), rows[:routed].view(torch.int16)), routed


def test_opcheck_copy_routed_rows_on_cuda():
    # Every row routed: rows past the bound are undefined, and opcheck compares whole outputs.
    rows = torch.randn(300, 64, device="cuda").bfloat16()
    torch.library.opcheck(ops.copy_routed_rows, (rows, routed_offsets(4, 300, seed=3).cuda()))


def test_copy_routed_rows_argument_checks_on_cuda():
    rows = random_rows(32, 64, torch.bfloat16, seed=4)
    offsets = routed_offsets(4, 20, seed=4)
    with pytest.raises(RuntimeError, match="expert_offsets: expected it on the same device as the rows"):
        ops.copy_routed_rows(rows, offsets)
    misaligned = rows.view(-1)[4:4 + 31 * 64].view(31, 64)  # 8 bytes into the allocation
    with pytest.raises(RuntimeError, match="rows: expected 16-byte aligned data"):
        ops.copy_routed_rows(misaligned, offsets.cuda())


# ---------------------------------------------------------------- device-side error record

BAD_T, BAD_K = 5, 1


def problem_with_bad_id(bad_id=999, idx_dtype=torch.int64):
    """A small CUDA problem whose slot [BAD_T, BAD_K] holds ``bad_id``; also returns the same ids with -1 there."""
    problem = make_problem(64, 256, 128, 8, 2, routing="uniform", seed=12, device="cuda", idx_dtype=idx_dtype)
    skipped = problem.topk_idx.clone()
    skipped[BAD_T, BAD_K] = -1
    problem.topk_idx[BAD_T, BAD_K] = bad_id
    return problem, skipped


def bad_id_message(bad_id):
    return rf"topk_idx\[{BAD_T}, {BAD_K}\] = {bad_id} is not an expert id"


@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("bad_id", [999, 8, -5])
def test_bad_id_is_reported_by_check_errors_and_skipped(bad_id, idx_dtype):
    problem, skipped = problem_with_bad_id(bad_id, idx_dtype)
    got = ops.dispatch_layout(problem.topk_idx, 8, 0, 8, 1)  # no host sync, no exception at launch
    with pytest.raises(primemoe.DeviceError, match=bad_id_message(bad_id)):
        primemoe.check_errors()
    primemoe.check_errors()  # reporting cleared the record
    # The bad slot is laid out exactly like a skipped one: it adds nothing downstream.
    for name, g, w in zip(LAYOUT_NAMES, got, ops.dispatch_layout(skipped, 8, 0, 8, 1)):
        assert torch.equal(g, w), name


def test_bad_id_in_moe_surfaces_once_and_adds_nothing():
    problem, skipped = problem_with_bad_id()
    # The record is read by check_errors() or, if the layout kernel has already finished by then,
    # by a later primitive launched inside this same moe() call: either way exactly once.
    try:
        with torch.no_grad():
            y = primemoe.moe(problem.x, problem.topk_idx, problem.topk_weights, problem.w1, problem.w2)
    except RuntimeError as error:
        assert "999" in str(error) and f"[{BAD_T}, {BAD_K}]" in str(error), str(error)
        y = None
    else:
        with pytest.raises(primemoe.DeviceError, match=bad_id_message(999)):
            primemoe.check_errors()
    primemoe.check_errors()
    if y is not None:
        clean = problem.with_idx(skipped)
        assert torch.equal(y, run_moe(primemoe.moe, clean).y), "the bad slot changed y"
        torch.testing.assert_close(y, reference64(clean).y.to(y.dtype), rtol=2e-2, atol=2e-2)


def test_bad_id_raises_at_the_next_primemoe_call():
    problem, skipped = problem_with_bad_id()
    ops.dispatch_layout(problem.topk_idx, 8, 0, 8, 1)
    torch.cuda.synchronize()  # the record is now written
    good = problem.with_idx(skipped)
    with pytest.raises(RuntimeError, match=bad_id_message(999)):
        primemoe.moe(good.x, good.topk_idx, good.topk_weights, good.w1, good.w2)
    # Reporting cleared it: the process stays usable.
    out = run_moe(primemoe.moe, good)
    for name in OUTPUT_NAMES:
        assert not getattr(out, name).isnan().any(), name
    primemoe.check_errors()
