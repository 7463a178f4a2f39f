"""Expert parallelism in spawned processes: the NCCL baseline harness (``run_ep_case``), the cases shared with
the NVSHMEM Buffer tests, and how a rank is placed on the GPUs (``rank_mode``).

Placement (DESIGN.md sections 5, 6): with at least ``world`` GPUs each rank gets its own GPU and the process
group is NCCL (``GPU_PER_RANK``); with fewer, every rank runs on cuda:0 and the group is gloo (``SAME_GPU``:
NCCL refuses two ranks on one GPU, NVSHMEM runs several processes per GPU). With ``PRIMEMOE_TEST_MPS=1`` (CUDA
MPS running, scripts/mps.sh) each rank takes ``100 // ranks_per_gpu`` percent of the SMs.

For primemoe.baseline.moe(..., group=...): the parent draws one global problem (concatenated tokens of all ranks, all E
experts), each spawned rank runs its tokens against its contiguous slice of
experts, and the parent compares the stitched results with the single-process
fp64 reference of the whole problem. A failing rank fails the spawn, hence the test.
"""

from __future__ import annotations

import os
import uuid

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import (OUTPUT_NAMES, PRIMEMOE_ROOT, Outputs, Problem, assert_moe_outputs_match, make_problem,
                     reference64, run_moe)
from naive import composite

import primemoe


# Two-rank cases shared by the NCCL baseline and the NVSHMEM Buffer tests.
EP_CASES = {
    "different_T": dict(tokens_per_rank=(300, 17), routing="uniform"),
    "different_T_masked": dict(tokens_per_rank=(300, 17), routing="masked"),
    "skewed": dict(tokens_per_rank=(1024, 333), routing="skewed"),
    "rank0_without_tokens": dict(tokens_per_rank=(0, 64), routing="uniform"),
    "rank1_without_tokens": dict(tokens_per_rank=(64, 0), routing="uniform"),
    "one_expert": dict(tokens_per_rank=(200, 50), routing="one_expert"),
    "empty_experts": dict(tokens_per_rank=(100, 100), routing="empty_experts"),
}

# The same matrix over four ranks (E must divide by 4: 8 experts, 2 per rank), at most ~300 tokens per rank.
EP4_CASES = {
    "different_T": dict(tokens_per_rank=(300, 17, 128, 5), routing="uniform"),
    "different_T_masked": dict(tokens_per_rank=(300, 17, 128, 5), routing="masked"),
    "skewed": dict(tokens_per_rank=(256, 300, 33, 100), routing="skewed"),
    "rank0_without_tokens": dict(tokens_per_rank=(0, 64, 100, 31), routing="uniform"),
    "two_ranks_without_tokens": dict(tokens_per_rank=(64, 0, 200, 0), routing="uniform"),
    "one_expert": dict(tokens_per_rank=(200, 50, 0, 120), routing="one_expert"),
    "empty_experts": dict(tokens_per_rank=(100, 100, 100, 100), routing="empty_experts"),
}

EP_CASES_BY_WORLD = {2: EP_CASES, 4: EP4_CASES}


# ---------------------------------------------------------------- placing the ranks on the GPUs

GPU_PER_RANK = "gpu_per_rank"  # rank r on cuda:r, NCCL group
SAME_GPU = "same_gpu"  # every rank on cuda:0, gloo group
EP_MODE_ENV = "PRIMEMOE_TEST_EP_MODE"  # set by the parent for its spawned ranks (see buffer_ranks.spawn_ranks)
MPS_ENV = "PRIMEMOE_TEST_MPS"  # "1": the ranks are MPS clients; each sets its share of the SMs
FULL_SMS_ENV = "PRIMEMOE_TEST_FULL_SMS"  # the GPU's SM count without MPS (scripts/gpu_run.sh ep): checks the share


def rank_mode(world: int, device_count=None) -> str:
    """``GPU_PER_RANK`` when there are at least ``world`` CUDA devices, else ``SAME_GPU``."""
    if device_count is None:
        device_count = torch.cuda.device_count()  # 0 without CUDA
    return GPU_PER_RANK if device_count >= world else SAME_GPU


def chosen_mode(world: int) -> str:
    """The placement of a spawn of ``world`` ranks: PRIMEMOE_TEST_EP_MODE where set (e.g. ``same_gpu`` to run the
    shared-GPU mode on a machine with enough GPUs), else ``rank_mode(world)``."""
    mode = os.environ.get(EP_MODE_ENV)
    if not mode:
        return rank_mode(world)
    rank_placement(mode, 0, world)  # a known mode
    if mode == GPU_PER_RANK and torch.cuda.device_count() < world:
        raise ValueError(f"{EP_MODE_ENV}={mode}: {world} ranks need {world} GPUs, found {torch.cuda.device_count()}")
    return mode


def rank_placement(mode: str, rank: int, world: int):
    """``(backend, CUDA device index, ranks sharing that GPU)`` of ``rank`` in ``mode``."""
    if mode == GPU_PER_RANK:
        return "nccl", rank, 1
    if mode == SAME_GPU:
        return "gloo", 0, world
    raise ValueError(f"{EP_MODE_ENV}: expected {GPU_PER_RANK!r} or {SAME_GPU!r}, got {mode!r}")


def mps_enabled(env=None) -> bool:
    return (os.environ if env is None else env).get(MPS_ENV) == "1"


def mps_thread_percentage(mode: str, world: int) -> int:
    """CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of each rank: an equal share of the GPU it shares."""
    return 100 // rank_placement(mode, 0, world)[2]


def ep_id(world: int, mode=None) -> str:
    """A test id naming the rank count and placement, e.g. ``ep4_same_gpu`` (``_mps`` under MPS)."""
    mode = chosen_mode(world) if mode is None else mode
    return f"ep{world}_{mode}" + ("_mps" if mps_enabled() else "")


RENDEZVOUS_ENV = "PRIMEMOE_TEST_RENDEZVOUS"


def prepare_spawn(monkeypatch, directory, **env):
    """A rendezvous in ``directory`` (the test's tmp_path) and ``env`` for the ranks to inherit; they
    also inherit sys.path, so the primemoe this process imported goes first (another test may have put
    a source tree there). The rendezvous is a new file, not a TCP port: a free port picked here could
    be taken before rank 0 listens on it (seen once on the GPU machine, EADDRINUSE)."""
    path = os.path.join(directory, f"rendezvous-{uuid.uuid4().hex}")
    for name, value in dict(env, **{RENDEZVOUS_ENV: f"file://{path}"}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.syspath_prepend(PRIMEMOE_ROOT)


def init_rank(backend, rank, world, **kwargs):
    """The spawned rank's process group, over the rendezvous prepare_spawn made."""
    dist.init_process_group(backend, init_method=os.environ[RENDEZVOUS_ENV], rank=rank, world_size=world, **kwargs)


def token_slices(tokens_per_rank):
    starts = [sum(tokens_per_rank[:r]) for r in range(len(tokens_per_rank))]
    return [slice(s, s + t) for s, t in zip(starts, tokens_per_rank)]


def expert_slices(num_experts, world):
    local = num_experts // world
    return [slice(r * local, (r + 1) * local) for r in range(world)]


def rank_problem(problem: Problem, rank: int, tokens_per_rank, device) -> Problem:
    """Rank ``rank``'s tokens (global expert ids kept) and its local experts' weights."""
    rows = token_slices(tokens_per_rank)[rank]
    experts = expert_slices(problem.w1.shape[0], len(tokens_per_rank))[rank]
    return Problem(x=problem.x[rows], topk_idx=problem.topk_idx[rows], topk_weights=problem.topk_weights[rows],
                   w1=problem.w1[experts], w2=problem.w2[experts], dy=problem.dy[rows]).to(device)


def _rank_main(rank, world, backend, problem_path, tokens_per_rank, out_dir):
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        init_rank(backend, rank, world, device_id=device)
    else:
        device = torch.device("cpu")
        init_rank(backend, rank, world)
    try:
        mine = rank_problem(Problem(**torch.load(problem_path)), rank, tokens_per_rank, device)
        out = run_moe(lambda *args: primemoe.baseline.moe(*args, group=dist.group.WORLD), mine)
        torch.save({k: v.cpu() for k, v in vars(out).items()}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ep_case(tmp_path, backend, tokens_per_rank, shape, routing, seed, device):
    """Runs the case on ``len(tokens_per_rank)`` ranks (after ``prepare_spawn``) and checks it
    against the fp64 reference on ``device``."""
    world = len(tokens_per_rank)
    hidden, inter, experts, top_k = shape
    problem = make_problem(sum(tokens_per_rank), hidden, inter, experts, top_k, routing=routing, seed=seed)
    problem_path = str(tmp_path / "problem.pt")
    torch.save(vars(problem), problem_path)
    mp.spawn(_rank_main, args=(world, backend, problem_path, tokens_per_rank, str(tmp_path)), nprocs=world, join=True)

    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for rank, t in enumerate(tokens_per_rank):
        assert per_rank[rank]["y"].shape[0] == t, f"rank {rank}: y has the wrong number of tokens"
    # Tokens in rank order, experts in rank order: the layout of the single-process problem.
    stitched = Outputs(**{name: torch.cat([r[name] for r in per_rank]) for name in OUTPUT_NAMES}).to(device)
    problem = problem.to(device)
    assert_moe_outputs_match(stitched, reference64(problem), composite(problem), problem)
