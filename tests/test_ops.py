"""torch.ops.primemoe on CPU: schemas and fake kernels (opcheck), primitive semantics,
primemoe.moe == reference, and torch.compile(fullgraph=True) through the ops."""

import re

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils.flop_counter import FlopCounterMode

from engine_cases import engine_operands
from helpers import ExpertLayer, OUTPUT_NAMES, make_problem, run_module, run_moe, run_python

import primemoe

ops = torch.ops.primemoe
T, H, I, E, K = 9, 16, 8, 4, 2


@pytest.fixture
def problem():
    return make_problem(T, H, I, E, K, routing="masked", seed=6)


def random_ids(tokens, top_k, num_experts, seed, dtype=torch.int64):
    """Ids in [-1, E) with skipped slots and duplicates: the layout must handle any of them."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-1, num_experts, (tokens, top_k), generator=gen).to(dtype)


# ---------------------------------------------------------------- opcheck


@pytest.mark.parametrize("keep_fc1", [True, False])
def test_opcheck_moe_forward(problem, keep_fc1):
    p = problem
    args = (p.x.requires_grad_(), p.topk_idx, p.topk_weights.requires_grad_(), p.w1.requires_grad_(),
            p.w2.requires_grad_(), "bf16", keep_fc1)
    torch.library.opcheck(ops.moe_forward, args)


@pytest.mark.parametrize("with_fc1", [True, False])
def test_opcheck_moe_backward(problem, with_fc1):
    p = problem
    _, fc1_out = ops.moe_forward(p.x, p.topk_idx, p.topk_weights, p.w1, p.w2, "bf16", with_fc1)
    args = (p.dy, p.x, p.topk_idx, p.topk_weights, p.w1, p.w2, fc1_out if with_fc1 else None, "bf16")
    torch.library.opcheck(ops.moe_backward, args)


@pytest.mark.parametrize("row_align", [1, 128])
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_opcheck_dispatch_layout(row_align, idx_dtype):
    torch.library.opcheck(ops.dispatch_layout, (random_ids(T, K, E, 7, idx_dtype), E, 0, E, row_align))


def layout(topk_idx, row_align=1):
    return ops.dispatch_layout(topk_idx, E, 0, E, row_align)


@pytest.mark.parametrize("scale_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_slot_to_row", [False, True])
def test_opcheck_gather_rows(problem, scale_dtype, with_slot_to_row):
    _, _, slot_to_row, row_to_slot = layout(problem.topk_idx, row_align=4)
    scale = None if scale_dtype is None else problem.topk_weights.to(scale_dtype)
    args = (problem.x, row_to_slot, K, scale) + ((slot_to_row,) if with_slot_to_row else ())
    torch.library.opcheck(ops.gather_rows, args)


def test_opcheck_gather_rows_with_expert_offsets(problem):
    _, offsets, slot_to_row, row_to_slot = layout(problem.topk_idx, row_align=4)
    torch.library.opcheck(ops.gather_rows, (problem.x, row_to_slot, K, None, slot_to_row, offsets))
    got = ops.gather_rows(problem.x, row_to_slot, K, None, slot_to_row, offsets)
    assert torch.equal(got, ops.gather_rows(problem.x, row_to_slot, K, None, slot_to_row))


@pytest.mark.parametrize("weight_dtype", [None, torch.float32, torch.bfloat16])
def test_opcheck_combine_reduce(problem, weight_dtype):
    slot_to_row = layout(problem.topk_idx)[2]
    rows = torch.randn(T * K, H).bfloat16()
    weights = None if weight_dtype is None else problem.topk_weights.to(weight_dtype)
    torch.library.opcheck(ops.combine_reduce, (rows, slot_to_row, weights))


def test_opcheck_slot_dot(problem):
    slot_to_row = layout(problem.topk_idx)[2]
    a, b = torch.randn(2, T * K, 2 * I).bfloat16()
    torch.library.opcheck(ops.slot_dot, (a, b, slot_to_row))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_gather_scalars(problem, dtype):
    slot_to_row = layout(problem.topk_idx, row_align=4)[2]
    values = torch.randn(T * K).to(dtype)
    torch.library.opcheck(ops.gather_scalars, (values, slot_to_row))


@pytest.mark.parametrize("dtype, width", [(torch.bfloat16, 16), (torch.float32, 4), (torch.uint8, 32)])
def test_opcheck_copy_routed_rows(dtype, width):
    rows = torch.randint(0, 100, (12, width)).to(dtype)
    torch.library.opcheck(ops.copy_routed_rows, (rows, torch.tensor([0, 4, 4, 9], dtype=torch.int32)))


def test_copy_routed_rows_keeps_the_routed_rows():
    rows = torch.randn(12, 8).bfloat16()
    got = ops.copy_routed_rows(rows, torch.tensor([0, 4, 4, 9], dtype=torch.int32))
    assert got.shape == rows.shape and got.dtype == rows.dtype and got.data_ptr() != rows.data_ptr()
    assert torch.equal(got[:9], rows[:9])


@pytest.mark.parametrize("dtype, width", [(torch.bfloat16, 16), (torch.float32, 4)])
def test_opcheck_zero_unrouted_rows(dtype, width):
    rows = torch.randint(1, 100, (12, width)).to(dtype)
    torch.library.opcheck(ops.zero_unrouted_rows, (rows, torch.tensor([0, 4, 4, 9], dtype=torch.int32)))


@pytest.mark.parametrize("bound, zeroed_from", [(9, 9), (0, 0), (12, 12), (15, 12), (-3, 0)])
def test_zero_unrouted_rows_zeroes_the_rows_past_the_bound_in_place(bound, zeroed_from):
    rows = torch.randn(12, 8).bfloat16() + 10
    before = rows.clone()
    ops.zero_unrouted_rows(rows, torch.tensor([0, min(bound, 4), bound], dtype=torch.int32))
    assert torch.equal(rows[:zeroed_from], before[:zeroed_from])
    assert torch.all(rows[zeroed_from:] == 0)


@pytest.fixture
def engine():
    return engine_operands([3, 0, 130], hidden=64, inter=256, seed=8)


@pytest.mark.parametrize("w_kn", [False, True])
def test_opcheck_expert_gemm(engine, w_kn):
    rows, w = (engine.a, engine.w2) if not w_kn else (engine.h, engine.w1)
    torch.library.opcheck(ops.expert_gemm, (rows, w, engine.offsets, w_kn))


@pytest.mark.parametrize("keep_fc1", [True, False])
def test_opcheck_fc1_swiglu(engine, keep_fc1):
    torch.library.opcheck(ops.fc1_swiglu, (engine.xs, engine.w1, engine.offsets, keep_fc1))


def test_opcheck_row_gemms_with_zero_unrouted_false(engine):
    e = engine
    no_zeros = {"zero_unrouted": False}
    torch.library.opcheck(ops.fc1_swiglu, (e.xs, e.w1, e.offsets, True), no_zeros)
    torch.library.opcheck(ops.expert_gemm, (e.a, e.w2, e.offsets, False, e.row_weight), no_zeros)
    torch.library.opcheck(ops.fc2_dgrad_swiglu, (e.dy_rows, e.w2, e.h, e.row_weight, e.offsets), no_zeros)
    torch.library.opcheck(ops.expert_gemm, (e.h, e.w1, e.offsets, True), no_zeros)


def test_opcheck_expert_gemm_with_row_weight(engine):
    torch.library.opcheck(ops.expert_gemm, (engine.a, engine.w2, engine.offsets, False, engine.row_weight))


def test_expert_gemm_row_weight_scales_each_row(engine):
    e = engine
    plain = ops.expert_gemm(e.a, e.w2, e.offsets, False).double()
    scaled = ops.expert_gemm(e.a, e.w2, e.offsets, False, e.row_weight).double()
    torch.testing.assert_close(scaled, plain * e.row_weight.double().unsqueeze(1), rtol=1e-2, atol=1e-2)
    with pytest.raises(RuntimeError, match="row_weight: expected a contiguous float32 vector"):
        ops.expert_gemm(e.a, e.w2, e.offsets, False, e.row_weight[:-1])


def test_opcheck_fc1_swiglu_with_rows_ready(engine):
    ready, epoch = torch.full((3,), 2, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    torch.library.opcheck(ops.fc1_swiglu, (engine.xs, engine.w1, engine.offsets, True, ready, epoch, 2, 0))


def test_fc1_rows_ready_arguments_are_checked(engine):
    e = engine
    with pytest.raises(RuntimeError, match="rows_ready: expected one counter per expert"):
        ops.fc1_swiglu(e.xs, e.w1, e.offsets, True, torch.zeros(2, dtype=torch.int64), torch.ones(1, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="epoch: only meaningful together with rows_ready"):
        ops.fc1_swiglu(e.xs, e.w1, e.offsets, True, None, torch.ones(1, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="rows_ready: expected a contiguous int64 vector"):
        ops.fc1_swiglu(e.xs, e.w1, e.offsets, True, torch.zeros(3, dtype=torch.int32), torch.ones(1, dtype=torch.int64))


def test_opcheck_gemms_with_the_dispatch_hook(engine):
    """The overlapped path's arguments: FC1 with the dispatch's tile counter and overlap_sms, FC2's dgrad with the
    wait hook (the CPU kernels check them; nothing waits)."""
    e = engine
    ready, epoch = torch.full((3,), 2, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    counter = torch.zeros(1, dtype=torch.int32)
    torch.library.opcheck(ops.fc1_swiglu, (e.xs, e.w1, e.offsets, True, ready, epoch, 2, 0),
                          {"tile_counter": counter, "overlap_sms": 16})
    torch.library.opcheck(ops.fc2_dgrad_swiglu, (e.dy_rows, e.w2, e.h, e.row_weight, e.offsets, True, ready, epoch, 2,
                                                 0), {"overlap_sms": 16})


def test_dispatch_hook_arguments_are_checked(engine):
    e = engine
    ready, epoch = torch.full((3,), 2, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="overlap_sms: only with rows_ready"):
        ops.fc1_swiglu(e.xs, e.w1, e.offsets, True, overlap_sms=16)
    with pytest.raises(RuntimeError, match="overlap_sms: expected >= 0"):
        ops.fc1_swiglu(e.xs, e.w1, e.offsets, True, ready, epoch, overlap_sms=-1)
    with pytest.raises(RuntimeError, match="tile_counter: only meaningful together with rows_ready"):
        ops.fc1_swiglu(e.xs, e.w1, e.offsets, True, tile_counter=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="tile_counter: expected a 1-element int32 tensor"):
        ops.fc1_swiglu(e.xs, e.w1, e.offsets, True, ready, epoch, tile_counter=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="overlap_sms: only with rows_ready"):
        ops.fc2_dgrad_swiglu(e.dy_rows, e.w2, e.h, e.row_weight, e.offsets, overlap_sms=16)
    with pytest.raises(RuntimeError, match="rows_ready: expected one counter per expert"):
        ops.fc2_dgrad_swiglu(e.dy_rows, e.w2, e.h, e.row_weight, e.offsets, True, ready[:2], epoch)


def test_expert_gemm_publishing_its_rows(engine):
    """done_*: the row blocks published for a combine alongside (the CPU kernel publishes every block: flags = the
    epoch, counts back to 0); checked arguments."""
    rows, w2 = engine.a, engine.w2
    w2 = torch.randn(w2.shape[0], 256, w2.shape[2]).bfloat16()  # published results need whole 256-column tiles
    blocks = rows.shape[0] // 64 + 1
    flags, counts = torch.zeros(blocks, dtype=torch.int64), torch.full((blocks,), 7, dtype=torch.int32)
    epoch = torch.full((1,), 5, dtype=torch.int64)
    plain = ops.expert_gemm(rows, w2, engine.offsets, False)
    published = ops.expert_gemm(rows, w2, engine.offsets, False, done_flags=flags, done_counts=counts,
                                done_epoch=epoch, done_sms=16)
    assert torch.equal(published, plain)
    assert torch.equal(flags, torch.full_like(flags, 5)) and not counts.any()
    torch.library.opcheck(ops.expert_gemm, (rows, w2, engine.offsets, False),
                          dict(done_flags=flags, done_counts=counts, done_epoch=epoch, done_sms=16))
    with pytest.raises(RuntimeError, match="done_flags, done_counts, done_epoch: give all three or none"):
        ops.expert_gemm(rows, w2, engine.offsets, False, done_flags=flags)
    with pytest.raises(RuntimeError, match="done_flags: expected a contiguous int64 tensor of at least"):
        ops.expert_gemm(rows, w2, engine.offsets, False, done_flags=flags[:1], done_counts=counts, done_epoch=epoch)
    with pytest.raises(RuntimeError, match="done_sms: only with done_flags"):
        ops.expert_gemm(rows, w2, engine.offsets, False, done_sms=16)
    with pytest.raises(RuntimeError, match="published results need output columns in whole tiles of 256"):
        ops.expert_gemm(rows, engine.w2, engine.offsets, False, done_flags=flags, done_counts=counts,
                        done_epoch=epoch)


def test_combine_reduce_reads_local_rows(engine):
    """slot_to_row r <= -2 takes row -2 - r of local_rows (the expert-parallel combine's own rows)."""
    rows = torch.randn(5, 16).to(torch.bfloat16)
    local = torch.randn(4, 16).to(torch.bfloat16)
    slot_to_row = torch.tensor([[0, -2 - 3], [-1, -2], [4, 1]], dtype=torch.int32)
    y = ops.combine_reduce(rows, slot_to_row, None, local)
    expected = torch.stack([rows[0].float() + local[3].float(), local[0].float(), rows[4].float() + rows[1].float()])
    torch.testing.assert_close(y.float(), expected.to(torch.bfloat16).float())
    # Without local_rows every negative entry is "no row".
    torch.testing.assert_close(ops.combine_reduce(rows, slot_to_row, None)[1].float(), torch.zeros(16))
    torch.library.opcheck(ops.combine_reduce, (rows, slot_to_row, None, local))


def test_opcheck_fc2_dgrad_swiglu(engine):
    e = engine
    torch.library.opcheck(ops.fc2_dgrad_swiglu, (e.dy_rows, e.w2, e.h, e.row_weight, e.offsets))


def test_opcheck_expert_wgrad(engine):
    torch.library.opcheck(ops.expert_wgrad, (engine.dy_rows, engine.a, engine.offsets))
    torch.library.opcheck(ops.expert_wgrad, (engine.dy_rows, engine.a, engine.offsets, engine.counts))


def test_expert_wgrad_counts_are_checked(engine):
    e = engine
    with pytest.raises(RuntimeError, match=r"expert_rows: expected one count per expert \(3\), got 2"):
        ops.expert_wgrad(e.dy_rows, e.a, e.offsets, e.counts[:2])
    with pytest.raises(RuntimeError, match="expert_rows: expected int32"):
        ops.expert_wgrad(e.dy_rows, e.a, e.offsets, e.counts.long())
    with pytest.raises(RuntimeError, match="expert_rows: expected a 1-D tensor"):
        ops.expert_wgrad(e.dy_rows, e.a, e.offsets, e.counts.view(1, 3))
    with pytest.raises(RuntimeError, match="expert_rows: expected a contiguous tensor"):
        ops.expert_wgrad(e.dy_rows, e.a, e.offsets, e.counts.repeat(2)[::2])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without a GPU")
def test_engine_says_why_it_does_not_run_without_a_gpu(engine):
    assert "sm_90" in ops.expert_gemm_unsupported(0, 2048, 768)
    assert not primemoe.layer.engine_supports(engine.xs, engine.w1)


def test_engine_ops_cpu_semantics(engine):
    """The CPU kernels are the engine's specification: per expert, plain fp32 products of its rows."""
    e = engine
    off = e.offsets.tolist()
    lo, hi = off[2], off[3]
    W1, W2 = e.w1[2].double(), e.w2[2].double()
    out = ops.expert_gemm(e.a, e.w2, e.offsets, False)
    torch.testing.assert_close(out[lo:hi].double(), e.a[lo:hi].double() @ W2.t(), rtol=1e-2, atol=1e-2)
    a, h = ops.fc1_swiglu(e.xs, e.w1, e.offsets, True)
    torch.testing.assert_close(h[lo:hi].double(), e.xs[lo:hi].double() @ W1.t(), rtol=1e-2, atol=1e-2)
    g, u = h.double().chunk(2, dim=1)
    torch.testing.assert_close(a.double(), torch.nn.functional.silu(g) * u, rtol=1e-2, atol=1e-2)
    dw = ops.expert_wgrad(e.dy_rows, e.a, e.offsets)
    assert dw.shape == (3, 64, 256) and not dw[1].any()
    torch.testing.assert_close(dw[2].double(), e.dy_rows[lo:hi].double().t() @ e.a[lo:hi].double(),
                               rtol=1e-2, atol=1e-2)
    dh, aw, dot = ops.fc2_dgrad_swiglu(e.dy_rows, e.w2, e.h, e.row_weight, e.offsets)
    da = e.dy_rows.double() @ W2  # expert 2's weight, compared on its rows only
    g, u = e.h.double().chunk(2, dim=1)
    act = (torch.nn.functional.silu(g) * u).bfloat16().double()  # a is kept in bf16, as in the forward
    w = e.row_weight.double().unsqueeze(1)
    torch.testing.assert_close(dot[lo:hi].sum(1).double(), (da * act).sum(1)[lo:hi], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(aw[lo:hi].double(), (w * act)[lo:hi], rtol=1e-2, atol=1e-2)
    s = torch.sigmoid(g)
    d_gate = da * w * u * s * (1 + g * (1 - s))
    torch.testing.assert_close(dh[lo:hi].double(), torch.cat([d_gate, da * w * g * s], 1)[lo:hi],
                               rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------- dispatch_layout semantics


def expected_layout(topk_idx, num_experts, expert_begin, num_local, row_align):
    """Plain-Python layout: counts, padded offsets, rows in slot order per expert, -1 elsewhere."""
    flat = [int(e) for e in topk_idx.reshape(-1)]
    slots_of = [[s for s, e in enumerate(flat) if e == expert_begin + j] for j in range(num_local)]
    counts = [len(s) for s in slots_of]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + -(-c // row_align) * row_align)
    slot_to_row = [-1] * len(flat)
    row_to_slot = [-1] * (len(flat) + num_local * (row_align - 1))
    for j, slots in enumerate(slots_of):
        for i, s in enumerate(slots):
            slot_to_row[s] = offsets[j] + i
            row_to_slot[offsets[j] + i] = s
    as_int = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return as_int(counts), as_int(offsets), as_int(slot_to_row).view(topk_idx.shape), as_int(row_to_slot)


@pytest.mark.parametrize("row_align", [1, 4, 128])
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("tokens, top_k, num_experts, expert_begin, num_local", [
    (37, 3, 8, 0, 8),  # all experts local
    (37, 3, 8, 4, 4),  # second half: slots of experts 0-3 are not routed here
    (50, 2, 12, 3, 5),  # a middle range
    (1, 1, 4, 0, 4),
    (0, 4, 8, 0, 8),  # no tokens
])
def test_dispatch_layout_semantics(tokens, top_k, num_experts, expert_begin, num_local, row_align, idx_dtype):
    ids = random_ids(tokens, top_k, num_experts, seed=tokens + num_local, dtype=idx_dtype)
    got = ops.dispatch_layout(ids, num_experts, expert_begin, num_local, row_align)
    want = expected_layout(ids, num_experts, expert_begin, num_local, row_align)
    for name, g, w in zip(("expert_counts", "expert_offsets", "slot_to_row", "row_to_slot"), got, want):
        assert g.dtype == torch.int32, name
        assert torch.equal(g, w), f"{name}: {g} != {w}"
    assert bool((got[1] % row_align == 0).all())


def test_dispatch_layout_all_slots_to_one_expert():
    ids = torch.full((20, 4), 2)
    counts, offsets, slot_to_row, row_to_slot = ops.dispatch_layout(ids, E, 0, E, 1)
    assert counts.tolist() == [0, 0, 80, 0]
    assert offsets.tolist() == [0, 0, 0, 80, 80]
    assert torch.equal(slot_to_row.reshape(-1), torch.arange(80, dtype=torch.int32))
    assert torch.equal(row_to_slot, torch.arange(80, dtype=torch.int32))


# Argument checks of the C++ layer, each in a fresh interpreter: a crash while raising
# (seen with the GPU machine's build) then fails one test instead of killing the session.
CPP_ERROR_SETUP = """
import torch, primemoe
ops = torch.ops.primemoe
ids = torch.randint(0, 4, (9, 2))
x = torch.randn(9, 16).bfloat16()
rows = torch.randn(18, 16).bfloat16()
slot_to_row = torch.arange(18, dtype=torch.int32).view(9, 2)
row_to_slot = torch.arange(18, dtype=torch.int32)
offsets = torch.tensor([0, 5, 12], dtype=torch.int32)
"""
CPP_ERRORS = {
    # name: (setup line, call, message pattern)
    "layout_id_E": ("ids[4, 1] = 4", "ops.dispatch_layout(ids, 4, 0, 4, 1)",
                    r"topk_idx\[4, 1\] = 4 is not an expert id"),
    "layout_id_999": ("ids[4, 1] = 999", "ops.dispatch_layout(ids, 4, 0, 4, 1)", r"topk_idx\[4, 1\] = 999 is not"),
    "layout_id_-2": ("ids[4, 1] = -2", "ops.dispatch_layout(ids, 4, 0, 4, 1)", r"topk_idx\[4, 1\] = -2 is not"),
    "layout_no_local_experts": ("", "ops.dispatch_layout(ids, 4, 0, 0, 1)",
                                "num_local_experts: expected 1..1024, got 0"),
    "layout_experts_past_E": ("", "ops.dispatch_layout(ids, 4, 2, 3, 1)", "expert_begin: local experts must lie"),
    "layout_row_align_0": ("", "ops.dispatch_layout(ids, 4, 0, 4, 0)", "row_align: expected >= 1, got 0"),
    "gather_fp32_src": ("", "ops.gather_rows(x.float(), row_to_slot, 2, None)", "src: expected bfloat16"),
    "gather_top_k_0": ("", "ops.gather_rows(x, row_to_slot, 0, None)", "top_k: expected >= 1, got 0"),
    "gather_scale_numel": ("", "ops.gather_rows(x, row_to_slot, 2, torch.ones(3))", "scale: expected 18 elements"),
    "gather_slot_to_row_shape": ("", "ops.gather_rows(x, row_to_slot, 2, None, slot_to_row.view(18))",
                                 "slot_to_row: expected a 2-D tensor"),
    "gather_slot_to_row_top_k": ("", "ops.gather_rows(x, row_to_slot, 2, None, slot_to_row.view(6, 3))",
                                 r"slot_to_row: expected shape \[9, 2\]"),
    "gather_slot_to_row_int64": ("", "ops.gather_rows(x, row_to_slot, 2, None, slot_to_row.long())",
                                 "slot_to_row: expected int32"),
    "combine_weights_shape": ("", "ops.combine_reduce(rows, slot_to_row, torch.ones(9, 3))", "weights: expected shape"),
    "slot_dot_shapes": ("", "ops.slot_dot(rows, rows[:4], slot_to_row)", "b: expected the shape of a"),
    "scalars_2d": ("", "ops.gather_scalars(torch.ones(18, 1), row_to_slot)", r"values: expected a 1-D tensor"),
    "scalars_fp16": ("", "ops.gather_scalars(torch.ones(18).half(), row_to_slot)",
                     "values: expected float32 or bfloat16"),
    "scalars_strided": ("", "ops.gather_scalars(torch.ones(36)[::2], row_to_slot)",
                        "values: expected a contiguous tensor"),
    "scalars_index_int64": ("", "ops.gather_scalars(torch.ones(18), row_to_slot.long())", "index: expected int32"),
    "copy_rows_1d": ("", "ops.copy_routed_rows(row_to_slot, offsets)", "rows: expected a 2-D tensor"),
    "copy_rows_strided": ("", "ops.copy_routed_rows(rows.t(), offsets)", "rows: expected a contiguous tensor"),
    "copy_rows_12_bytes": ("", "ops.copy_routed_rows(rows[:, :6].contiguous(), offsets)",
                           "rows: expected rows of a multiple of 16 bytes, got 12"),
    "copy_offsets_int64": ("", "ops.copy_routed_rows(rows, offsets.long())", "expert_offsets: expected int32"),
    "copy_offsets_2d": ("", "ops.copy_routed_rows(rows, offsets.view(1, 3))", "expert_offsets: expected a 1-D"),
    "copy_offsets_empty": ("", "ops.copy_routed_rows(rows, offsets[:0])", "expert_offsets: expected at least one"),
    "gather_offsets_int64": ("", "ops.gather_rows(x, row_to_slot, 2, None, slot_to_row, offsets.long())",
                             "expert_offsets: expected int32"),
    "zero_rows_strided": ("", "ops.zero_unrouted_rows(rows.t(), offsets)", "rows: expected a contiguous tensor"),
    "zero_offsets_int64": ("", "ops.zero_unrouted_rows(rows, offsets.long())", "expert_offsets: expected int32"),
    "check_args_unknown_op": ("", "ops._check_args('gather', [x], [])",
                              "_check_args: no argument check for op 'gather'"),
    "check_args_counts": ("", "ops._check_args('slot_dot', [rows, rows], [])",
                          "_check_args: slot_dot takes 3 tensors and 0 ints, got 2 and 0"),
    "check_args_required": ("", "ops._check_args('slot_dot', [rows, None, slot_to_row], [])",
                            "_check_args: slot_dot's tensor argument 1 is required"),
}


@pytest.mark.parametrize("case", CPP_ERRORS)
def test_cpp_argument_check_raises(case):
    setup, call, match = CPP_ERRORS[case]
    code = f"{CPP_ERROR_SETUP}{setup}\ntry:\n    {call}\nexcept RuntimeError as error:\n    print(error)\n"
    proc = run_python(code)
    assert proc.returncode == 0, (
        f"the process died (return code {proc.returncode}) instead of raising RuntimeError\n{proc.stderr[-3000:]}")
    assert re.search(match, proc.stdout), f"expected a RuntimeError matching {match!r}, got: {proc.stdout!r}"


# ---------------------------------------------------------------- row primitives


@pytest.mark.parametrize("scale_dtype", [None, torch.float32, torch.bfloat16])
def test_gather_rows_semantics(problem, scale_dtype):
    row_to_slot = layout(problem.topk_idx, row_align=4)[3]
    scale = None if scale_dtype is None else problem.topk_weights.to(scale_dtype)
    got = ops.gather_rows(problem.x, row_to_slot, K, scale)
    for r, s in enumerate(row_to_slot.tolist()):
        if s < 0:
            want = torch.zeros(H, dtype=torch.bfloat16)
        else:
            factor = 1.0 if scale is None else scale.reshape(-1)[s].float()
            want = (problem.x[s // K].float() * factor).bfloat16()
        assert torch.equal(got[r], want), f"row {r} (slot {s})"


def test_gather_rows_gives_zeros_for_slots_past_the_tokens():
    """As on the GPU: a row naming no slot of the T * K (past them, or -1) is zeros; no tokens, all zeros."""
    x = torch.randn(3, 16).bfloat16()
    got = ops.gather_rows(x, torch.tensor([5, 6, 2 ** 31 - 1, -1, 0], dtype=torch.int32), 2, None)
    assert torch.equal(got[0], x[2]) and torch.equal(got[4], x[0]) and not got[1:4].any()
    empty = ops.gather_rows(x[:0], torch.tensor([0, -1], dtype=torch.int32), 2, None)
    assert empty.shape == (2, 16) and not empty.any()


@pytest.mark.parametrize("weight_dtype", [None, torch.float32, torch.bfloat16])
def test_combine_reduce_semantics(problem, weight_dtype):
    slot_to_row = layout(problem.topk_idx)[2]
    rows = torch.randn(T * K, H).bfloat16()
    weights = None if weight_dtype is None else problem.topk_weights.to(weight_dtype)
    got = ops.combine_reduce(rows, slot_to_row, weights)
    want = torch.zeros(T, H)
    for t in range(T):
        for k in range(K):
            row = int(slot_to_row[t, k])
            if row >= 0:
                want[t] += (1.0 if weights is None else weights[t, k].float()) * rows[row].float()
    torch.testing.assert_close(got, want.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_scalars_semantics(dtype):
    """out[i] = values[index[i]] in fp32, 0 where index[i] is -1 or past the values; out has index's shape (the
    routing weight of each expert-major row; a slot's routing-weight gradient from its row's)."""
    values = torch.randn(10).to(dtype)
    index = torch.tensor([[3, -1, 9], [10, 0, 3], [-5, 7, 1 << 30]], dtype=torch.int32)
    got = ops.gather_scalars(values, index)
    assert got.dtype == torch.float32 and got.shape == (3, 3)
    v = values.float()
    for i, at in enumerate(index.view(-1).tolist()):
        want = v[at].item() if 0 <= at < 10 else 0.0
        assert got.view(-1)[i].item() == want, (i, at)
    assert torch.equal(ops.gather_scalars(values[:0], index), torch.zeros(3, 3))
    assert ops.gather_scalars(values, index[:0]).shape == (0, 3)


def test_slot_dot_semantics(problem):
    slot_to_row = layout(problem.topk_idx)[2]
    a, b = torch.randn(2, T * K, 2 * I).bfloat16()
    got = ops.slot_dot(a, b, slot_to_row)
    assert got.dtype == torch.float32 and got.shape == (T, K)
    rows = slot_to_row.long()
    want = torch.where(rows >= 0, (a.float()[rows.clamp(min=0)] * b.float()[rows.clamp(min=0)]).sum(-1), 0.0)
    torch.testing.assert_close(got, want)


# ---------------------------------------------------------------- primemoe.moe on CPU


def assert_matches_reference_autograd(got, problem):
    """y is the reference's own forward (bitwise); the hand-written CPU backward agrees with
    autograd through the reference up to the final rounding."""
    want = run_moe(primemoe.reference.moe, problem)
    assert torch.equal(got.y, want.y)
    for name in OUTPUT_NAMES[1:]:
        torch.testing.assert_close(getattr(got, name), getattr(want, name), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("keep_fc1", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("routing", ["masked", "one_expert", "all_skipped"])
def test_moe_on_cpu_equals_reference(routing, dtype, keep_fc1):
    problem = make_problem(T, H, I, E, K, routing=routing, seed=10, dtype=dtype)
    assert_matches_reference_autograd(run_moe(lambda *args: primemoe.moe(*args, keep_fc1=keep_fc1), problem), problem)


def test_moe_without_grad_keeps_no_fc1(problem):
    with torch.no_grad():
        y = primemoe.moe(problem.x, problem.topk_idx, problem.topk_weights, problem.w1, problem.w2)
    want = primemoe.reference.moe(problem.x, problem.topk_idx, problem.topk_weights, problem.w1, problem.w2)
    assert torch.equal(y, want)


def test_moe_backward_on_cpu_under_a_dispatch_mode(problem):
    """Backend kernels run below autograd whenever a TorchDispatchMode (FlopCounterMode,
    opcheck's schema check, ...) is active: the CPU backward must not rely on recording a graph."""
    with FlopCounterMode(display=False):
        got = run_moe(primemoe.moe, problem)
    assert_matches_reference_autograd(got, problem)


def test_torch_compile_fullgraph_aot_eager(problem):
    """Backend "aot_eager": dynamo + AOTAutograd through the fake kernels and the
    registered autograd, without inductor codegen (fast on CPU)."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    eager = ExpertLayer(problem.w1, problem.w2)
    compiled = torch.compile(ExpertLayer(problem.w1, problem.w2), backend=counter, fullgraph=True)
    got = run_module(compiled, problem)
    assert counter.frame_count == 1, "expected exactly one graph (no graph break)"
    want = run_module(eager, problem)
    for name in OUTPUT_NAMES:
        assert torch.equal(getattr(got, name), getattr(want, name)), name


class _Recording:
    """``torch.ops.primemoe`` with a hook before ``expert_gemm`` / ``expert_wgrad``: which watched operands are
    still alive when each is called."""

    def __init__(self, refs):
        self.refs, self.alive = refs, []

    def __getattr__(self, name):
        op = getattr(torch.ops.primemoe, name)
        if name not in ("expert_gemm", "expert_wgrad"):
            return op

        def recorded(*args, **kwargs):
            self.alive.append((name, sorted(k for k, ref in self.refs.items() if ref() is not None)))
            return op(*args, **kwargs)
        return recorded


@pytest.mark.parametrize("recompute", [False, True])
def test_expert_backward_drops_each_operand_after_its_last_use(monkeypatch, recompute):
    """The backward's peak memory: dy_rows and FC2 dgrad's aw are freed before FC1's dgrad makes dxs (which takes
    their memory), a recomputed h after FC2's dgrad, xs after dw1; the operand list comes back empty."""
    import weakref

    from primemoe import layer

    e = engine_operands([3, 0, 130, 64], hidden=256, inter=256, seed=5)
    xs, h, dy_rows = e.xs.clone(), None if recompute else e.h.clone(), e.dy_rows.clone()
    refs = {"xs": weakref.ref(xs), "dy_rows": weakref.ref(dy_rows)}
    if h is not None:
        refs["h"] = weakref.ref(h)
    recording = _Recording(refs)
    monkeypatch.setattr(layer, "lib", recording)
    operands = [xs, h, dy_rows]
    del xs, h, dy_rows
    out = layer.expert_backward(operands, e.row_weight, e.w1, e.w2, e.offsets, e.counts, True)
    assert operands == []
    calls = recording.alive
    if recompute:  # FC1's pre-activations first
        assert calls.pop(0) == ("expert_gemm", ["dy_rows", "xs"])
    assert calls == [("expert_wgrad", ["dy_rows", "xs"]),  # dw2: h gone after FC2's dgrad (no other holder here)
                     ("expert_gemm", ["xs"]),  # dxs: dy_rows and aw gone
                     ("expert_wgrad", ["xs"])]  # dw1
    assert all(ref() is None for ref in refs.values())
    assert len(out) == 4


def test_opcheck_expert_wgrad_accumulate(engine):
    main_grad = torch.randn(3, engine.dy_rows.shape[1], engine.a.shape[1])
    torch.library.opcheck(ops.expert_wgrad_accumulate, (engine.dy_rows, engine.a, engine.offsets, engine.counts,
                                                        main_grad))


def test_expert_wgrad_accumulate_adds_the_fp32_gradient(engine):
    """main_grad[e] += a_rows[e]^T b_rows[e] unrounded; an expert without rows (expert 1) keeps its values."""
    start = torch.randn(3, engine.dy_rows.shape[1], engine.a.shape[1])
    main_grad = start.clone()
    ops.expert_wgrad_accumulate(engine.dy_rows, engine.a, engine.offsets, engine.counts, main_grad)
    offsets = engine.offsets.tolist()
    for e, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
        want = start[e].double() + engine.dy_rows[lo:hi].double().t() @ engine.a[lo:hi].double()
        torch.testing.assert_close(main_grad[e].double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(main_grad[1], start[1])


@pytest.mark.parametrize("bad, match", [
    (lambda g: g.bfloat16(), "main_grad: expected float32"),
    (lambda g: g[:, :, :-1].contiguous(), r"main_grad: expected \[3, "),
    (lambda g: g.transpose(1, 2).contiguous().transpose(1, 2), "main_grad: expected a contiguous"),
])
def test_expert_wgrad_accumulate_checks_main_grad(engine, bad, match):
    main_grad = bad(torch.zeros(3, engine.dy_rows.shape[1], engine.a.shape[1]))
    with pytest.raises(RuntimeError, match=match):
        ops.expert_wgrad_accumulate(engine.dy_rows, engine.a, engine.offsets, engine.counts, main_grad)
