"""primemoe.Buffer (NVSHMEM expert parallelism) on real GPUs: the ranks run in spawned
processes (tests/buffer_ranks.py) and this process checks what they saved.

One rank: moe(buffer=) against the fp64 reference; create, close, recreate, atexit.
Two ranks: ep_dispatch payload exactness (receive layout, meta, weights) and the combine
echo; moe(buffer=) against the single-process reference of the gathered problem;
bitwise repeat; two layers sharing one buffer; CUDA-graph replay; a 2,000-iteration soak.
The put transport (PRIMEMOE_EP_TRANSPORT=put, the inter-node path forced on one node) runs
the dispatch/combine cases once and one moe case with the repeat, layer and graph checks."""

from dataclasses import replace

import pytest
import torch

from buffer_ranks import buffer_sizes, dispatch_cases, moe_cases, single_rank_lifecycle, soak, spawn_ranks
from ep_harness import EP_CASES, prepare_spawn
from helpers import OUTPUT_NAMES, Outputs, Problem, assert_moe_outputs_match, make_problem, reference64
from naive import composite

import primemoe
from primemoe.buffer import buffer_config, ep_layout

pytestmark = pytest.mark.gpu

# NVLink multicast must stay off on the test machine.
MULTICAST_OFF = dict(NCCL_NVLS_ENABLE="0", NVSHMEM_DISABLE_NVLS="1", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
SHAPE = (256, 256, 8, 2)  # H, I, E (E_local = 4 per rank at W=2), K: sizes the expert GEMM engine covers


def run_ranks(tmp_path, monkeypatch, fn, world, *args, timeout_s=600, transport="auto"):
    prepare_spawn(monkeypatch, tmp_path, PRIMEMOE_EP_TRANSPORT=transport, **MULTICAST_OFF)
    spawn_ranks(fn, world, *args, str(tmp_path), timeout_s=timeout_s)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def stitch(per_rank) -> Outputs:
    """Tokens in rank order, experts in rank order: the layout of the single-process problem."""
    return Outputs(**{name: torch.cat([r[name] for r in per_rank]) for name in OUTPUT_NAMES})


def check_against_reference(out: Outputs, problem):
    out, problem = out.to("cuda"), problem.to("cuda")
    assert_moe_outputs_match(out, reference64(problem), composite(problem), problem)


def assert_equal(a: dict, b: dict, what: str):
    for name in OUTPUT_NAMES:
        assert torch.equal(a[name], b[name]), f"{name}: {what} is not bitwise identical"


# ---------------------------------------------------------------- one rank


def test_one_rank_create_close_recreate(tmp_path, monkeypatch):
    problem = make_problem(300, *SHAPE, routing="masked", seed=3)
    problem_path = tmp_path / "problem.pt"
    torch.save(vars(problem), problem_path)
    (result,) = run_ranks(tmp_path, monkeypatch, single_rank_lifecycle, 1, str(problem_path))
    check_against_reference(Outputs(**result["attempt0"]), problem)
    check_against_reference(Outputs(**result["recompute_fc1"]), problem)
    for again in ("attempt1", "context_manager", "left_open"):
        assert_equal(result[again], result["attempt0"], f"{again} vs the first Buffer")


# ---------------------------------------------------------------- two ranks: dispatch and combine alone

DISPATCH_SIZES = dict(max_tokens_per_rank=1400, hidden=64, intermediate=64, num_experts=8, top_k=3)
WORLD = 2


def encoded_rows(rank, tokens, hidden, gen):
    """bf16 rows that name their source exactly: column 0 = rank, 1 = token // 128, 2 = token % 128."""
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    t = torch.arange(tokens)
    x[:, 0], x[:, 1], x[:, 2] = rank, t // 128, t % 128
    return x


def dispatch_inputs(tokens_per_rank, routing, seed, idx_dtype=torch.int64, weight_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    E, K, H = DISPATCH_SIZES["num_experts"], DISPATCH_SIZES["top_k"], DISPATCH_SIZES["hidden"]
    inputs = []
    for rank, tokens in enumerate(tokens_per_rank):
        logits = torch.randn(tokens, E, generator=gen)
        topk_idx, topk_weights = primemoe.route(logits, K)
        if routing == "masked":
            topk_idx = topk_idx.masked_fill(torch.rand(tokens, K, generator=gen) < 0.25, -1)
        elif isinstance(routing, int):  # every slot of every rank to expert `routing`
            topk_idx = torch.full_like(topk_idx, routing)
        inputs.append([encoded_rows(rank, tokens, H, gen), topk_idx.to(idx_dtype), topk_weights.to(weight_dtype)])
    return inputs


def with_bad_ids(inputs):
    _, topk_idx, _ = inputs[1]
    topk_idx[0, 0] = DISPATCH_SIZES["num_experts"]  # one past the last expert
    topk_idx[2, 1] = -2
    return inputs


DISPATCH_CASES = {
    "different_T_masked": dispatch_inputs((300, 17), "masked", seed=1),
    "rank0_without_tokens": dispatch_inputs((0, 64), "uniform", seed=2),
    "no_tokens_anywhere": dispatch_inputs((0, 0), "uniform", seed=3),
    # Every slot of every rank at full capacity to one expert of rank 1: its receive region fills up.
    "all_to_one_expert": dispatch_inputs((1400, 1400), 5, seed=4),
    # T * K >= 8 * E_local * 128: at row_align 128 one block of the rows kernel zeroes the padding
    # while the others send (ep_kernels.cu, dispatch_pad_blocks); the smaller cases take the other path.
    "rows_outnumber_padding": dispatch_inputs((1400, 1390), "uniform", seed=7),
    "int32_ids_bf16_weights": dispatch_inputs((40, 33), "masked", seed=5, idx_dtype=torch.int32,
                                              weight_dtype=torch.bfloat16),
    "bad_ids": with_bad_ids(dispatch_inputs((5, 7), "uniform", seed=6)),
}


def expected_receive(inputs, rank, row_align):
    """What ``rank`` receives: for each local expert, sources in rank order, each source's slots in
    order, then zero rows (meta -1, weight 0) up to a multiple of ``row_align``."""
    E, K, H = DISPATCH_SIZES["num_experts"], DISPATCH_SIZES["top_k"], DISPATCH_SIZES["hidden"]
    local = E // WORLD
    max_slots = DISPATCH_SIZES["max_tokens_per_rank"] * K
    rows, meta, weights, counts, offsets = [], [], [], [], [0]
    for expert in range(rank * local, (rank + 1) * local):
        counts.append(0)
        for src, (x, topk_idx, topk_weights) in enumerate(inputs):
            slots = (topk_idx.reshape(-1).long() == expert).nonzero().view(-1)
            rows.append(x[slots // K])
            meta.append((src * max_slots + slots).int())
            weights.append(topk_weights.reshape(-1)[slots].float())
            counts[-1] += slots.numel()
        pad = -counts[-1] % row_align
        rows.append(torch.zeros(pad, H, dtype=torch.bfloat16))
        meta.append(torch.full((pad,), -1, dtype=torch.int32))
        weights.append(torch.zeros(pad))  # the expert GEMMs read every row's weight: padding rows weigh 0
        offsets.append(offsets[-1] + counts[-1] + pad)
    return dict(counts=torch.tensor(counts, dtype=torch.int32), offsets=torch.tensor(offsets, dtype=torch.int32),
                recv_rows=torch.cat(rows), recv_meta=torch.cat(meta), recv_weights=torch.cat(weights))


@pytest.fixture(scope="module", params=[(1, "auto"), (128, "auto"), (128, "put")],
                ids=["row_align1", "row_align128", "row_align128_put"])
def dispatch_results(tmp_path_factory, request):
    row_align, transport = request.param
    tmp_path = tmp_path_factory.mktemp("ep_dispatch")
    cases_path = tmp_path / "cases.pt"
    sizes = dict(DISPATCH_SIZES, row_align=row_align)
    torch.save({"sizes": sizes, "cases": {name: {"inputs": inputs} for name, inputs in DISPATCH_CASES.items()}},
               cases_path)
    with pytest.MonkeyPatch.context() as monkeypatch:
        results = run_ranks(tmp_path, monkeypatch, dispatch_cases, WORLD, str(cases_path), transport=transport)
    return row_align, transport, results


@pytest.mark.multigpu
def test_only_the_put_transport_adds_the_staging_region(dispatch_results):
    """Both GPUs are on one node, so only forcing puts gives the workspace its staging region."""
    row_align, transport, results = dispatch_results
    config = buffer_config(WORLD, **DISPATCH_SIZES, row_align=row_align, num_sms=24)
    _, stores_bytes = ep_layout(config)
    _, puts_bytes = ep_layout(replace(config, put_peers=True))
    assert puts_bytes > stores_bytes
    put = transport == "put"
    for rank in range(WORLD):
        assert results[rank]["workspace"] == dict(nbytes=puts_bytes if put else stores_bytes, put_peers=put), \
            f"rank {rank}"


@pytest.mark.multigpu
@pytest.mark.parametrize("case", DISPATCH_CASES)
def test_dispatch_places_every_row_exactly(dispatch_results, case):
    row_align, _, results = dispatch_results
    inputs = DISPATCH_CASES[case]
    E = DISPATCH_SIZES["num_experts"]
    for rank in range(WORLD):
        got = results[rank][case]
        want = expected_receive(inputs, rank, row_align)
        for name, value in want.items():
            assert torch.equal(got[name], value), f"rank {rank}: {name} differs from the documented receive layout"
        _, topk_idx, _ = inputs[rank]
        assert torch.equal(got["slot_valid"], (topk_idx >= 0) & (topk_idx < E)), f"rank {rank}: slot_valid"


@pytest.mark.multigpu
@pytest.mark.parametrize("case", DISPATCH_CASES)
def test_combine_returns_every_row_to_its_slot(dispatch_results, case):
    K = DISPATCH_SIZES["top_k"]
    _, _, results = dispatch_results
    for rank in range(WORLD):
        got = results[rank][case]
        x, topk_idx, topk_weights = DISPATCH_CASES[case][rank]
        valid = got["slot_valid"].reshape(-1)
        assert torch.equal(got["combine_rows"][valid], x.repeat_interleave(K, 0)[valid]), f"rank {rank}: rows"
        assert torch.equal(got["combine_scalars"][valid], topk_weights.reshape(-1).float()[valid]), \
            f"rank {rank}: scalars"


@pytest.mark.multigpu
def test_dispatch_reports_bad_ids_of_the_sending_rank(dispatch_results):
    _, _, results = dispatch_results
    for name in DISPATCH_CASES:
        if name != "bad_ids":
            assert results[0][name]["error"] is None and results[1][name]["error"] is None, name
    assert results[0]["bad_ids"]["error"] is None
    assert "is not an expert id" in results[1]["bad_ids"]["error"]


# ---------------------------------------------------------------- two ranks: moe(buffer=...)

MOE_CASES = {
    **EP_CASES,
    "all_skipped": dict(tokens_per_rank=(50, 30), routing="all_skipped"),
    "int32_ids_bf16_weights": dict(tokens_per_rank=(128, 77), routing="masked", idx_dtype=torch.int32,
                                   weight_dtype=torch.bfloat16),
}
GRAPH_TOKENS = (256, 100)
GRAPH_REPLAYS = [(7, "uniform"), (8, "skewed"), (9, "masked"), (10, "one_expert")]
PUT_MOE_CASE = "skewed"  # the largest case


def moe_problem(tokens_per_rank, routing, seed, **kwargs):
    return dict(problem=vars(make_problem(sum(tokens_per_rank), *SHAPE, routing=routing, seed=seed, **kwargs)),
                tokens_per_rank=tokens_per_rank)


def run_moe_cases(tmp_path_factory, transport, names, repeat, layered, graph_replays):
    """``moe_cases`` on the cases ``names`` of MOE_CASES through one Buffer per rank."""
    tmp_path = tmp_path_factory.mktemp(f"ep_moe_{transport}")
    cases = {name: moe_problem(seed=13 + i, **case) for i, (name, case) in enumerate(MOE_CASES.items())
             if name in names}
    data = dict(
        cases=cases, repeat=repeat, layered=layered,
        graph=dict(static=moe_problem(GRAPH_TOKENS, "uniform", seed=6),
                   replays=[moe_problem(GRAPH_TOKENS, routing, seed) for seed, routing in graph_replays]),
        sizes=buffer_sizes(make_problem(1, *SHAPE), WORLD, max(max(c["tokens_per_rank"]) for c in MOE_CASES.values())))
    cases_path = tmp_path / "cases.pt"
    torch.save(data, cases_path)
    with pytest.MonkeyPatch.context() as monkeypatch:
        per_rank = run_ranks(tmp_path, monkeypatch, moe_cases, WORLD, str(cases_path), transport=transport)
    return data, per_rank


@pytest.fixture(scope="module")
def moe_results(tmp_path_factory):
    return run_moe_cases(tmp_path_factory, "auto", list(MOE_CASES), repeat="different_T_masked",
                         layered=("different_T", "skewed"), graph_replays=GRAPH_REPLAYS)


@pytest.fixture(scope="module")
def moe_put_results(tmp_path_factory):
    """The put transport on one case: the case, its repeat, two layers of it, one graph replay."""
    return run_moe_cases(tmp_path_factory, "put", [PUT_MOE_CASE], repeat=PUT_MOE_CASE,
                         layered=(PUT_MOE_CASE, PUT_MOE_CASE), graph_replays=GRAPH_REPLAYS[:1])


@pytest.fixture(params=["auto", "put"])
def moe_runs(request):
    return request.getfixturevalue("moe_results" if request.param == "auto" else "moe_put_results")


@pytest.mark.multigpu
@pytest.mark.parametrize("transport, case", [("auto", name) for name in MOE_CASES] + [("put", PUT_MOE_CASE)])
def test_moe_with_buffer_matches_reference(request, transport, case):
    data, per_rank = request.getfixturevalue("moe_results" if transport == "auto" else "moe_put_results")
    for rank, tokens in enumerate(data["cases"][case]["tokens_per_rank"]):
        assert per_rank[rank][case]["y"].shape[0] == tokens, f"rank {rank}: y has the wrong number of tokens"
    check_against_reference(stitch([r[case] for r in per_rank]), Problem(**data["cases"][case]["problem"]))


@pytest.mark.multigpu
def test_moe_with_buffer_repeats_bitwise(moe_runs):
    data, per_rank = moe_runs
    for rank, results in enumerate(per_rank):
        assert_equal(results["repeat"], results[data["repeat"]], f"rank {rank}: a repeated call")


@pytest.mark.multigpu
def test_layers_sharing_a_buffer(moe_runs):
    """Both forwards, then one backward through both: the same bits as each layer alone."""
    data, per_rank = moe_runs
    for rank, results in enumerate(per_rank):
        for layer, name in zip(results["layered"], data["layered"]):
            assert_equal(layer, results[name], f"rank {rank}: layer {name} run next to another layer")


@pytest.mark.multigpu
def test_cuda_graph_replay_matches_eager(moe_runs):
    data, per_rank = moe_runs
    for rank, results in enumerate(per_rank):
        assert len(results["graph"]) == len(data["graph"]["replays"])
        for (seed, routing), (replayed, eager) in zip(GRAPH_REPLAYS, results["graph"]):
            assert_equal(replayed, eager, f"rank {rank}: graph replay ({routing}, seed {seed}) vs eager")


# ---------------------------------------------------------------- soak


@pytest.mark.slow
@pytest.mark.multigpu
def test_soak_dispatch_combine(tmp_path, monkeypatch):
    """2,000 dispatch+combine rounds with fresh routing and token counts: each echo exact, no hang,
    no growth of allocated memory."""
    iterations = 2000
    sizes = dict(max_tokens_per_rank=256, hidden=128, intermediate=64, num_experts=8, top_k=4)
    per_rank = run_ranks(tmp_path, monkeypatch, soak, WORLD, sizes, iterations, timeout_s=600)
    for rank, result in enumerate(per_rank):
        assert result["iterations"] == iterations
        steady, final = result["allocated"]
        assert final == steady, f"rank {rank}: allocated memory grew from {steady} to {final} bytes"
