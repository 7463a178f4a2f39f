"""Where primemoe.Buffer's dispatch and combine spend their time, at EP = number of GPUs.

Per (shape, tokens): the region times as the benchmark takes them (L2 flush and rank alignment
before each region), the same with the GPU queue filled first (a sleep kernel, so the host's
enqueue is off the clock), and each GPU kernel's mean time (torch.profiler), on every rank.

    python scripts/comm_profile.py [--shapes ...] [--tokens ...] [--num-sms 16] [--iters 20] [--out FILE]
"""
import argparse
import collections
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

from primemoe.bench import L2_FLUSH_BYTES, MULTICAST_OFF, SHAPES, _free_port, direction_bytes, make_inputs, remote_rows

SLEEP_CYCLES = 400_000  # ~0.2 ms at H200 clocks: longer than the host takes to enqueue either region


def _regions(buffer, inp, flush, token, group, iters, fill_queue):
    disp, comb = [], []
    rows = torch.randn_like(buffer.region("recv_rows"))
    for _ in range(iters):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        flush.zero_()
        dist.all_reduce(token, group=group)
        if fill_queue:
            torch.cuda._sleep(SLEEP_CYCLES)
        ev[0].record()
        state = buffer.dispatch(inp.x, inp.topk_idx, inp.topk_weights)
        ev[1].record()
        flush.zero_()
        dist.all_reduce(token, group=group)
        if fill_queue:
            torch.cuda._sleep(SLEEP_CYCLES)
        ev[2].record()
        buffer.combine(rows, state[1])
        ev[3].record()
        disp.append(ev)
    torch.cuda.synchronize()
    return ([e[0].elapsed_time(e[1]) for e in disp], [e[2].elapsed_time(e[3]) for e in disp])


def _kernels(buffer, inp, flush, token, group, iters):
    from torch.profiler import ProfilerActivity, profile
    rows = torch.randn_like(buffer.region("recv_rows"))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush.zero_()
            dist.all_reduce(token, group=group)
            state = buffer.dispatch(inp.x, inp.topk_idx, inp.topk_weights)
            flush.zero_()
            dist.all_reduce(token, group=group)
            buffer.combine(rows, state[1])
        torch.cuda.synchronize()
    times = collections.defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            times[ev.name].append(ev.device_time_total / 1e3)
    return {name: (len(v) // iters, statistics.mean(v)) for name, v in times.items()}


def _worker(rank, world, port, args, queue):
    os.environ.update(MULTICAST_OFF, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import primemoe
    group = dist.group.WORLD
    device = torch.device("cuda", rank)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)
    token = torch.zeros(1, device=device)
    out = {}
    try:
        for shape in args.shapes:
            hidden, inter, experts, top_k = SHAPES[shape]
            with primemoe.Buffer(group, max_tokens_per_rank=max(args.tokens), hidden=hidden, intermediate=inter,
                                 num_experts=experts, top_k=top_k, num_sms=args.num_sms) as buffer:
                for tokens in args.tokens:
                    inp = make_inputs(shape, tokens, rank, world, device, seed=0)
                    remote = remote_rows(inp.topk_idx, inp.w1.shape[0], rank)
                    _regions(buffer, inp, flush, token, group, 5, False)
                    plain = _regions(buffer, inp, flush, token, group, args.iters, False)
                    filled = _regions(buffer, inp, flush, token, group, args.iters, True)
                    kernels = _kernels(buffer, inp, flush, token, group, 5)
                    mb = direction_bytes(remote, hidden) / 1e6
                    out[f"{shape}/{tokens}"] = {
                        "remote_mb": mb,
                        "dispatch_ms": statistics.median(plain[0]), "combine_ms": statistics.median(plain[1]),
                        "dispatch_ms_queue_filled": statistics.median(filled[0]),
                        "combine_ms_queue_filled": statistics.median(filled[1]),
                        "kernels": kernels}
                    del inp
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b", "qwen3-235b-a22b"], choices=sorted(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[8192, 16384])
    p.add_argument("--num-sms", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    world = torch.cuda.device_count()
    if world < 2:
        print("comm_profile: needs 2+ GPUs", file=sys.stderr)
        return 1
    import torch.multiprocessing as mp
    queue = mp.get_context("spawn").Queue()
    procs = mp.start_processes(_worker, args=(world, _free_port(), args, queue), nprocs=world, join=False,
                               start_method="spawn")
    results = dict(queue.get() for _ in range(world))  # before joining: a child exits once its result is read
    while not procs.join():
        pass
    for case in results[0]:
        print(f"== {case}: {results[0][case]['remote_mb']:.1f} MB per direction (rank 0)")
        for rank in sorted(results):
            r = results[rank][case]
            mb = r["remote_mb"]
            print(f"  rank {rank}: dispatch {r['dispatch_ms']:.3f} ms ({mb / r['dispatch_ms']:.0f} GB/s), "
                  f"queue filled {r['dispatch_ms_queue_filled']:.3f} ms ({mb / r['dispatch_ms_queue_filled']:.0f}); "
                  f"combine {r['combine_ms']:.3f} ms ({mb / r['combine_ms']:.0f}), "
                  f"queue filled {r['combine_ms_queue_filled']:.3f} ms ({mb / r['combine_ms_queue_filled']:.0f})")
            # Mangled names of one file's kernels share their start: print their ends.
            for name, (per_iter, ms) in sorted(r["kernels"].items(), key=lambda kv: -kv[1][1]):
                print(f"      {ms:8.4f} ms x{per_iter}  {name[-70:]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
