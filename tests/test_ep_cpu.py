"""The expert-parallel path (primemoe.moe(..., buffer=): the _ep_moe_forward / _ep_moe_backward ops
over ep.BufferTransport) on the CPU, against the fp64 reference of the gathered problem. Each rank is
a thread holding a ``ModelBuffer``: a Python model of the ep_dispatch / ep_combine contract (receive
layout, meta, weights, combine slots) over the same workspace regions as primemoe.Buffer. The model
leaves what the contract leaves undefined hostile: NaN past the received rows, stale meta there,
garbage in padding rows and NaN in combine slots that were not routed, so the path must not depend
on any of it."""

import threading
from functools import partial

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from ep_harness import rank_problem
from helpers import OUTPUT_NAMES, ROUTINGS, Outputs, assert_moe_outputs_match, make_problem, reference64, run_moe
from naive import composite

from primemoe import ep, layer
from primemoe.buffer import EpConfig, ep_arrivals_per_epoch, ep_layout, ep_region

SHAPE = (64, 32, 8, 2)  # H, I, E, K


class World:
    """What the ranks post to each other between two barriers."""

    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.posted = [None] * size

    def run(self, fn):
        """``fn(rank)`` on one thread per rank; returns their results in rank order. The first rank that raises
        aborts the barrier (the others stop waiting) and its error is raised here."""
        results, errors = [None] * self.size, []

        def rank_main(rank):
            try:
                results[rank] = fn(rank)
            except BaseException as error:  # noqa: BLE001  (re-raised in the calling thread)
                errors.append(error)
                self.barrier.abort()

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results

    def exchange(self, rank, item):
        self.posted[rank] = item
        self.barrier.wait()
        everything = list(self.posted)
        self.barrier.wait()  # nobody posts again before everyone has read
        return everything


class ModelBuffer:
    """The attributes and methods of primemoe.Buffer that the buffer= path uses, on the CPU."""

    closed = False
    precision = "bf16"
    device = torch.device("cpu")
    overlap = True
    overlap_combine = True
    num_sms = 16

    def __init__(self, world: World, rank, *, max_tokens_per_rank, hidden, intermediate, num_experts, top_k,
                 row_align):
        self.world_state, self.rank, self.world = world, rank, world.size
        self.max_tokens_per_rank, self.hidden, self.intermediate = max_tokens_per_rank, hidden, intermediate
        self.num_experts, self.top_k, self.row_align = num_experts, top_k, row_align
        self.local_experts = num_experts // world.size
        config = EpConfig(world.size, max_tokens_per_rank, hidden, top_k, self.local_experts, row_align,
                          put_peers=False)
        self.max_slots, self.max_recv_rows = config.max_slots, config.max_recv_rows
        layout, total = ep_layout(config)
        workspace = torch.zeros(total, dtype=torch.uint8)
        self.regions = {name: ep_region(workspace, name, world.size, max_tokens_per_rank, hidden, top_k,
                                        self.local_experts, row_align, put_peers=False) for name in layout}
        self.gen = torch.Generator().manual_seed(rank)
        self.epoch = torch.ones(1, dtype=torch.int64)
        self.arrivals_per_epoch = ep_arrivals_per_epoch(config)
        self.handle = ep.register_buffer(self)

    def rows_ready(self):
        """Every row is in place when dispatch returns: the counters are set to their target."""
        arrivals = self.regions["expert_arrivals"]
        arrivals.fill_(int(self.epoch) * self.arrivals_per_epoch)
        return arrivals, self.epoch, self.arrivals_per_epoch, self.rank, self.regions["tile_counter"]

    def region(self, name):
        return self.regions[name]

    def dispatch(self, x, topk_idx, topk_weights, *, wait=True, copy_rows=True):
        K, E, S, E_local = self.top_k, self.num_experts, self.max_slots, self.local_experts
        assert x.dtype == torch.bfloat16 and x.is_contiguous() and x.shape[0] <= self.max_tokens_per_rank
        everything = self.world_state.exchange(self.rank, (x, topk_idx, topk_weights))
        rows, meta, weights = self.regions["recv_rows"], self.regions["recv_meta"], self.regions["recv_weights"]
        rows.fill_(float("nan"))
        meta.copy_(torch.randint(0, self.world * S, meta.shape, generator=self.gen))  # stale
        weights.fill_(float("nan"))
        combine_map = self.regions["combine_map"]
        combine_map.copy_(torch.randint(0, self.max_slots, combine_map.shape, generator=self.gen))  # stale
        combine_map[:topk_idx.numel()] = -1  # the layout's: slots not routed
        counts, offsets, at = [], [0], 0
        for e in range(E_local):
            begin = at
            for src, (x_src, idx_src, w_src) in enumerate(everything):
                slots = (idx_src.reshape(-1).long() == self.rank * E_local + e).nonzero().view(-1)
                n = slots.numel()
                if copy_rows:
                    rows[at:at + n] = x_src[slots // K]
                meta[at:at + n] = (src * S + slots).int()
                weights[at:at + n] = w_src.reshape(-1)[slots].float()
                if src == self.rank:  # combine_reduce's map: own rows stay at their receive row
                    combine_map[slots] = -2 - torch.arange(at, at + n, dtype=torch.int32)
                at += n
            counts.append(at - begin)
            padded = begin + (at - begin + self.row_align - 1) // self.row_align * self.row_align
            if copy_rows:
                rows[at:padded] = 0  # the dispatch zeroes padding rows
            meta[at:padded] = -1
            weights[at:padded] = 0  # and weight 0: the expert GEMMs read every row's weight
            at = padded
            offsets.append(at)
        slot_valid = (topk_idx >= 0) & (topk_idx < E)
        ids = topk_idx.reshape(-1).long()
        remote = slot_valid.reshape(-1) & (ids // E_local != self.rank)  # their rows come back into combine_rows
        combine_map[:ids.numel()][remote] = remote.nonzero().view(-1).int()
        return torch.tensor(counts, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int32), slot_valid

    def combine(self, rows, expert_offsets, row_scalars=None, *, published=False, send=True, wait=True):
        if not send:  # the model's exchange is done by the sending call
            return
        R, S = self.max_recv_rows, self.max_slots
        assert rows.dtype == torch.bfloat16 and tuple(rows.shape) == (R, self.hidden) and rows.is_contiguous()
        assert row_scalars is None or (row_scalars.dtype == torch.float32 and tuple(row_scalars.shape) == (R,))
        total = int(expert_offsets[-1])
        posted = (rows[:total].clone(), None if row_scalars is None else row_scalars[:total].clone(),
                  self.regions["recv_meta"][:total].clone())
        everything = self.world_state.exchange(self.rank, posted)
        combine_rows, combine_scalars = self.regions["combine_rows"], self.regions["combine_scalars"]
        combine_rows.fill_(float("nan"))  # slots that were not routed hold stale data
        combine_scalars.fill_(float("nan"))
        for expert_rank, (rows_src, scalars_src, meta_src) in enumerate(everything):
            mine = (meta_src >= 0) & (meta_src.long() // S == self.rank)
            slots = meta_src[mine].long() % S
            if expert_rank != self.rank:  # this rank's own rows stay in `rows` (combine_map)
                combine_rows[slots] = rows_src[mine]
            if scalars_src is not None:
                combine_scalars[slots] = scalars_src[mine]


def run_ranks(problem, tokens_per_rank, row_align=1, **moe_kwargs):
    world = World(len(tokens_per_rank))
    hidden, inter, experts, top_k = SHAPE
    sizes = dict(max_tokens_per_rank=max(max(tokens_per_rank), 1), hidden=hidden, intermediate=inter,
                 num_experts=experts, top_k=top_k, row_align=row_align)

    def rank_main(rank):
        buffer = ModelBuffer(world, rank, **sizes)
        mine = rank_problem(problem, rank, tokens_per_rank, "cpu")
        return run_moe(partial(layer.ep_moe, buffer=buffer, **moe_kwargs), mine)

    results = world.run(rank_main)
    return Outputs(**{name: torch.cat([getattr(r, name) for r in results]) for name in OUTPUT_NAMES})


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens_per_rank", [(37, 5), (0, 16), (24,), (9, 0, 13, 4)])
def test_expert_parallel_path_matches_reference(tokens_per_rank, routing):
    problem = make_problem(sum(tokens_per_rank), *SHAPE, routing=routing, seed=sum(tokens_per_rank))
    out = run_ranks(problem, tokens_per_rank)
    assert_moe_outputs_match(out, reference64(problem), composite(problem), problem)


@pytest.mark.parametrize("variant", ["recompute_fc1", "row_align_4", "int32_ids_bf16_weights"])
def test_expert_parallel_variants(variant):
    tokens_per_rank = (21, 30)
    kwargs = dict(idx_dtype=torch.int32, weight_dtype=torch.bfloat16) if variant == "int32_ids_bf16_weights" else {}
    problem = make_problem(sum(tokens_per_rank), *SHAPE, routing="masked", seed=5, **kwargs)
    out = run_ranks(problem, tokens_per_rank, row_align=4 if variant == "row_align_4" else 1,
                    **(dict(keep_fc1=False) if variant == "recompute_fc1" else {}))
    assert_moe_outputs_match(out, reference64(problem), composite(problem), problem)


@pytest.mark.parametrize("keep_fc1", [True, False])
@pytest.mark.parametrize("row_align", [1, 4])
def test_one_rank_gathers_its_rows_again_in_the_backward(keep_fc1, row_align):
    """A Buffer of one rank keeps no rows from the forward: the backward gathers x's rows into the receive layout
    (the local layout at the buffer's row alignment) again."""
    problem = make_problem(29, *SHAPE, routing="skewed", seed=31)
    out = run_ranks(problem, (29,), row_align=row_align, keep_fc1=keep_fc1)
    assert_moe_outputs_match(out, reference64(problem), composite(problem), problem)


# The engine's kernels tile the hidden and intermediate sizes by 256 columns.
ENGINE_SHAPE = (256, 256, 8, 2)  # H, I, E, K


@pytest.mark.parametrize("keep_fc1", [True, False])
@pytest.mark.parametrize("tokens_per_rank", [(21, 30), (17,)])
def test_overlapped_engine_composition_over_a_buffer(tokens_per_rank, keep_fc1):
    """The layer's composition over a Buffer with the engine's ops (their CPU kernels), as on a GPU with
    overlap=True: FC1 and FC2's dgrad on the dispatch's hook with overlap_sms, FC2 and FC1's dgrad publishing their
    rows for a combine started right after them. Checks the wiring of the overlapped path in CI."""
    problem = make_problem(sum(tokens_per_rank), *ENGINE_SHAPE, routing="masked", seed=9)
    world = World(len(tokens_per_rank))
    local = len(tokens_per_rank) == 1  # one rank: nothing runs beside the dispatch, no combine kernel is launched
    hidden, inter, experts, top_k = ENGINE_SHAPE
    calls = []

    def rank_main(rank):
        buffer = ModelBuffer(world, rank, max_tokens_per_rank=max(tokens_per_rank), hidden=hidden,
                             intermediate=inter, num_experts=experts, top_k=top_k, row_align=64)
        transport = ep.BufferTransport(buffer, None)
        assert transport.overlap_sms == (0 if local else buffer.num_sms)
        assert (transport.results_done() is None) == local
        mine = rank_problem(problem, rank, tokens_per_rank, "cpu")
        published = []
        combine = buffer.combine
        def recording_combine(*args, **kwargs):
            if kwargs.get("send", True):  # the sending half (the wait comes apart, with send=False)
                published.append(kwargs.get("published"))
            return combine(*args, **kwargs)

        buffer.combine = recording_combine
        fwd = ep.BufferTransport(buffer, mine.topk_idx)
        y, fc1_out, saved = layer.forward(fwd, mine.x, mine.topk_weights, mine.w1, mine.w2, keep_fc1=keep_fc1,
                                          save_rows=True, engine=True)
        bwd = ep.BufferTransport(buffer, mine.topk_idx)
        grads = layer.backward(bwd, mine.dy, (mine.x, saved), mine.topk_weights, mine.w1, mine.w2,
                               fc1_out if keep_fc1 else None, engine=True)
        calls.append(published)
        return Outputs(y, *grads)

    results = world.run(rank_main)
    out = Outputs(**{name: torch.cat([getattr(r, name) for r in results]) for name in OUTPUT_NAMES})
    # Both combines alongside their GEMMs; with one rank none at all.
    assert all(published == ([] if local else [True, True]) for published in calls)
    assert_moe_outputs_match(out, reference64(problem), composite(problem), problem)


# ---------------------------------------------------------------- the ops on one rank


def one_rank(tokens, row_align=4, seed=7):
    hidden, inter, experts, top_k = SHAPE
    buffer = ModelBuffer(World(1), 0, max_tokens_per_rank=max(tokens, 1), hidden=hidden, intermediate=inter,
                         num_experts=experts, top_k=top_k, row_align=row_align)
    return buffer, make_problem(tokens, *SHAPE, routing="masked", seed=seed)


@pytest.mark.parametrize("keep_fc1", [True, False])
def test_ep_ops_shapes_match_their_fakes(keep_fc1):
    """The fakes size fc1_out and saved_rows from the buffer's receive region (torch.compile traces with
    them), and save_rows=False keeps no rows (the forward of a call that needs no gradient)."""
    buffer, p = one_rank(11)
    rows, H = buffer.max_recv_rows, p.x.shape[1]
    for save_rows in (False, True):
        args = (p.x, p.topk_idx, p.topk_weights, p.w1, p.w2, buffer.handle, "bf16", keep_fc1, save_rows)
        real = torch.ops.primemoe._ep_moe_forward(*args)
        with torch._subclasses.FakeTensorMode() as mode:
            fake = torch.ops.primemoe._ep_moe_forward(*(mode.from_tensor(a) if torch.is_tensor(a) else a
                                                         for a in args))
        # One rank keeps no rows: the backward gathers them from x again.
        want = [(p.x.shape[0], H), (rows if keep_fc1 else 0, p.w1.shape[1]), (0, H)]
        assert [tuple(t.shape) for t in real] == [tuple(t.shape) for t in fake] == want
        assert [t.dtype for t in real] == [t.dtype for t in fake]
    _, fc1_out, saved_rows = real  # of the forward that saved its rows
    grads = torch.ops.primemoe._ep_moe_backward(p.dy, p.x, p.topk_idx, p.topk_weights, p.w1, p.w2,
                                                fc1_out if keep_fc1 else None, saved_rows, buffer.handle)
    assert [tuple(g.shape) for g in grads] == [tuple(p.x.shape), tuple(p.topk_idx.shape), tuple(p.w1.shape),
                                               tuple(p.w2.shape)]
    assert grads[1].dtype == torch.float32


def test_ep_ops_name_a_closed_or_unknown_buffer():
    buffer, p = one_rank(5)
    ep.unregister_buffer(buffer.handle)
    with pytest.raises(RuntimeError, match=f"buffer: no open primemoe.Buffer has handle {buffer.handle}"):
        torch.ops.primemoe._ep_moe_forward(p.x, p.topk_idx, p.topk_weights, p.w1, p.w2, buffer.handle)
    with pytest.raises(RuntimeError, match="buffer: no open primemoe.Buffer has handle -1"):
        torch.ops.primemoe._ep_moe_forward(p.x, p.topk_idx, p.topk_weights, p.w1, p.w2, -1)


def test_ep_backward_without_saved_rows_is_a_clear_error():
    """With more than one rank the backward needs the rows the forward kept (one rank gathers them from x)."""
    world = World(2)
    results = world.run(lambda rank: _backward_without_rows(world, rank))
    assert all("the forward kept no rows" in r for r in results)


def _backward_without_rows(world, rank):
    hidden, inter, experts, top_k = SHAPE
    buffer = ModelBuffer(world, rank, max_tokens_per_rank=16, hidden=hidden, intermediate=inter,
                         num_experts=experts, top_k=top_k, row_align=1)
    p = make_problem(16, *SHAPE, routing="masked", seed=5 + rank)
    try:
        torch.ops.primemoe._ep_moe_backward(p.dy, p.x, p.topk_idx, p.topk_weights, p.w1, p.w2, None,
                                            p.x.new_empty(0, p.x.shape[1]), buffer.handle)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_torch_compile_fullgraph_through_the_buffer_ops():
    """dynamo + AOTAutograd (backend aot_eager) through moe(buffer=)'s ops, their fakes and registered
    autograd: one graph, the same bits as eager."""
    torch._dynamo.reset()
    buffer, p = one_rank(13)
    counter = CompileCounterWithBackend("aot_eager")

    def layer_call(x, topk_idx, topk_weights, w1, w2):
        return layer.ep_moe(x, topk_idx, topk_weights, w1, w2, buffer=buffer)

    got = run_moe(torch.compile(layer_call, backend=counter, fullgraph=True), p)
    assert counter.frame_count == 1, "expected exactly one graph (no graph break)"
    want = run_moe(layer_call, p)
    for name in OUTPUT_NAMES:
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_main_grads_over_a_buffer():
    """moe(buffer=) at EP = 2 with fp32 main gradients on each rank's weights: added into them, no .grad; the
    same values as the plain gradients (which are them rounded to bf16)."""
    problem = make_problem(30, *SHAPE, routing="masked", seed=12)
    tokens_per_rank = (12, 18)
    world = World(2)
    hidden, inter, experts, top_k = SHAPE
    sizes = dict(max_tokens_per_rank=18, hidden=hidden, intermediate=inter, num_experts=experts, top_k=top_k,
                 row_align=1)

    def rank_main(rank):
        buffer = ModelBuffer(world, rank, **sizes)
        mine = rank_problem(problem, rank, tokens_per_rank, "cpu")
        plain = run_moe(partial(layer.ep_moe, buffer=buffer), mine)
        x, tw, w1, w2 = (t.detach().clone().requires_grad_() for t in (mine.x, mine.topk_weights, mine.w1, mine.w2))
        w1.main_grad, w2.main_grad = torch.zeros(w1.shape), torch.zeros(w2.shape)
        layer.ep_moe(x, mine.topk_idx, tw, w1, w2, buffer=buffer).backward(mine.dy)
        return plain, x.grad, (w1.grad, w2.grad), (w1.main_grad, w2.main_grad)

    for plain, dx, grads, main_grads in world.run(rank_main):
        assert grads == (None, None)
        assert torch.equal(dx, plain.dx)
        for main_grad, dw in zip(main_grads, (plain.dw1, plain.dw2)):
            torch.testing.assert_close(main_grad, dw.float(), rtol=2 ** -7, atol=2 ** -7 * float(dw.abs().max()))
