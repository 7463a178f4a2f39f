"""Rank side of tests/gpu/test_buffer_gpu.py: ``primemoe.Buffer`` in spawned processes. Each entry point
``fn(rank, world, ...)`` loads the inputs the parent wrote and saves what the parent checks; a failing rank
fails the spawn. ``ep_rank`` places the rank (ep_harness.rank_mode): one GPU per rank over an NCCL group where
there are enough GPUs, else every rank on cuda:0 over a gloo group (NVSHMEM is bootstrapped over either)."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ep_harness import (EP_MODE_ENV, FULL_SMS_ENV, chosen_mode, init_rank, mps_enabled, mps_thread_percentage,
                        rank_mode, rank_placement, rank_problem)
from helpers import Outputs, Problem, graph_replays, run_moe

import primemoe


@contextmanager
def _environment(**values):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def spawn_ranks(fn, world, *args, timeout_s=600):
    """Runs ``fn(rank, world, *args)`` in ``world`` processes, placed by ``chosen_mode(world)`` (passed to them
    in PRIMEMOE_TEST_EP_MODE); a spawn still running after ``timeout_s`` is a hang: its processes are killed
    and the test fails."""
    mode = chosen_mode(world)
    print(f"spawning {world} rank(s): {mode}{' under MPS' if mps_enabled() else ''}", flush=True)
    with _environment(**{EP_MODE_ENV: mode}):
        context = mp.start_processes(fn, args=(world, *args), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            try:
                context.join()
            except Exception as error:  # the rank's own traceback, when it wrote one before hanging
                raise AssertionError(f"{world} ranks ({mode}) still running after {timeout_s} s (a hang)") from error
            raise AssertionError(f"{world} ranks ({mode}) still running after {timeout_s} s (a hang)")


@contextmanager
def ep_rank(rank, world):
    """This rank's CUDA device and process group (destroyed on exit); yields the device.

    The mode comes from the parent (PRIMEMOE_TEST_EP_MODE), else from ``rank_mode(world)``. Under MPS
    (PRIMEMOE_TEST_MPS=1) CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is set to this rank's share before CUDA starts
    here, and with PRIMEMOE_TEST_FULL_SMS (the SM count without MPS) a shared GPU must report fewer SMs."""
    mode = os.environ.get(EP_MODE_ENV) or rank_mode(world)
    backend, index, sharing = rank_placement(mode, rank, world)
    mps = mps_enabled()
    if mps:
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(mps_thread_percentage(mode, world))
    torch.cuda.set_device(index)
    device = torch.device("cuda", index)
    if backend == "nccl":
        init_rank(backend, rank, world, device_id=device)
    else:
        init_rank(backend, rank, world)
    try:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        share = f", MPS {os.environ['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE']}%" if mps else ""
        print(f"rank {rank}/{world}: {mode} ({backend}) on {device}, {sms} SMs{share}", flush=True)
        full = os.environ.get(FULL_SMS_ENV)
        if mps and full and sharing > 1:
            assert sms < int(full), (
                f"rank {rank}: under MPS at {os.environ['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE']}% the device reports "
                f"{sms} SMs, as many as without MPS ({full}): this process is not an MPS client")
        yield device
    finally:
        dist.destroy_process_group()


def _all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over the group; through the host when the group is gloo."""
    if dist.get_backend() == "gloo":
        tensor = tensor.cpu()
    dist.all_reduce(tensor)
    return tensor


def buffer_sizes(problem: Problem, world: int, max_tokens: int) -> dict:
    """Buffer arguments for a problem given with all of its experts (``problem.w1`` [E, 2I, H])."""
    experts, two_i, hidden = problem.w1.shape
    return dict(max_tokens_per_rank=max_tokens, hidden=hidden, intermediate=two_i // 2, num_experts=experts,
                top_k=problem.topk_idx.shape[1])


def _cpu(outputs: Outputs) -> dict:
    return {name: value.cpu() for name, value in vars(outputs).items()}


# ---------------------------------------------------------------- one rank: create, destroy, recreate


def single_rank_lifecycle(rank, world, problem_path, out_dir):
    """Four buffers one after the other on the same problem; the last is left open for atexit."""
    results = {}
    with ep_rank(rank, world) as device:
        problem = Problem(**torch.load(problem_path)).to(device)
        sizes = buffer_sizes(problem, world, problem.x.shape[0] + 100)
        for attempt in range(2):
            buffer = primemoe.Buffer(dist.group.WORLD, **sizes)
            assert buffer.nbytes > 0, repr(buffer)
            assert os.environ["NVSHMEM_DISABLE_NVLS"] == "1"
            results[f"attempt{attempt}"] = _cpu(run_moe(partial(primemoe.moe, buffer=buffer), problem))
            if attempt == 0:
                recompute = partial(primemoe.moe, buffer=buffer, keep_fc1=False)
                results["recompute_fc1"] = _cpu(run_moe(recompute, problem))
            primemoe.check_errors()
            buffer.close()
            buffer.close()  # idempotent
            assert buffer.closed and "closed" in repr(buffer)
        with primemoe.Buffer(dist.group.WORLD, **sizes) as buffer:
            results["context_manager"] = _cpu(run_moe(partial(primemoe.moe, buffer=buffer), problem))
        assert buffer.closed
        with primemoe.Buffer(dist.group.WORLD, **sizes, overlap=False) as buffer:
            results["sequential"] = _cpu(run_moe(partial(primemoe.moe, buffer=buffer), problem))
        # Left open: freed (collectively) by the atexit hook when this process exits.
        buffer = primemoe.Buffer(dist.group.WORLD, **sizes)
        results["left_open"] = _cpu(run_moe(partial(primemoe.moe, buffer=buffer), problem))
        primemoe.check_errors()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


# ---------------------------------------------------------------- dispatch and combine alone


def dispatch_cases(rank, world, cases_path, out_dir):
    """Each case: ep_dispatch, the receive region, then ep_combine echoing every received row
    (and its routing weight as the row scalar) back to its source slot. Also the workspace's size
    and whether it has the put staging region."""
    data = torch.load(cases_path)
    results = {}
    with ep_rank(rank, world) as device, primemoe.Buffer(dist.group.WORLD, **data["sizes"]) as buffer:
        for name, case in data["cases"].items():
            x, topk_idx, topk_weights = (t.to(device) for t in case["inputs"][rank])
            counts, offsets, slot_valid = buffer.dispatch(x, topk_idx, topk_weights)
            total = int(offsets[-1])
            received = {region: buffer.region(region)[:total].clone()
                        for region in ("recv_rows", "recv_meta", "recv_weights")}
            buffer.combine(buffer.region("recv_rows").clone(), offsets, buffer.region("recv_weights").clone())
            slots = topk_idx.numel()
            echoed = {region: buffer.region(region)[:slots].clone()
                      for region in ("combine_rows", "combine_scalars", "combine_map")}
            try:
                primemoe.check_errors()
                error = None
            except primemoe.DeviceError as raised:
                error = str(raised)
            results[name] = {key: value.cpu() for key, value in dict(
                counts=counts, offsets=offsets, slot_valid=slot_valid, **received, **echoed).items()}
            results[name]["error"] = error
        results["workspace"] = dict(nbytes=buffer.nbytes, put_peers=buffer.put_peers)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


# ---------------------------------------------------------------- moe(buffer=...)


def _leaves(problem: Problem):
    return [t.detach().clone().requires_grad_() for t in (problem.x, problem.topk_weights, problem.w1, problem.w2)]


def _layered(moe, first: Problem, second: Problem):
    """Two layers sharing the buffer: both forwards, then one backward through both."""
    leaves = [_leaves(first), _leaves(second)]
    ys = [moe(x, p.topk_idx, tw, w1, w2) for p, (x, tw, w1, w2) in zip((first, second), leaves)]
    grads = torch.autograd.grad(ys, leaves[0] + leaves[1], [first.dy, second.dy])
    return [Outputs(ys[0].detach(), *grads[:4]), Outputs(ys[1].detach(), *grads[4:])]


def moe_cases(rank, world, cases_path, out_dir):
    """Every case through one Buffer, then, where ``data`` names them: a repeat (bitwise), two layers sharing
    the buffer, CUDA-graph replay against eager, and the cases ``data["sequential"]`` / ``data["combine_overlap"]``
    again through a Buffer with overlap=False / overlap_combine=True. ``data["precision"]`` (default bf16): the Buffer's and the calls'."""
    data = torch.load(cases_path)
    precision = data.get("precision", "bf16")
    with ep_rank(rank, world) as device:
        def mine(case):
            return rank_problem(Problem(**case["problem"]), rank, case["tokens_per_rank"], device)

        results = {}
        with primemoe.Buffer(dist.group.WORLD, **data["sizes"], precision=precision) as buffer:
            moe = partial(primemoe.moe, buffer=buffer, precision=precision)
            for name, case in data["cases"].items():
                results[name] = _cpu(run_moe(moe, mine(case)))
            if data.get("repeat") is not None:
                repeat = mine(data["cases"][data["repeat"]])
                results["repeat"] = _cpu(run_moe(moe, repeat))
                # The same call with one rank late: the last on the host (it starts 0.3 s after the others, which
                # wait for it on the device), rank 0 on the device (a 20 ms spin queued before its dispatch, so the
                # others' sends and FC1 run before its own).
                if rank == world - 1:
                    time.sleep(0.3)
                results["host_delayed"] = _cpu(run_moe(moe, repeat))
                if rank == 0:
                    torch.cuda._sleep(30_000_000)
                results["device_delayed"] = _cpu(run_moe(moe, repeat))
            if data.get("layered") is not None:
                layered = data["layered"]
                results["layered"] = [_cpu(o) for o in _layered(moe, *(mine(data["cases"][n]) for n in layered))]
            if data.get("graph") is not None:
                graph = data["graph"]
                results["graph"] = [(_cpu(replayed), _cpu(eager)) for replayed, eager in
                                    graph_replays(moe, mine(graph["static"]), [mine(c) for c in graph["replays"]])]
            primemoe.check_errors()
        for key, options in (("sequential", dict(overlap=False)), ("combine_overlap", dict(overlap_combine=True))):
            if data.get(key):
                with primemoe.Buffer(dist.group.WORLD, **data["sizes"], precision=precision, **options) as buffer:
                    moe = partial(primemoe.moe, buffer=buffer, precision=precision)
                    results[key] = {name: _cpu(run_moe(moe, mine(data["cases"][name]))) for name in data[key]}
                    primemoe.check_errors()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


# ---------------------------------------------------------------- soak


def _fresh_tokens(buffer, gen, device):
    """A random token count (0 to max_tokens_per_rank), its rows and routing with 10% of the slots skipped."""
    K, E, H = buffer.top_k, buffer.num_experts, buffer.hidden
    tokens = int(torch.randint(0, buffer.max_tokens_per_rank + 1, (1,), generator=gen))
    x = torch.randn(tokens, H, generator=gen).to(device, torch.bfloat16)
    topk_idx, topk_weights = primemoe.route(torch.randn(tokens, E, generator=gen), K)
    topk_idx = topk_idx.masked_fill(torch.rand(tokens, K, generator=gen) < 0.1, -1).to(device)
    return x, topk_idx, topk_weights.to(device)


def _expert_weights(local_experts, hidden, inter, gen, device):
    """``(w1, w2)`` bf16 of this rank's experts, scaled so that activations stay O(1)."""
    w1 = torch.randn(local_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(local_experts, hidden, inter, generator=gen) * inter ** -0.5
    return w1.to(device, torch.bfloat16), w2.to(device, torch.bfloat16)


def _soak_iteration(buffer, gen, device, iteration):
    """One dispatch + combine with fresh routing and token count; checks the echo exactly."""
    K = buffer.top_k
    x, topk_idx, topk_weights = _fresh_tokens(buffer, gen, device)
    tokens = x.shape[0]

    counts, offsets, slot_valid = buffer.dispatch(x, topk_idx, topk_weights)
    received = buffer.region("recv_rows").clone()
    buffer.combine(received, offsets, buffer.region("recv_weights").clone())
    valid = slot_valid.view(-1)
    # The rows of this rank's own slots stay in the combine's input, at receive row -2 - combine_map[slot].
    own = valid & (topk_idx.view(-1) // buffer.local_experts == buffer.rank)
    slot_map = buffer.region("combine_map")[:tokens * K]
    assert torch.equal(slot_map[valid & ~own], torch.arange(tokens * K, device=device)[valid & ~own].int()), \
        f"iteration {iteration}: combine_map of the slots sent away"
    assert (slot_map[~valid] == -1).all(), f"iteration {iteration}: combine_map of the slots not routed"
    echoed = buffer.region("combine_rows")[:tokens * K].clone()
    echoed[own] = received[(-2 - slot_map[own]).long()]
    rows = echoed[valid]
    scalars = buffer.region("combine_scalars")[:tokens * K][valid]
    assert torch.equal(valid, (topk_idx >= 0).view(-1)), f"iteration {iteration}: slot_valid"
    assert torch.equal(rows, x.repeat_interleave(K, 0)[valid]), f"iteration {iteration}: echoed rows"
    assert torch.equal(scalars, topk_weights.view(-1)[valid]), f"iteration {iteration}: echoed scalars"
    # Every routed slot of every rank was received exactly once somewhere.
    padded = ((counts.long() + buffer.row_align - 1) // buffer.row_align * buffer.row_align).sum()
    assert offsets[-1] == padded, f"iteration {iteration}: offsets {offsets.tolist()} for counts {counts.tolist()}"
    sent_received = _all_reduce(torch.stack([valid.sum(), counts.sum().long()]))
    assert sent_received[0] == sent_received[1], f"iteration {iteration}: sent {sent_received.tolist()}"


def soak(rank, world, sizes, iterations, out_dir):
    with ep_rank(rank, world) as device, primemoe.Buffer(dist.group.WORLD, **sizes) as buffer:
        gen = torch.Generator().manual_seed(1000 + rank)
        steady_from = 10
        for iteration in range(iterations):
            if iteration == steady_from:
                allocated = torch.cuda.memory_allocated(device)
            _soak_iteration(buffer, gen, device, iteration)
        primemoe.check_errors()
        torch.save({"iterations": iterations, "allocated": (allocated, torch.cuda.memory_allocated(device))},
                   os.path.join(out_dir, f"rank{rank}.pt"))


def _layer_step(buffer, w1, w2, gen, device, keep_fc1):
    """One forward + backward of ``moe(buffer=)`` on fresh tokens and routing (10% of the slots skipped):
    ``(y, dx, d_topk_weights, dw1, dw2)`` and the inputs that made them."""
    x, topk_idx, topk_weights = _fresh_tokens(buffer, gen, device)
    dy = torch.randn(x.shape, generator=gen).to(device, torch.bfloat16)
    return (x, topk_idx, topk_weights, dy), _layer_grads(buffer, w1, w2, x, topk_idx, topk_weights, dy, keep_fc1)


def _layer_grads(buffer, w1, w2, x, topk_idx, topk_weights, dy, keep_fc1):
    x, topk_weights = x.detach().requires_grad_(), topk_weights.detach().requires_grad_()
    y = primemoe.moe(x, topk_idx, topk_weights, w1, w2, buffer=buffer, keep_fc1=keep_fc1)
    return (y.detach(), *torch.autograd.grad(y, [x, topk_weights, w1, w2], dy))


def layer_soak(rank, world, sizes, iterations, out_dir):
    """``iterations`` forward+backward steps of the layer over one Buffer, fresh token count (0 included) and
    routing every step, keep_fc1 alternating: every output finite (counted on the device, read once at the end),
    every 50th step repeated on the same inputs bitwise, allocated memory steady after the first steps."""
    with ep_rank(rank, world) as device, primemoe.Buffer(dist.group.WORLD, **sizes) as buffer:
        gen = torch.Generator().manual_seed(3000 + rank)
        E_local, H, I = buffer.local_experts, buffer.hidden, buffer.intermediate
        w1, w2 = (w.requires_grad_() for w in _expert_weights(E_local, H, I, gen, device))
        not_finite = torch.zeros((), dtype=torch.int64, device=device)
        repeats_differing = torch.zeros((), dtype=torch.int64, device=device)
        steady_from = 20
        for iteration in range(iterations):
            if iteration == steady_from:
                allocated = torch.cuda.memory_allocated(device)
            keep_fc1 = iteration % 2 == 0
            inputs, outputs = _layer_step(buffer, w1, w2, gen, device, keep_fc1)
            not_finite += sum((~out.isfinite()).sum() for out in outputs)
            if iteration % 50 == 49:
                again = _layer_grads(buffer, w1, w2, *inputs, keep_fc1)
                repeats_differing += sum(int(not torch.equal(a, b)) for a, b in zip(outputs, again))
                del again
            del inputs, outputs  # nothing of the step outlives it: the memory check below
        final = torch.cuda.memory_allocated(device)
        primemoe.check_errors()
        torch.save({"iterations": iterations, "allocated": (allocated, final), "not_finite": int(not_finite),
                    "repeats_differing": int(repeats_differing)}, os.path.join(out_dir, f"rank{rank}.pt"))



def capacity_cases(rank, world, sizes, max_recv_rows, out_dir):
    """A Buffer with ``max_recv_rows`` next to a default one: a dispatch within the capacity matches it; one that
    brings rank 0 more rows records the overflow on every rank (no hang) and the next call works again."""
    with ep_rank(rank, world) as device:
        gen = torch.Generator().manual_seed(4000 + rank)
        E_local, H, I, K = sizes["num_experts"] // world, sizes["hidden"], sizes["intermediate"], sizes["top_k"]
        w1, w2 = _expert_weights(E_local, H, I, gen, device)

        def problem(tokens, everything_to_expert0=False):
            x = torch.randn(tokens, H, generator=gen).to(device, torch.bfloat16)
            idx, weights = primemoe.route(torch.randn(tokens, sizes["num_experts"], generator=gen), K)
            if everything_to_expert0:
                idx = torch.zeros_like(idx)
            dy = torch.randn(tokens, H, generator=gen).to(device, torch.bfloat16)
            return Problem(x=x, topk_idx=idx.to(device), topk_weights=weights.to(device), w1=w1, w2=w2, dy=dy)

        fits = problem(sizes["max_tokens_per_rank"] // 2)
        overflows = problem(sizes["max_tokens_per_rank"], everything_to_expert0=True)
        results = {}
        with primemoe.Buffer(dist.group.WORLD, **sizes) as default:
            results["default"] = _cpu(run_moe(partial(primemoe.moe, buffer=default), fits))
        with primemoe.Buffer(dist.group.WORLD, **sizes, max_recv_rows=max_recv_rows) as capped:
            results["fits"] = _cpu(run_moe(partial(primemoe.moe, buffer=capped), fits))
            primemoe.check_errors()
            # Forward only, then a sync: a backward would raise the forward's error at its first op on some ranks
            # (the next primemoe call reports an earlier one) while the others wait in its dispatch.
            with torch.no_grad():
                primemoe.moe(overflows.x, overflows.topk_idx, overflows.topk_weights, w1, w2, buffer=capped)
            torch.cuda.synchronize()
            try:
                primemoe.check_errors()
                results["overflow_error"] = None
            except primemoe.DeviceError as error:
                results["overflow_error"] = str(error)
            results["again"] = _cpu(run_moe(partial(primemoe.moe, buffer=capped), fits))
            primemoe.check_errors()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
