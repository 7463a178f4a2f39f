"""The expert-parallel autograd path (primemoe.ep) on the CPU, against the fp64 reference of the
gathered problem. Each rank is a thread holding a ``ModelBuffer``: a Python model of the
ep_dispatch / ep_combine contract (receive layout, meta, weights, combine slots) over the same
workspace regions as primemoe.Buffer. The model leaves what the contract leaves undefined
hostile: NaN past the received rows, stale meta there, garbage in padding rows and NaN in
combine slots that were not routed, so the path must not depend on any of it."""

import threading
from functools import partial

import pytest
import torch

from ep_harness import rank_problem
from helpers import OUTPUT_NAMES, ROUTINGS, Outputs, assert_moe_outputs_match, make_problem, reference64, run_moe
from naive import composite

from primemoe import ep
from primemoe.buffer import EpConfig, ep_layout, ep_region

SHAPE = (64, 32, 8, 2)  # H, I, E, K


class World:
    """What the ranks post to each other between two barriers."""

    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.posted = [None] * size

    def exchange(self, rank, item):
        self.posted[rank] = item
        self.barrier.wait()
        everything = list(self.posted)
        self.barrier.wait()  # nobody posts again before everyone has read
        return everything


class ModelBuffer:
    """The attributes and methods of primemoe.Buffer that primemoe.ep uses, on the CPU."""

    closed = False
    precision = "bf16"
    device = torch.device("cpu")

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

    def region(self, name):
        return self.regions[name]

    def dispatch(self, x, topk_idx, topk_weights, *, wait=True):
        K, E, S, E_local = self.top_k, self.num_experts, self.max_slots, self.local_experts
        assert x.dtype == torch.bfloat16 and x.is_contiguous() and x.shape[0] <= self.max_tokens_per_rank
        everything = self.world_state.exchange(self.rank, (x, topk_idx, topk_weights))
        rows, meta, weights = self.regions["recv_rows"], self.regions["recv_meta"], self.regions["recv_weights"]
        rows.fill_(float("nan"))
        meta.copy_(torch.randint(0, self.world * S, meta.shape, generator=self.gen))  # stale
        weights.fill_(float("nan"))
        counts, offsets, at = [], [0], 0
        for e in range(E_local):
            begin = at
            for src, (x_src, idx_src, w_src) in enumerate(everything):
                slots = (idx_src.reshape(-1).long() == self.rank * E_local + e).nonzero().view(-1)
                n = slots.numel()
                rows[at:at + n] = x_src[slots // K]
                meta[at:at + n] = (src * S + slots).int()
                weights[at:at + n] = w_src.reshape(-1)[slots].float()
                at += n
            counts.append(at - begin)
            padded = begin + (at - begin + self.row_align - 1) // self.row_align * self.row_align
            rows[at:padded] = 0  # the dispatch zeroes padding rows
            meta[at:padded] = -1
            weights[at:padded] = 0  # and weight 0: the expert GEMMs read every row's weight
            at = padded
            offsets.append(at)
        slot_valid = (topk_idx >= 0) & (topk_idx < E)
        return torch.tensor(counts, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int32), slot_valid

    def combine(self, rows, expert_offsets, row_scalars=None):
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
        for rows_src, scalars_src, meta_src in everything:
            mine = (meta_src >= 0) & (meta_src.long() // S == self.rank)
            slots = meta_src[mine].long() % S
            combine_rows[slots] = rows_src[mine]
            if scalars_src is not None:
                combine_scalars[slots] = scalars_src[mine]


def run_ranks(problem, tokens_per_rank, row_align=1, **moe_kwargs):
    world = World(len(tokens_per_rank))
    hidden, inter, experts, top_k = SHAPE
    sizes = dict(max_tokens_per_rank=max(max(tokens_per_rank), 1), hidden=hidden, intermediate=inter,
                 num_experts=experts, top_k=top_k, row_align=row_align)
    results, errors = [None] * world.size, []

    def rank_main(rank):
        try:
            buffer = ModelBuffer(world, rank, **sizes)
            mine = rank_problem(problem, rank, tokens_per_rank, "cpu")
            results[rank] = run_moe(partial(ep.moe, buffer=buffer, **moe_kwargs), mine)
        except BaseException as error:  # noqa: BLE001  (re-raised in the main thread)
            errors.append(error)
            world.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
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
