"""Expert parallelism over 2 processes for primemoe.baseline.moe(..., group=...).

The parent draws one global problem (concatenated tokens of all ranks, all E
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
