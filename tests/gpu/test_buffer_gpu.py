"""primemoe.Buffer (NVSHMEM expert parallelism) on real GPUs: the ranks run in spawned
processes (tests/buffer_ranks.py) and this process checks what they saved.

Marker ``ep`` (with ``gpu``): needs one GPU. At EP = W the ranks get one GPU each (NCCL group) where there are
W GPUs, else they all run on cuda:0 (gloo group); the test ids name it (``ep2_same_gpu``, ``ep4_gpu_per_rank``,
``_mps`` under CUDA MPS: scripts/gpu_run.sh ep runs them without and with MPS).

One rank: moe(buffer=) against the fp64 reference; create, close, recreate, atexit.
EP = 2 and 4: ep_dispatch payload exactness (receive layout, meta, weights) and the combine
echo; moe(buffer=) against the single-process reference of the gathered problem (uneven T, T = 0 on
a rank, masked, skewed, one expert, ...); bitwise repeat; two layers sharing one buffer; CUDA-graph
replay; FP8 (precision "fp8" / "fp8_bwd") against reference.moe_fp8; a 2,000-iteration soak (slow).
The put transport (PRIMEMOE_EP_TRANSPORT=put, the inter-node path forced on one node) runs
the dispatch/combine cases once and one moe case with the repeat, layer and graph checks (EP = 2).
The unmarked tests at the end check the rank placement logic on the CPU."""

import os
from dataclasses import replace
from functools import partial
from types import SimpleNamespace

import pytest
import torch

import buffer_ranks
import ep_harness
from buffer_ranks import (buffer_sizes, capacity_cases, dispatch_cases, layer_soak, moe_cases, single_rank_lifecycle,
                          soak, spawn_ranks)
from ep_harness import EP_CASES_BY_WORLD, GPU_PER_RANK, SAME_GPU, ep_id, prepare_spawn, rank_mode
from helpers import (OUTPUT_NAMES, Outputs, Problem, assert_contract_zeros, assert_moe_outputs_match, make_problem,
                     reference64, run_moe)
from naive import composite

import primemoe
from primemoe.buffer import buffer_config, ep_layout
from primemoe.reference import moe_fp8

# NVLink multicast must stay off on the test machine.
MULTICAST_OFF = dict(NCCL_NVLS_ENABLE="0", NVSHMEM_DISABLE_NVLS="1", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
SHAPE = (256, 256, 8, 2)  # H, I, E (E_local = 4 / 2 per rank at W = 2 / 4), K: sizes the expert GEMM engine and
# FP8 (H, I multiples of 128) cover
# A spawn still running after this is a hang (the test fails); each spawn here takes seconds.
SPAWN_TIMEOUT_S = int(os.environ.get("PRIMEMOE_TEST_SPAWN_TIMEOUT", "240"))


def run_ranks(tmp_path, monkeypatch, fn, world, *args, timeout_s=SPAWN_TIMEOUT_S, transport="auto"):
    prepare_spawn(monkeypatch, tmp_path, PRIMEMOE_EP_TRANSPORT=transport, **MULTICAST_OFF)
    spawn_ranks(fn, world, *args, str(tmp_path), timeout_s=timeout_s)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


# Results of each spawn, by key: pytest sets a module-scoped fixture up again for every test of a multi-name
# parametrize (and orders items differently across versions), so the fixtures spawn through ``once``.
_SPAWNED = {}


def once(key, spawn):
    """``spawn()`` the first time ``key`` is asked for; afterwards its result, or its exception again (a failed
    or hung spawn is not repeated for every test that reads it)."""
    if key not in _SPAWNED:
        try:
            _SPAWNED[key] = (spawn(), None)
        except Exception as error:  # noqa: BLE001 (re-raised to every reader)
            _SPAWNED[key] = (None, error)
    value, error = _SPAWNED[key]
    if error is not None:
        raise error
    return value


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


@pytest.mark.gpu
@pytest.mark.ep
def test_one_rank_create_close_recreate(tmp_path, monkeypatch):
    problem = make_problem(300, *SHAPE, routing="masked", seed=3)
    problem_path = tmp_path / "problem.pt"
    torch.save(vars(problem), problem_path)
    (result,) = run_ranks(tmp_path, monkeypatch, single_rank_lifecycle, 1, str(problem_path))
    check_against_reference(Outputs(**result["attempt0"]), problem)
    check_against_reference(Outputs(**result["recompute_fc1"]), problem)
    for again in ("attempt1", "context_manager", "left_open", "sequential"):
        assert_equal(result[again], result["attempt0"], f"{again} vs the first Buffer")


# ---------------------------------------------------------------- EP = 2 and 4: dispatch and combine alone

DISPATCH_SIZES = dict(max_tokens_per_rank=1400, hidden=64, intermediate=64, num_experts=8, top_k=3)
WORLDS = (2, 4)


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


BAD_IDS_RANK = 1


def with_bad_ids(inputs):
    _, topk_idx, _ = inputs[BAD_IDS_RANK]
    topk_idx[0, 0] = DISPATCH_SIZES["num_experts"]  # one past the last expert
    topk_idx[2, 1] = -2
    return inputs


def dispatch_cases_for(world):
    """The dispatch cases at EP = ``world`` (2 or 4): ``{name: [[x, topk_idx, topk_weights] per rank]}``."""
    def tokens(two, four):
        return two if world == 2 else four
    return {
        "different_T_masked": dispatch_inputs(tokens((300, 17), (300, 17, 0, 129)), "masked", seed=1),
        "rank0_without_tokens": dispatch_inputs(tokens((0, 64), (0, 64, 1, 200)), "uniform", seed=2),
        "no_tokens_anywhere": dispatch_inputs((0,) * world, "uniform", seed=3),
        # Every slot of every rank at full capacity to one expert (rank 1 at EP = 2, rank 2 at EP = 4): its
        # receive region fills up.
        "all_to_one_expert": dispatch_inputs((1400,) * world, 5, seed=4),
        # T * K >= 8 * E_local * 128: at row_align 128 one block of the rows kernel zeroes the padding
        # while the others send (ep_kernels.cu, dispatch_pad_blocks); the smaller cases take the other path.
        "rows_outnumber_padding": dispatch_inputs(tokens((1400, 1390), (1400, 1390, 700, 1000)), "uniform", seed=7),
        "int32_ids_bf16_weights": dispatch_inputs(tokens((40, 33), (40, 33, 7, 0)), "masked", seed=5,
                                                  idx_dtype=torch.int32, weight_dtype=torch.bfloat16),
        "bad_ids": with_bad_ids(dispatch_inputs(tokens((5, 7), (5, 7, 3, 4)), "uniform", seed=6)),
    }


DISPATCH_CASES = {world: dispatch_cases_for(world) for world in WORLDS}
DISPATCH_CASE_NAMES = list(DISPATCH_CASES[2])


def expected_receive(inputs, rank, row_align):
    """What ``rank`` receives: for each local expert, sources in rank order, each source's slots in
    order, then zero rows (meta -1, weight 0) up to a multiple of ``row_align``."""
    E, K, H = DISPATCH_SIZES["num_experts"], DISPATCH_SIZES["top_k"], DISPATCH_SIZES["hidden"]
    local = E // len(inputs)
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


# (world, row_align, transport): the put transport and row_align 1 at EP = 2 only.
DISPATCH_RUNS = [(2, 1, "auto"), (2, 128, "auto"), (2, 128, "put"), (4, 128, "auto")]


@pytest.fixture(scope="module", params=DISPATCH_RUNS,
                ids=[f"{ep_id(w)}-row_align{a}{'_put' if t == 'put' else ''}" for w, a, t in DISPATCH_RUNS])
def dispatch_results(tmp_path_factory, request):
    return once(("dispatch", *request.param), lambda: run_dispatch_cases(tmp_path_factory, *request.param))


def run_dispatch_cases(tmp_path_factory, world, row_align, transport):
    tmp_path = tmp_path_factory.mktemp("ep_dispatch")
    cases_path = tmp_path / "cases.pt"
    sizes = dict(DISPATCH_SIZES, row_align=row_align)
    torch.save({"sizes": sizes, "cases": {name: {"inputs": inputs} for name, inputs in DISPATCH_CASES[world].items()}},
               cases_path)
    with pytest.MonkeyPatch.context() as monkeypatch:
        results = run_ranks(tmp_path, monkeypatch, dispatch_cases, world, str(cases_path), transport=transport)
    return SimpleNamespace(world=world, row_align=row_align, transport=transport, results=results)


@pytest.mark.gpu
@pytest.mark.ep
def test_only_the_put_transport_adds_the_staging_region(dispatch_results):
    """All ranks are on one node (one GPU or several), so only forcing puts gives the workspace its staging
    region."""
    run = dispatch_results
    config = buffer_config(run.world, **DISPATCH_SIZES, row_align=run.row_align, num_sms=24)
    _, stores_bytes = ep_layout(config)
    _, puts_bytes = ep_layout(replace(config, put_peers=True))
    assert puts_bytes > stores_bytes
    put = run.transport == "put"
    for rank in range(run.world):
        assert run.results[rank]["workspace"] == dict(nbytes=puts_bytes if put else stores_bytes, put_peers=put), \
            f"rank {rank}"


@pytest.mark.gpu
@pytest.mark.ep
@pytest.mark.parametrize("case", DISPATCH_CASE_NAMES)
def test_dispatch_places_every_row_exactly(dispatch_results, case):
    run = dispatch_results
    inputs = DISPATCH_CASES[run.world][case]
    E = DISPATCH_SIZES["num_experts"]
    for rank in range(run.world):
        got = run.results[rank][case]
        want = expected_receive(inputs, rank, run.row_align)
        for name, value in want.items():
            assert torch.equal(got[name], value), f"rank {rank}: {name} differs from the documented receive layout"
        _, topk_idx, _ = inputs[rank]
        assert torch.equal(got["slot_valid"], (topk_idx >= 0) & (topk_idx < E)), f"rank {rank}: slot_valid"


@pytest.mark.gpu
@pytest.mark.ep
@pytest.mark.parametrize("case", DISPATCH_CASE_NAMES)
def test_combine_returns_every_row_to_its_slot(dispatch_results, case):
    K = DISPATCH_SIZES["top_k"]
    run = dispatch_results
    for rank in range(run.world):
        got = run.results[rank][case]
        x, topk_idx, topk_weights = DISPATCH_CASES[run.world][case][rank]
        valid = got["slot_valid"].reshape(-1)
        E_local = DISPATCH_SIZES["num_experts"] // run.world
        own = valid & (topk_idx.reshape(-1) // E_local == rank)  # rows that stay here: receive row -2 - map[slot]
        pushed = valid & ~own
        rows = x.repeat_interleave(K, 0)
        slot_map = got["combine_map"]
        assert torch.equal(got["combine_rows"][pushed], rows[pushed]), f"rank {rank}: rows"
        assert torch.equal(got["recv_rows"][(-2 - slot_map[own]).long()], rows[own]), f"rank {rank}: own rows"
        assert torch.equal(slot_map[pushed], torch.arange(valid.numel())[pushed].int()), f"rank {rank}: map"
        assert (slot_map[~valid] == -1).all(), f"rank {rank}: map of the slots not routed"
        assert torch.equal(got["combine_scalars"][valid], topk_weights.reshape(-1).float()[valid]), \
            f"rank {rank}: scalars"


@pytest.mark.gpu
@pytest.mark.ep
def test_dispatch_reports_bad_ids_of_the_sending_rank(dispatch_results):
    run = dispatch_results
    for name in DISPATCH_CASE_NAMES:
        for rank in range(run.world):
            if name != "bad_ids" or rank != BAD_IDS_RANK:
                error = run.results[rank][name]["error"]
                assert error is None, f"{name}, rank {rank}: {error}"
    assert "is not an expert id" in run.results[BAD_IDS_RANK]["bad_ids"]["error"]


# ---------------------------------------------------------------- EP = 2 and 4: moe(buffer=...)


def moe_cases_for(world):
    """The correctness matrix at EP = ``world``: ep_harness's cases plus every slot skipped and narrow dtypes."""
    def tokens(two, four):
        return two if world == 2 else four
    return {
        **EP_CASES_BY_WORLD[world],
        "all_skipped": dict(tokens_per_rank=tokens((50, 30), (50, 30, 0, 20)), routing="all_skipped"),
        "int32_ids_bf16_weights": dict(tokens_per_rank=tokens((128, 77), (128, 77, 5, 64)), routing="masked",
                                       idx_dtype=torch.int32, weight_dtype=torch.bfloat16),
    }


MOE_CASES = {world: moe_cases_for(world) for world in WORLDS}
GRAPH_TOKENS = {2: (256, 100), 4: (256, 100, 64, 17)}
GRAPH_REPLAYS = [(7, "uniform"), (8, "skewed"), (9, "masked"), (10, "one_expert")]
PUT_MOE_CASE = "skewed"  # the largest case
REPEAT_CASE = "different_T_masked"
LAYERED_CASES = ("different_T", "skewed")
# (world, transport): the put transport runs one case at EP = 2 (the case, its repeat, two layers of it, one
# graph replay); EP = 4 runs every case with two graph replays.
MOE_RUNS = {
    (2, "auto"): dict(names=list(MOE_CASES[2]), repeat=REPEAT_CASE, layered=LAYERED_CASES, replays=GRAPH_REPLAYS),
    (2, "put"): dict(names=[PUT_MOE_CASE], repeat=PUT_MOE_CASE, layered=(PUT_MOE_CASE, PUT_MOE_CASE),
                     replays=GRAPH_REPLAYS[:1]),
    (4, "auto"): dict(names=list(MOE_CASES[4]), repeat=REPEAT_CASE, layered=LAYERED_CASES, replays=GRAPH_REPLAYS[:2]),
}


def run_id(world, transport):
    return f"{ep_id(world)}-{transport}"


def moe_problem(tokens_per_rank, routing, seed, **kwargs):
    return dict(problem=vars(make_problem(sum(tokens_per_rank), *SHAPE, routing=routing, seed=seed, **kwargs)),
                tokens_per_rank=tokens_per_rank)


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory, request):
    """``moe_cases`` at EP = world over one transport (``request.param``: a key of MOE_RUNS): ``(data, per_rank)``."""
    return once(("moe", *request.param), lambda: run_moe_cases(tmp_path_factory, *request.param))


def run_moe_cases(tmp_path_factory, world, transport):
    run = MOE_RUNS[(world, transport)]
    tmp_path = tmp_path_factory.mktemp(f"ep{world}_moe_{transport}")
    cases = {name: moe_problem(seed=13 + i, **case) for i, (name, case) in enumerate(MOE_CASES[world].items())
             if name in run["names"]}
    graph_tokens = GRAPH_TOKENS[world]
    data = dict(
        cases=cases, repeat=run["repeat"], layered=run["layered"], replays=run["replays"], sequential=run["names"],
        combine_overlap=run["names"],
        graph=dict(static=moe_problem(graph_tokens, "uniform", seed=6),
                   replays=[moe_problem(graph_tokens, routing, seed) for seed, routing in run["replays"]]),
        sizes=buffer_sizes(make_problem(1, *SHAPE), world,
                           max(max(c["tokens_per_rank"]) for c in MOE_CASES[world].values())))
    cases_path = tmp_path / "cases.pt"
    torch.save(data, cases_path)
    with pytest.MonkeyPatch.context() as monkeypatch:
        per_rank = run_ranks(tmp_path, monkeypatch, moe_cases, world, str(cases_path), transport=transport)
    return data, per_rank


def each_moe_run():
    return [pytest.param(key, id=run_id(*key)) for key in MOE_RUNS]


@pytest.mark.gpu
@pytest.mark.ep
@pytest.mark.parametrize("moe_run, case", [pytest.param(key, name, id=f"{run_id(*key)}-{name}")
                                           for key, run in MOE_RUNS.items() for name in run["names"]],
                         indirect=["moe_run"])
def test_moe_with_buffer_matches_reference(moe_run, case):
    data, per_rank = moe_run
    for rank, tokens in enumerate(data["cases"][case]["tokens_per_rank"]):
        assert per_rank[rank][case]["y"].shape[0] == tokens, f"rank {rank}: y has the wrong number of tokens"
    check_against_reference(stitch([r[case] for r in per_rank]), Problem(**data["cases"][case]["problem"]))


@pytest.mark.gpu
@pytest.mark.ep
@pytest.mark.parametrize("moe_run", each_moe_run(), indirect=True)
def test_moe_with_buffer_repeats_bitwise(moe_run):
    data, per_rank = moe_run
    for rank, results in enumerate(per_rank):
        assert_equal(results["repeat"], results[data["repeat"]], f"rank {rank}: a repeated call")


@pytest.mark.gpu
@pytest.mark.ep
@pytest.mark.parametrize("moe_run", each_moe_run(), indirect=True)
def test_a_late_rank_changes_nothing(moe_run):
    """One rank late on the host or on the device (buffer_ranks.moe_cases): the others wait for it, and every
    output is bitwise that of the call without a delay."""
    data, per_rank = moe_run
    for rank, results in enumerate(per_rank):
        for delayed in ("host_delayed", "device_delayed"):
            assert_equal(results[delayed], results[data["repeat"]], f"rank {rank}: {delayed}")


@pytest.mark.gpu
@pytest.mark.ep
@pytest.mark.parametrize("moe_run", each_moe_run(), indirect=True)
@pytest.mark.parametrize("variant", ["sequential", "combine_overlap"])
def test_overlap_changes_no_bit(moe_run, variant):
    """Against the default Buffer (FC1 alongside x's dispatch, FC2's dgrad alongside dy's): overlap=False (each
    after the other) and overlap_combine=True (the combines alongside FC2 and FC1's dgrad too) give the same bits."""
    data, per_rank = moe_run
    for rank, results in enumerate(per_rank):
        assert set(results[variant]) == set(data[variant])
        for name, other in results[variant].items():
            assert_equal(other, results[name], f"rank {rank}: {name}, {variant} against the default")


@pytest.mark.gpu
@pytest.mark.ep
@pytest.mark.parametrize("moe_run", each_moe_run(), indirect=True)
def test_layers_sharing_a_buffer(moe_run):
    """Both forwards, then one backward through both: the same bits as each layer alone."""
    data, per_rank = moe_run
    for rank, results in enumerate(per_rank):
        for layer, name in zip(results["layered"], data["layered"]):
            assert_equal(layer, results[name], f"rank {rank}: layer {name} run next to another layer")


@pytest.mark.gpu
@pytest.mark.ep
@pytest.mark.parametrize("moe_run", each_moe_run(), indirect=True)
def test_cuda_graph_replay_matches_eager(moe_run):
    data, per_rank = moe_run
    for rank, results in enumerate(per_rank):
        assert len(results["graph"]) == len(data["graph"]["replays"])
        for (seed, routing), (replayed, eager) in zip(data["replays"], results["graph"]):
            assert_equal(replayed, eager, f"rank {rank}: graph replay ({routing}, seed {seed}) vs eager")


# ---------------------------------------------------------------- EP = 2 and 4: FP8 through the Buffer

FP8_PRECISIONS = ("fp8", "fp8_bwd")
# Relative Frobenius error of every output against reference.moe_fp8 of the gathered problem. The single-GPU
# layer meets 1e-2 (2e-2 for d_topk_weights, tests/gpu/test_moe_fp8_gpu.py); EP changes only where rows are
# computed, not how they are quantised.
FP8_TIGHT = 2e-2
# name: (tokens per rank, routing); uneven T and T = 0 on a rank.
FP8_CASES = {
    2: {"masked": ((300, 77), "masked"), "skewed": ((128, 300), "skewed"),
        "rank0_without_tokens": ((0, 200), "uniform")},
    4: {"masked": ((300, 17, 0, 128), "masked"), "skewed": ((64, 256, 100, 32), "skewed")},
}
FP8_RUNS = [(world, precision) for world in WORLDS for precision in FP8_PRECISIONS]


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory, request):
    """``moe_cases`` with an FP8 Buffer (``request.param``: (world, precision)): the cases and a repeat of the
    first. ``(data, per_rank)``."""
    return once(("fp8", *request.param), lambda: run_fp8_cases(tmp_path_factory, *request.param))


def run_fp8_cases(tmp_path_factory, world, precision):
    tmp_path = tmp_path_factory.mktemp(f"ep{world}_{precision}")
    cases = {name: moe_problem(tokens, routing, seed=40 + i)
             for i, (name, (tokens, routing)) in enumerate(FP8_CASES[world].items())}
    data = dict(precision=precision, cases=cases, repeat=next(iter(cases)),
                sizes=buffer_sizes(make_problem(1, *SHAPE), world,
                                   max(max(tokens) for tokens, _ in FP8_CASES[world].values())))
    cases_path = tmp_path / "cases.pt"
    torch.save(data, cases_path)
    with pytest.MonkeyPatch.context() as monkeypatch:
        per_rank = run_ranks(tmp_path, monkeypatch, moe_cases, world, str(cases_path))
    return data, per_rank


def norm(t) -> float:
    return torch.linalg.vector_norm(t.double()).item()


def check_against_fp8_reference(out: Outputs, problem: Problem, precision: str):
    out, problem = out.to("cuda"), problem.to("cuda")
    ref = run_moe(partial(moe_fp8, fp8_forward=precision == "fp8"), problem)
    for name in OUTPUT_NAMES:
        got, want = getattr(out, name), getattr(ref, name)
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        assert not got.isnan().any(), f"{name}: NaN"
        diff, scale = norm(got.double() - want.double()), norm(want)
        assert diff <= FP8_TIGHT * scale, (
            f"{name}: ||out - fp8 reference|| = {diff:.3e}, relative {diff / max(scale, 1e-300):.3e} > {FP8_TIGHT:g}")
    assert_contract_zeros(out, problem.topk_idx, problem.w1.shape[0])


@pytest.mark.gpu
@pytest.mark.ep
@pytest.mark.parametrize("fp8_run, case", [pytest.param(run, name, id=f"{ep_id(run[0])}-{run[1]}-{name}")
                                           for run in FP8_RUNS for name in FP8_CASES[run[0]]],
                         indirect=["fp8_run"])
def test_fp8_moe_with_buffer_matches_fp8_reference(fp8_run, case):
    data, per_rank = fp8_run
    for rank, tokens in enumerate(data["cases"][case]["tokens_per_rank"]):
        assert per_rank[rank][case]["y"].shape[0] == tokens, f"rank {rank}: y has the wrong number of tokens"
    check_against_fp8_reference(stitch([r[case] for r in per_rank]), Problem(**data["cases"][case]["problem"]),
                                data["precision"])


@pytest.mark.gpu
@pytest.mark.ep
@pytest.mark.parametrize("fp8_run", [pytest.param(run, id=f"{ep_id(run[0])}-{run[1]}") for run in FP8_RUNS],
                         indirect=True)
def test_fp8_moe_with_buffer_repeats_bitwise(fp8_run):
    data, per_rank = fp8_run
    for rank, results in enumerate(per_rank):
        assert_equal(results["repeat"], results[data["repeat"]], f"rank {rank}: a repeated call")


# ---------------------------------------------------------------- soak


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.ep
def test_soak_dispatch_combine(tmp_path, monkeypatch):
    """2,000 dispatch+combine rounds at EP = 2 with fresh routing and token counts: each echo exact, no hang,
    no growth of allocated memory."""
    iterations = 2000
    sizes = dict(max_tokens_per_rank=256, hidden=128, intermediate=64, num_experts=8, top_k=4)
    per_rank = run_ranks(tmp_path, monkeypatch, soak, 2, sizes, iterations, timeout_s=600)
    for rank, result in enumerate(per_rank):
        assert result["iterations"] == iterations
        steady, final = result["allocated"]
        assert final == steady, f"rank {rank}: allocated memory grew from {steady} to {final} bytes"


@pytest.mark.gpu
@pytest.mark.ep
@pytest.mark.parametrize("world", WORLDS)
def test_max_recv_rows(tmp_path, monkeypatch, world):
    """Buffer(max_recv_rows=): within the capacity, moe gives the default Buffer's results (its row buffers are
    smaller, the sums the same); a dispatch that would bring rank 0 every slot of every rank records the overflow
    on every rank (a DeviceError naming rank 0, no hang), and the next call is right again."""
    sizes = dict(max_tokens_per_rank=128, hidden=256, intermediate=256, num_experts=8, top_k=2)
    per_rank = run_ranks(tmp_path, monkeypatch, capacity_cases, world, sizes, 3 * 128 * 2 // 2)
    for rank, results in enumerate(per_rank):
        assert results["overflow_error"] is not None, f"rank {rank}: no overflow recorded"
        assert "rank 0 would have received" in results["overflow_error"]
        for key in ("fits", "again"):
            for name in OUTPUT_NAMES:
                got, want = results[key][name].double(), results["default"][name].double()
                assert (got - want).norm() <= 1e-2 * want.norm() + 1e-6, f"rank {rank} {key}: {name}"


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.ep
@pytest.mark.parametrize("world", WORLDS)
def test_soak_layer(tmp_path, monkeypatch, world):
    """2,000 forward+backward steps of moe(buffer=) (the overlapped path: the engine's sizes) with a fresh token
    count and routing per step on every rank: no hang, no NaN or inf, repeats bitwise, no growth of memory."""
    iterations = 2000
    sizes = dict(max_tokens_per_rank=300, hidden=256, intermediate=256, num_experts=16, top_k=4)
    per_rank = run_ranks(tmp_path, monkeypatch, layer_soak, world, sizes, iterations, timeout_s=900)
    for rank, result in enumerate(per_rank):
        assert result["iterations"] == iterations
        assert result["not_finite"] == 0, f"rank {rank}: {result['not_finite']} values not finite"
        assert result["repeats_differing"] == 0, f"rank {rank}: {result['repeats_differing']} repeated outputs differ"
        steady, final = result["allocated"]
        assert final == steady, f"rank {rank}: allocated memory grew from {steady} to {final} bytes"


# ---------------------------------------------------------------- the rank placement (CPU: no marker)


@pytest.mark.parametrize("gpus, world, mode", [(0, 1, SAME_GPU), (1, 1, GPU_PER_RANK), (1, 2, SAME_GPU),
                                               (1, 4, SAME_GPU), (2, 2, GPU_PER_RANK), (2, 4, SAME_GPU),
                                               (4, 4, GPU_PER_RANK), (8, 2, GPU_PER_RANK)])
def test_rank_mode_follows_the_device_count(monkeypatch, gpus, world, mode):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert rank_mode(world) == mode
    assert rank_mode(world, device_count=gpus) == mode


class FakeRankRuntime:
    """What ep_rank calls in CUDA and torch.distributed, recorded instead of done."""

    def __init__(self, monkeypatch, gpus, sms=132):
        self.calls = []
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(torch.cuda, "set_device", lambda index: self.calls.append(("set_device", index)))
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device: SimpleNamespace(multi_processor_count=sms))
        monkeypatch.setattr(buffer_ranks, "init_rank",
                            lambda backend, rank, world, **kwargs: self.calls.append(("init", backend, kwargs)))
        monkeypatch.setattr(buffer_ranks.dist, "destroy_process_group", lambda: self.calls.append(("destroy",)))
        for name in (ep_harness.EP_MODE_ENV, ep_harness.MPS_ENV, ep_harness.FULL_SMS_ENV,
                     "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
            monkeypatch.setenv(name, "")  # recorded, so what ep_rank sets is undone after the test
            monkeypatch.delenv(name)


@pytest.mark.parametrize("world", [2, 4])
def test_ep_rank_puts_every_rank_on_gpu0_over_gloo_with_fewer_gpus(monkeypatch, world):
    fake = FakeRankRuntime(monkeypatch, gpus=1)
    with buffer_ranks.ep_rank(world - 1, world) as device:
        assert device == torch.device("cuda", 0)
    assert fake.calls == [("set_device", 0), ("init", "gloo", {}), ("destroy",)]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in os.environ  # not an MPS run


def test_ep_rank_gives_each_rank_its_gpu_over_nccl_with_enough_gpus(monkeypatch):
    fake = FakeRankRuntime(monkeypatch, gpus=2)
    with buffer_ranks.ep_rank(1, 2) as device:
        assert device == torch.device("cuda", 1)
    assert fake.calls == [("set_device", 1), ("init", "nccl", dict(device_id=torch.device("cuda", 1))), ("destroy",)]


def test_ep_rank_follows_the_parents_mode(monkeypatch):
    """The mode the parent passed wins over this process's own device count."""
    fake = FakeRankRuntime(monkeypatch, gpus=4)
    monkeypatch.setenv(ep_harness.EP_MODE_ENV, SAME_GPU)
    with buffer_ranks.ep_rank(3, 4) as device:
        assert device == torch.device("cuda", 0)
    assert fake.calls[:2] == [("set_device", 0), ("init", "gloo", {})]


@pytest.mark.parametrize("gpus, world, percentage", [(1, 2, "50"), (1, 4, "25"), (2, 2, "100")])
def test_ep_rank_under_mps_takes_its_share_of_the_gpu(monkeypatch, gpus, world, percentage):
    FakeRankRuntime(monkeypatch, gpus=gpus, sms=66)
    monkeypatch.setenv(ep_harness.MPS_ENV, "1")
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50")  # what scripts/gpu_run.sh exports
    monkeypatch.setenv(ep_harness.FULL_SMS_ENV, "132")
    with buffer_ranks.ep_rank(0, world):
        assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == percentage


def test_ep_rank_under_mps_fails_when_the_gpu_is_not_shared_out(monkeypatch):
    fake = FakeRankRuntime(monkeypatch, gpus=1, sms=132)
    monkeypatch.setenv(ep_harness.MPS_ENV, "1")
    monkeypatch.setenv(ep_harness.FULL_SMS_ENV, "132")
    with pytest.raises(AssertionError, match="not an MPS client"):
        with buffer_ranks.ep_rank(0, 2):
            pass
    assert fake.calls[-1] == ("destroy",)


def test_spawn_ranks_passes_the_mode_to_the_ranks(monkeypatch):
    seen = {}

    class Done:
        processes = []

        def join(self, timeout=None):
            return True

    def start_processes(fn, args, nprocs, join, start_method):
        seen.update(mode=os.environ.get(ep_harness.EP_MODE_ENV), args=args, nprocs=nprocs, start_method=start_method)
        return Done()

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(buffer_ranks.mp, "start_processes", start_processes)
    monkeypatch.delenv(ep_harness.EP_MODE_ENV, raising=False)
    spawn_ranks(print, 4, "a", timeout_s=5)
    assert seen == dict(mode=SAME_GPU, args=(4, "a"), nprocs=4, start_method="spawn")
    assert ep_harness.EP_MODE_ENV not in os.environ  # set for the spawn only


@pytest.mark.parametrize("gpus", [1, 2])
def test_spawn_ranks_can_be_told_to_share_a_gpu(monkeypatch, gpus):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv(ep_harness.EP_MODE_ENV, SAME_GPU)
    assert ep_harness.chosen_mode(2) == SAME_GPU and ep_id(2).startswith("ep2_same_gpu")
    monkeypatch.setenv(ep_harness.EP_MODE_ENV, GPU_PER_RANK)
    if gpus < 2:
        with pytest.raises(ValueError, match="2 ranks need 2 GPUs"):
            ep_harness.chosen_mode(2)
    else:
        assert ep_harness.chosen_mode(2) == GPU_PER_RANK
    monkeypatch.setenv(ep_harness.EP_MODE_ENV, "elsewhere")
    with pytest.raises(ValueError, match="expected 'gpu_per_rank' or 'same_gpu'"):
        ep_harness.chosen_mode(2)


def test_test_ids_name_the_placement(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv(ep_harness.MPS_ENV, raising=False)
    monkeypatch.delenv(ep_harness.EP_MODE_ENV, raising=False)
    assert ep_id(1) == "ep1_gpu_per_rank" and ep_id(4) == "ep4_same_gpu"
    monkeypatch.setenv(ep_harness.MPS_ENV, "1")
    assert ep_id(2) == "ep2_same_gpu_mps"
