"""``prime_mega_moe`` (primemoe.deep_gemm_compat) on real GPUs, at EP = 1 and 2: the ranks run in spawned processes
(tests/compat_ranks.py), driven as prime-rl's Mega MoE dispatcher drives its DeepGEMM fork, and this process checks
what they saved.

Against ``primemoe.moe(..., buffer=, keep_fc1=False)`` on the same Buffer and inputs: bitwise. Both run the layer's
composition over the Buffer (same dispatch layout, same kernels); the compat backward dispatches x again where
moe(buffer=) copied the forward's received rows, and those are the same rows. Also: the tolerance rule against the
fp64 reference of the gathered problem; fp32 dw = the bf16 dw widened; the recv stats = routed rows per local
expert; two layers sharing the buffer (forwards A, B, backwards B, A, inputs reloaded each call).

Marker ``ep`` (with ``gpu``), placement as tests/gpu/test_buffer_gpu.py: one GPU per rank over NCCL where there are
enough GPUs, else every rank on cuda:0 over gloo."""

import os

import pytest
import torch

from buffer_ranks import spawn_ranks
from compat_ranks import compat_cases
from ep_harness import EP_CASES, ep_id, prepare_spawn
from helpers import OUTPUT_NAMES, Outputs, assert_moe_outputs_match, make_problem, reference64
from naive import composite

# NVLink multicast must stay off on the test machine.
MULTICAST_OFF = dict(NCCL_NVLS_ENABLE="0", NVSHMEM_DISABLE_NVLS="1", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
SHAPE = (256, 256, 8, 2)  # H, I, E, K: sizes the expert GEMM engine covers
SPAWN_TIMEOUT_S = int(os.environ.get("PRIMEMOE_TEST_SPAWN_TIMEOUT", "240"))

CASES_BY_WORLD = {
    1: {
        "masked": dict(tokens_per_rank=(300,), routing="masked"),
        "skewed": dict(tokens_per_rank=(1024,), routing="skewed"),
        "no_tokens": dict(tokens_per_rank=(0,), routing="uniform"),
        "small": dict(tokens_per_rank=(5,), routing="uniform"),
    },
    2: {name: EP_CASES[name] for name in ("different_T_masked", "skewed", "rank0_without_tokens",
                                          "rank1_without_tokens", "empty_experts")},
}
LAYERED = {1: ("masked", "small"), 2: ("different_T_masked", "skewed")}


def run_ranks(tmp_path, monkeypatch, fn, world, *args):
    prepare_spawn(monkeypatch, tmp_path, **MULTICAST_OFF)
    spawn_ranks(fn, world, *args, str(tmp_path), timeout_s=SPAWN_TIMEOUT_S)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def stitch(per_rank) -> Outputs:
    """Tokens in rank order, experts in rank order: the layout of the single-process problem."""
    return Outputs(**{name: torch.cat([r[name] for r in per_rank]) for name in OUTPUT_NAMES})


def check_against_reference(out: Outputs, problem):
    out, problem = out.to("cuda"), problem.to("cuda")
    assert_moe_outputs_match(out, reference64(problem), composite(problem), problem)


@pytest.mark.gpu
@pytest.mark.ep
@pytest.mark.parametrize("world", [1, 2], ids=lambda w: ep_id(w))
def test_compat_matches_moe_buffer(tmp_path, monkeypatch, world):
    H, I, E, K = SHAPE
    problems = {name: (make_problem(sum(case["tokens_per_rank"]), *SHAPE, routing=case["routing"], seed=seed),
                       case["tokens_per_rank"])
                for seed, (name, case) in enumerate(CASES_BY_WORLD[world].items(), start=70)}
    max_tokens = max(max(t) for _, t in problems.values())
    sizes = dict(max_tokens_per_rank=max_tokens, hidden=H, intermediate=I, num_experts=E, top_k=K)
    data = dict(sizes=sizes, layered=LAYERED[world],
                cases={name: dict(problem=vars(p), tokens_per_rank=t) for name, (p, t) in problems.items()})
    cases_path = tmp_path / "cases.pt"
    torch.save(data, cases_path)
    per_rank = run_ranks(tmp_path, monkeypatch, compat_cases, world, str(cases_path))

    local = E // world
    for name, (problem, tokens_per_rank) in problems.items():
        for rank, results in enumerate(per_rank):
            mine = results[name]
            for output in OUTPUT_NAMES:
                got, want = mine["compat"][output], mine["moe"][output]
                assert got.dtype == want.dtype and torch.equal(got, want), (
                    f"{name}, rank {rank}: {output} differs from moe(buffer=) on the same Buffer "
                    f"(max abs diff {(got.float() - want.float()).abs().max().item():.3e})")
            for output in ("y", "dx", "dtw"):
                assert torch.equal(mine["wide"][output], mine["compat"][output]), f"{name}, rank {rank}: {output}"
            for output in ("dw1", "dw2"):
                wide = mine["wide"][output]
                assert wide.dtype == torch.float32, f"{name}, rank {rank}: {output} dtype {wide.dtype}"
                assert torch.equal(wide, mine["compat"][output].float()), f"{name}, rank {rank}: fp32 {output}"
            ids = problem.topk_idx[problem.topk_idx >= 0]
            expected = torch.bincount(ids, minlength=E)[rank * local:(rank + 1) * local]
            assert torch.equal(mine["stats"].long(), expected), f"{name}, rank {rank}: recv stats"
        check_against_reference(stitch([r[name]["compat"] for r in per_rank]), problem)

    for index, name in enumerate(LAYERED[world]):
        problem = problems[name][0]
        layered = stitch([r["layered"][index] for r in per_rank])
        alone = stitch([r[name]["compat"] for r in per_rank])
        for output in OUTPUT_NAMES:
            assert torch.equal(getattr(layered, output), getattr(alone, output)), (
                f"layered {name}: {output} differs from the same layer run alone")
        check_against_reference(layered, problem)
